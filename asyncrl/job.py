"""A whole `asyncrl launch` job around the launcher: run directory, evaluation before and after,
`summary.json`. The app layer: it wires the roles together (the scheduler's launcher, the
monitor's stream as where the launcher's records go, the learner's checkpoints for `--resume`) and is
called by the CLI and the benchmarks; rendering stays in the CLI's reporter.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import uvloop

from asyncrl.config import Config
from asyncrl.config_load import write_resolved_config
from asyncrl.generators.teacher_routing import read_cache_counts
from asyncrl.lint import Finding, lint
from asyncrl.runtime import check_cpus
from asyncrl.scheduler.records import Reporter, RunState
from asyncrl.scheduler.service import Launcher, RunFailed
from asyncrl.scheduler.summary import AuthFailures, DatasetPosition, RejectedFrames, RunSummary, write_summary
from asyncrl.tasks.base import Task

log = logging.getLogger(__name__)

# The held-out reward means' entry that is a count: held-out samples with a reward that failed.
NUM_FAILED = "num_failed"


def model_path(config: Config) -> Path:
    from asyncrl.models.default import DEFAULT_MODEL_DIR

    path = Path(config.model.path) if config.model.path else DEFAULT_MODEL_DIR
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.path {path} is not a Hugging Face model directory (no config.json); "
            "point it at a local checkpoint, or leave it empty for the embedded default"
        )
    return path


# What a new run directory may already hold: `asyncrl slurm`'s batch script, keys and job logs
# (asyncrl/slurm/submit.py), written before the job's first launch.
PREPARED_ENTRIES = frozenset({"slurm"})


def make_run_dir(config: Config) -> Path:
    name = config.run.name or datetime.now().strftime("%Y%m%d-%H%M%S-") + config.mode
    run_dir = Path(config.run.out_dir) / name
    if run_dir.exists() and any(p.name not in PREPARED_ENTRIES for p in run_dir.iterdir()):
        raise ValueError(f"run directory {run_dir} already exists and is not empty; choose another run.name")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def evaluate(config: Config, path: Path, task: Task) -> tuple[float, dict[str, float]]:
    """Greedy held-out accuracy (the same decoding before and after training) and, with
    `task.rewards`, each reward's held-out mean. Without rewards the task scores (accuracy = its
    mean score); with them, accuracy is the mean of `task.scoring.eval_reward` (default: the
    first reward) and the rewards run as in training (asyncrl/rewards/). Decoded on
    `task.eval_device`, `task.eval_batch_size` prompts at a time; NaN without loading anything
    when nothing is held out (`task.num_eval = 0`)."""
    if not task.eval_problems:
        return float("nan"), {}
    from asyncrl.learner.cores import resolve_threads
    from asyncrl.models.sampling import resolve_device
    from asyncrl.models.sft import checkpoint_accuracy, checkpoint_completions

    max_new = config.sampling.max_new_tokens
    decode = dict(
        max_new_tokens=max_new,
        threads=resolve_threads(config.learner.threads, cpus=config.learner.cpus),
        device=str(resolve_device(config.task.eval_device, field="task.eval_device")),
        batch_size=config.task.eval_batch_size,
    )
    if not config.task.rewards:
        return checkpoint_accuracy(path, task, **decode), {}
    from asyncrl.rewards.scorer import reward_means, score_completions

    done = checkpoint_completions(path, task, **decode)
    scores, names = score_completions(config.task, done, max_new_tokens=max_new)
    means = reward_means(scores, names)
    means[NUM_FAILED] = float(sum(s.failed for s in scores))
    return means[config.task.scoring.eval_reward or names[0]], means


def load_task(config: Config, path: Path) -> tuple[Task, Any, dict[str, int]]:
    """The run's task and tokenizer, prepared (every prompt rendered and checked once) before
    any process starts: bad data fails here, with one line."""
    from asyncrl.models.hf import load_tokenizer, prompt_room
    from asyncrl.tasks.base import check_privileged, make_task, prepare_task

    room = prompt_room(path, config.sampling.max_new_tokens)  # the model's context, less the completion
    task = make_task(config.task)
    tokenizer = load_tokenizer(path)
    stats = prepare_task(task, tokenizer, groups_per_step=config.learner.groups_per_step, room=room)
    check_privileged(task, config.opd, tokenizer)  # self-distillation: the task builds privileged prompts
    return task, tokenizer, stats


def resume_point(run_dir: Path, config: Config) -> int:
    """The newest version with both halves of a checkpoint (learner and launcher)."""
    from asyncrl.learner.checkpoint import learner_checkpoint_versions
    from asyncrl.scheduler.checkpoint import checkpoint_dir

    launcher_versions = {
        int(p.stem.split("-")[1])
        for p in checkpoint_dir(run_dir).glob("launcher-*.json")
        if p.stem[9:].isdigit()
    }
    both = sorted(set(learner_checkpoint_versions(run_dir)) & launcher_versions)
    if not both:
        raise ValueError(
            f"{run_dir} has no complete checkpoint to resume from (checkpoints/learner-*.pt and "
            "launcher-*.json of the same version); it stopped before its first one"
        )
    if both[-1] >= config.learner.steps:
        raise ValueError(f"{run_dir} already completed all {config.learner.steps} steps; nothing to resume")
    return both[-1]


# What a resume may change: where and how the learner runs, not what it trains. A checkpoint
# loads on any number of ranks, sharded or not (learner/checkpoint.py).
RESUME_SETTABLE = (
    "learner.world_size",
    "learner.sharding",
    "learner.start",
    "learner.device",
    "learner.cpu_offload",
    "learner.activation_checkpointing",
    "learner.max_tokens_per_microbatch",
    "learner.startup_timeout_s",
)


def load_for_resume(run_dir: Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, int]:
    """The run's own config (with `overrides` of the RESUME_SETTABLE keys applied and written
    back to its config.json) and the version to resume from."""
    from asyncrl.config_load import config_from_tree, config_to_dict, load_resolved_config

    if not (run_dir / "config.json").is_file():
        raise ValueError(f"--resume {run_dir}: not a run directory (no config.json)")
    config = load_resolved_config(run_dir / "config.json")
    if overrides:
        for item in overrides:
            key = item.partition("=")[0].strip()
            if key not in RESUME_SETTABLE:
                raise ValueError(
                    f"--resume: --set {key} would change what the run trains; a resume may set only "
                    f"{', '.join(RESUME_SETTABLE)}"
                )
        config = config_from_tree(config_to_dict(config), overrides)
        write_resolved_config(config, run_dir / "config.json")
    return config, resume_point(run_dir, config)


def run_job(
    config: Config,
    reporter: Reporter,
    *,
    resume_dir: Path | None = None,
    role_modules: Mapping[str, str] | None = None,
) -> RunSummary:
    """Runs the whole job (or, with `resume_dir`, continues a stopped one from its newest complete
    checkpoint); returns the summary (also written to summary.json). `role_modules` replaces the
    module a role's workers run (`python -m`), e.g. a benchmark's own learner entry module.
    Raises RunFailed (a worker failed) or ValueError (bad input) with a clear message."""
    from asyncrl.monitor.stream import open_hub

    path = model_path(config)
    check_cpus(config)
    task, tokenizer, task_stats = load_task(config, path)  # prepared and checked here, once
    run_dir, resume_version = open_run_dir(config, reporter, resume_dir)
    warnings = report_settings(config, reporter)
    for key, value in task_stats.items():
        reporter.event(f"task: {key} = {value}")
    t0 = time.perf_counter()
    held_out = HeldOut(config, path, task, reporter)
    if not resume_version:
        held_out.before_training()
    recoveries = 0
    while True:
        launcher = Launcher(
            config,
            run_dir,
            path,
            reporter,
            task=task,
            tokenizer=tokenizer,
            resume_version=resume_version,
            role_modules=role_modules,
            open_stream=partial(open_hub, run_dir=run_dir, config=config, reporter=reporter),
        )
        failure = None
        try:
            state = uvloop.run(launcher.run())
        except RunFailed as exc:
            failure = str(exc)
            state = launcher.state
        if (
            failure is None
            or (recovered := recover_learner(launcher, failure, run_dir, config, reporter, recoveries))
            is None
        ):
            break
        recoveries += 1
        resume_version = recovered
    completed = failure is None and not launcher.interrupted
    held_out.after_training(launcher.evaluations, final=run_dir / "final_model", completed=completed)
    summary = build_summary(
        config,
        launcher,
        state,
        held_out=held_out,
        task=task,
        task_stats=task_stats,
        warnings=warnings,
        run_dir=run_dir,
        resume_version=resume_version,
        wall_s=time.perf_counter() - t0,
        failure=failure,
        learner_recoveries=recoveries,
    )
    write_summary(summary, run_dir / "summary.json")
    if failure:
        raise RunFailed(failure)
    return summary


def recover_learner(
    launcher: Launcher, failure: str, run_dir: Path, config: Config, reporter: Reporter, done: int
) -> int | None:
    """After a failed run (`failure`, the reason): the version to go on from when its learner
    died and `run.recover_learner` allows one more recovery (`done` so far) from a complete
    checkpoint; None when the run fails."""
    if not launcher.learner_lost or done >= config.run.recover_learner or launcher.interrupted:
        return None
    reporter.event(failure.splitlines()[0])
    try:
        version = resume_point(run_dir, config)
    except ValueError as exc:
        reporter.event(f"the learner cannot be recovered: {exc}")
        return None
    reporter.event(
        f"recovering the learner (recovery {done + 1} of run.recover_learner = {config.run.recover_learner}): "
        f"the run goes on from the checkpoint of policy_version {version}"
    )
    return version


def open_run_dir(config: Config, reporter: Reporter, resume_dir: Path | None) -> tuple[Path, int]:
    """(the run directory, the version the run starts at): a new directory with the resolved
    config, or `resume_dir` at its newest complete checkpoint (its summary.json set aside)."""
    if resume_dir is None:
        run_dir = make_run_dir(config)
        write_resolved_config(config, run_dir / "config.json")
        resume_version = 0
    else:
        run_dir = resume_dir
        resume_version = resume_point(run_dir, config)
        if (run_dir / "summary.json").exists():
            (run_dir / "summary.json").rename(run_dir / f"summary-before-resume-{resume_version}.json")
        reporter.event(f"resuming at policy_version {resume_version}")
    reporter.event(f"run directory: {run_dir}")
    return run_dir, resume_version


def report_settings(config: Config, reporter: Reporter) -> list[Finding]:
    """The settings linter's warnings, each an event; returned for the summary."""
    warnings = [f for f in lint(config) if f.level == "warning"]
    for finding in warnings:
        reporter.event(f"settings: {finding.line()}")
    return warnings


