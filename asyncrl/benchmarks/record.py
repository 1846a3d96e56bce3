"""`asyncrl bench record`: the job with a learner that records each window and trains nothing.

The generator-only run of `asyncrl bench pipeline` (its `gen_only` variant) and the recordings the
replay generator plays back (`benchmarks/replay.py`, the `learn_only` variant) both come from here.
The launcher runs this module as the learner (`run_job(..., role_modules=...)`): the real learner
service, whose step loop hands every complete window to `record_window` instead of the trainer.
Versions still advance and weights are still published, so the generators do all their usual work;
the learner is a stand-in for an infinitely fast one. Production code knows nothing of it.

The learner itself is `record_learner.py`. Writes `<run>/trajectories.jsonl`, one JSON object per trajectory (`sample_record`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.learner.step import TrainSample

RECORDING_FILE = "trajectories.jsonl"
# The learner the launcher runs (`python -m`): its own module, so that importing this one (the
# CLI does, to register the command) loads no torch.
LEARNER_MODULE = "asyncrl.benchmarks.record_learner"


def check_recordable(config: Config) -> None:
    """ValueError unless the job's windows can be recorded (one rank, window admission)."""
    if config.learner.world_size > 1:
        raise ValueError("asyncrl bench record trains nothing: use it with learner.world_size = 1")
    if config.buffer.mode != "window":
        raise ValueError("asyncrl bench record records admission windows: use it with buffer.mode = 'window'")


def sample_record(step: int, s: TrainSample) -> dict:
    """One trajectory as a JSON-able dict (what the replay generator reads back)."""
    return {
        "step": step,
        "group_id": s.group_id,
        "sample_index": s.sample_index,
        "prompt_ids": list(s.prompt_ids),
        "completion_ids": s.completion_ids.tolist(),
        "behavior_logprobs": s.behavior_logprobs.tolist(),
        "token_versions": s.token_versions.tolist(),
        "reward": s.reward,
    }


def command(
    config: Annotated[
        Path | None, typer.Argument(help="TOML config file (default: the embedded job)")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a config key: --set learner.steps=20")
    ] = None,
    no_tui: Annotated[
        bool, typer.Option("--no-tui", help="Plain log lines (the only view this command has)")
    ] = True,
) -> None:
    """Run the job with a learner that records every window to <run>/trajectories.jsonl and trains nothing."""
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError
    from asyncrl.job import RunFailed, run_job
    from asyncrl.models.hf import quiet_offline
    from asyncrl.monitor.live import PlainReporter

    quiet_offline()
    try:
        cfg = load_config(config, set_ or [])
        check_recordable(cfg)
        summary = run_job(cfg, PlainReporter(), role_modules={"learner": LEARNER_MODULE})
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except RunFailed as exc:
        typer.echo(f"error: run failed: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(
        f"recorded {summary.trajectories_trained} trajectories to {Path(summary.run_dir) / RECORDING_FILE}"
    )