class HeldOut:
    """The held-out evaluation before and after training. In the learner when it can be
    (`Config.evaluates_in_learner`: no second model load, overlapped with start-up; the launcher
    hands its `Evaluated` results over); otherwise here, before any process starts and after the
    last. NaN and no reward means where nothing was evaluated."""

    def __init__(self, config: Config, path: Path, task: Task, reporter: Reporter) -> None:
        self.config = config
        self.path = path
        self.task = task
        self.reporter = reporter
        self.in_learner = config.evaluates_in_learner
        self.before: tuple[float, dict[str, float]] = (float("nan"), {})
        self.after: tuple[float, dict[str, float]] = (float("nan"), {})

    def before_training(self) -> None:
        """Here, unless the learner evaluates (a resumed run evaluates nothing before)."""
        if not self.in_learner:
            self.before = evaluate(self.config, self.path, self.task)
            self.report("before", self.before)

    def after_training(
        self, in_learner: Mapping[str, tuple[float, dict[str, float]]], *, final: Path, completed: bool
    ) -> None:
        """`in_learner`: the learner's results by phase (`Launcher.evaluations`); the final model
        is evaluated only when the run completed."""
        if self.in_learner:
            self.before = in_learner.get("before", self.before)
            if completed:
                self.after = in_learner.get("after", self.after)
        elif completed and final.is_dir():
            self.after = evaluate(self.config, final, self.task)
            self.report("after", self.after)

    def report(self, phase: str, result: tuple[float, dict[str, float]]) -> None:
        accuracy, rewards = result
        self.reporter.event(
            f"held-out accuracy {phase} training: {accuracy:.3f}{_means(rewards, len(self.task.eval_problems))}"
        )


def held_out_fields(held_out: HeldOut, launcher: Launcher, task: Task) -> dict[str, Any]:
    """summary.json's held-out evaluation: before and after, and the background curve."""
    evals = launcher.evals
    return dict(
        eval_before=held_out.before[0],
        eval_after=held_out.after[0],
        eval_problems=len(task.eval_problems),
        eval_rewards_before=held_out.before[1],
        eval_rewards_after=held_out.after[1],
        eval_curve=evals.points() if evals else [],
        evals_skipped=evals.skipped if evals else [],
        evals_failed=evals.failed if evals else [],
    )


def build_summary(
    config: Config,
    launcher: Launcher,
    state: RunState,
    *,
    held_out: HeldOut,
    task: Task,
    task_stats: dict[str, int],
    warnings: list[Finding],
    run_dir: Path,
    resume_version: int,
    wall_s: float,
    failure: str | None,
    learner_recoveries: int = 0,
) -> RunSummary:
    """summary.json's record of a finished (completed, failed or interrupted) job. One
    constructor call, field by field in the file's order (scheduler/summary.py has the schema)."""
    completed = failure is None and not launcher.interrupted
    # The ledger (scheduler/tasks.py): at the end of a completed run every admitted sample must be
    # trained; otherwise samples still pending are not lost (a resume would generate them).
    # Pool mode ends with the buffer's lead admitted and not trained: pending, not lost.
    ledger = launcher.book.summary(at_end=completed and launcher.mode.trains_every_admitted_sample)
    learner = state.learner_metrics
    tally = state.rewards_tally
    train_wall = state.elapsed_s
    return RunSummary(
        mode=config.mode,
        resumed_from=resume_version,
        learner_recoveries=learner_recoveries,
        status="failed" if failure else ("interrupted" if launcher.interrupted else "completed"),
        policy_versions=state.policy_version,
        steps=state.step,
        trajectories_generated=state.trajectories_generated,
        trajectories_trained=state.trajectories_trained,
        trajectories_lost=ledger.num_samples_lost,
        trajectories_pending=ledger.num_samples_pending,
        trajectories_duplicated=ledger.num_duplicated,
        tasks_requeued=ledger.num_requeues,
        buffer_mode=config.buffer.mode,
        trajectories_evicted=ledger.num_samples_evicted,
        evicted_by_reason=ledger.evicted_by_reason,
        trajectories_replayed=ledger.num_replays,
        generator_restarts=state.generator_restarts,
        steps_skipped_nonfinite=state.steps_skipped_nonfinite,
        open_group_bound=learner.open_group_bound if learner is not None else 0,
        **held_out_fields(held_out, launcher, task),
        reward_means=tally.means(),
        reward_failures=dict(tally.failures),
        samples_scored=tally.num_scored,
        samples_with_failed_reward=tally.num_score_failed,
        samples_regenerated=tally.num_regenerated,
        samples_overlong=tally.num_overlong,
        samples_invalid_redrawn=tally.num_invalid,
        completion_lengths=state.lengths.summary(),
        task=task_stats,
        wall_s=wall_s,
        train_wall_s=train_wall,
        samples_per_s=state.trajectories_trained / max(1e-9, train_wall),
        tokens_per_s=state.tokens_generated / max(1e-9, train_wall),
        max_staleness=state.max_staleness,
        max_staleness_bound=config.effective_max_staleness,
        num_generators=config.generators.num_generators,
        duplicates=learner.duplicates if learner is not None else 0,
        rejected_frames=RejectedFrames(
            launcher=state.rejected_frames,
            learner=learner.rejected_frames if learner is not None else 0,
            launcher_by_reason=launcher.rejected_by_reason,
        ),
        stale_messages=state.stale_messages,
        auth_failures=AuthFailures(
            launcher=state.auth_failures, learner=learner.auth_failures if learner is not None else 0
        ),
        lint=[f.to_json() for f in warnings],
        run_dir=str(run_dir),
        dataset_position=dataset_position(task, next_group=launcher.mode.admission.num_admitted),
        canary=launcher.canary.summary() if launcher.canary_ids else None,
        teacher_cache=read_cache_counts(run_dir) if config.opd.cache else {},
        error=failure or None,
    )


def dataset_position(task: Task, *, next_group: int) -> DatasetPosition | None:
    """Where a dataset task's prompt stream stands (None for a task without a position)."""
    position_of = getattr(task, "position", None)
    if position_of is None:
        return None
    epoch, row = position_of(next_group)
    return DatasetPosition(next_group=next_group, epoch=epoch, row_in_epoch=row)


def _means(rewards: dict[str, float], num_samples: int) -> str:
    """The held-out line's reward means, and how many samples had a reward that failed."""
    if not rewards:
        return ""
    means = ", ".join(f"{k} {v:.3f}" for k, v in rewards.items() if k != NUM_FAILED)
    failed = int(rewards.get(NUM_FAILED, 0))
    return f" ({means}; {failed} of {num_samples} samples with a failed reward)"


def compare_replay(run_dir: Path, replay_dir: Path, *, last: bool) -> dict:
    """`asyncrl replay`'s verdict: the replayed steps' training values against the run's step
    records, and (when the replay reached the end) its parameters against the run's final model,
    bit for bit. None where the run has nothing to compare with (it stopped early)."""
    from asyncrl.replay import same_values

    def steps(path: Path) -> dict[int, dict]:
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return {int(r["step"]): r for r in rows if r.get("type", "step") == "step"}

    original, replayed = steps(run_dir / "metrics.jsonl"), steps(replay_dir / "metrics.jsonl")
    differ = [s for s in sorted(replayed) if s not in original or not same_values(original[s], replayed[s])]
    verdict: dict[str, Any] = {
        "steps_compared": len(replayed),
        "identical_metrics": not differ,
        "first_differing_step": differ[0] if differ else None,
        "identical_params": None,
    }
    final = run_dir / "final_model"
    if last and final.is_dir():
        verdict["identical_params"] = _same_tensors(final, replay_dir / "final_params.safetensors")
    return verdict


def _same_tensors(model_dir: Path, params_file: Path) -> bool:
    """Every tensor of the HF directory's safetensors equals, bit for bit, the one of that name."""
    import torch
    from safetensors.torch import load_file

    mine = load_file(str(params_file))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return False
    for f in files:
        for name, theirs in load_file(str(f)).items():
            ours = mine.get(name)
            if ours is None or ours.shape != theirs.shape or ours.dtype != theirs.dtype:
                return False
            if not torch.equal(ours.view(torch.uint8), theirs.contiguous().view(torch.uint8)):
                return False
    return True
