"""The batch script of `asyncrl slurm`: pure functions from the command's settings to its text.

Place in the data flow: `submit.py` builds a `Job` from the command line, checks it, and writes
`render(job)` into the run directory (`RUN_DIR/slurm/job.sbatch`) before `sbatch` gets it. The
script (docs/slurm.md walks through it) is bash, commented, and the user's to edit: a header of
`#SBATCH` lines and variables that this module fills in, then a fixed body that reads only those
variables and SLURM's own environment.

Layout of an allocation: node 0 is the head (the launcher, in the batch step, and learner rank
0's node); the first `learner_nodes` nodes run the learner's ranks (one torchrun per node, one
rank per GPU, or one rank on CPU); the next `generator_nodes` run generator workers (one
`asyncrl worker` per GPU, each serving one slot, or one on CPU). With `colocate` the generators
share the learner's nodes (a one-node cluster; CPU only).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

# Keys `asyncrl slurm` sets itself, from its own flags; a `--set` of one is refused (the message
# names the flag). run.out_dir and run.name stay the user's: they name the run directory.
MANAGED_KEYS = {
    "learner.start": "always torchrun across the learner nodes",
    "learner.world_size": "--learner-nodes x --gpus-per-node",
    "generators.num_generators": "--generator-nodes x --gpus-per-node",
    "generators.remote": "every generator is served by a worker on a generator node",
    "cluster.bind_host": "every interface of the head node (0.0.0.0), with CURVE",
    "cluster.advertise_host": "the head node's own address",
    "cluster.curve": "always on: the run leaves loopback",
    "cluster.keys_dir": "keys made for the run in RUN_DIR/slurm/keys",
}
# Where the key material of a run lives: all of it for the head node, and the three files a
# generator host needs (docs/multi-host.md, "Keys").
KEYS_DIR = "slurm/keys"
WORKER_KEYS_DIR = "slurm/worker-keys"
WORKER_KEY_FILES = ("server.key", "generator.key_secret", "worker.key_secret")
SCRIPT_NAME = "slurm/job.sbatch"


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How many nodes do what, and how many GPUs each has (0: CPU nodes)."""

    learner_nodes: int
    generator_nodes: int
    gpus_per_node: int = 0
    colocate: bool = False

    def __post_init__(self) -> None:
        for flag, value in (
            ("--learner-nodes", self.learner_nodes),
            ("--generator-nodes", self.generator_nodes),
        ):
            if value < 1:
                raise ValueError(f"{flag} {value}: a run needs at least one such node")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node {self.gpus_per_node}: 0 (CPU nodes) or more")
        if self.colocate and self.gpus_per_node:
            raise ValueError(
                "--colocate puts generators on the learner's nodes, whose GPUs the learner's ranks take "
                "(one per GPU): drop --colocate, or --gpus-per-node for a CPU run"
            )

    @property
    def num_nodes(self) -> int:
        if self.colocate:
            return max(self.learner_nodes, self.generator_nodes)
        return self.learner_nodes + self.generator_nodes

    @property
    def per_node(self) -> int:
        """Learner ranks, and generator workers, per node: one per GPU, or one on CPU."""
        return max(1, self.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.learner_nodes * self.per_node

    @property
    def num_generators(self) -> int:
        return self.generator_nodes * self.per_node


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything the script is written from. Paths are absolute."""

    layout: Layout
    run_dir: Path
    config: Path | None  # the job file; None: the embedded default job
    overrides: tuple[str, ...]  # the user's --set, in order
    python: str  # the interpreter with asyncrl installed, on every node
    workdir: Path  # where `asyncrl slurm` ran: relative --set paths mean the same inside the job
    partition: str = ""
    time: str = ""
    warn_s: int = 300  # SIGUSR1 this long before the time limit
    max_requeues: int = 20

    @property
    def name(self) -> str:
        return self.run_dir.name


# SLURM checks time limits about once a minute, so the warning may come this much earlier.
SIGNAL_SLACK_S = 60


def time_limit_s(text: str) -> int | None:
    """sbatch --time in seconds (MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN or D-H:MIN:SEC), None for
    no limit (UNLIMITED, INFINITE); ValueError for anything else."""
    if text.strip().upper() in ("UNLIMITED", "INFINITE"):
        return None
    days, dash, rest = text.strip().rpartition("-")
    try:
        parts = [int(p) for p in rest.split(":")]
        num_days = int(days) if dash else 0
    except ValueError:
        parts, num_days = [], 0
    if not 1 <= len(parts) <= 3 or min(parts + [num_days]) < 0:
        raise ValueError(f"--time {text!r}: use MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN or D-H:MIN:SEC")
    if dash:
        h, m, sec = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, sec = parts
    else:
        h, (m, sec) = 0, (parts + [0])[:2]
    total = ((num_days * 24 + h) * 60 + m) * 60 + sec
    if total == 0:
        raise ValueError(f"--time {text!r}: a limit of 0 leaves no time to run")
    return total


def check_warning(time: str, warn_s: int) -> None:
    """ValueError when the warning would come before the run had time to train (every allocation
    would stop during its start and the chain of requeues would never get anywhere)."""
    if warn_s < 1:
        raise ValueError(f"--warn-s {warn_s}: seconds before the time limit, at least 1")
    limit_s = time_limit_s(time) if time else None
    if limit_s is not None and limit_s <= warn_s + 2 * SIGNAL_SLACK_S:
        raise ValueError(
            f"--time {time} with --warn-s {warn_s}: SLURM may send the warning up to "
            f"{SIGNAL_SLACK_S} s early, which leaves the run no time to train; allow more than "
            f"--warn-s + {2 * SIGNAL_SLACK_S} s, or lower --warn-s"
        )


def check_overrides(overrides: tuple[str, ...] | list[str]) -> None:
    """ValueError for a `--set` of a key the command manages itself."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in MANAGED_KEYS:
            raise ValueError(f"--set {key}: asyncrl slurm sets it ({MANAGED_KEYS[key]}); drop the --set")


def launch_overrides(job: Job) -> list[str]:
    """The `--set`s a fresh launch gets after the user's: where the run lives, how the learner and
    generators are started, and the network settings of a run beyond loopback."""
    layout = job.layout
    sets = [
        f"run.out_dir={job.run_dir.parent}",
        f"run.name={job.name}",
        "learner.start=torchrun",
        f"learner.world_size={layout.world_size}",
        f"generators.num_generators={layout.num_generators}",
        f"generators.remote={layout.num_generators}",
        # Every interface, so a requeued allocation with another head node resumes with the same
        # config; peers are told the address of the interface the default route leaves by.
        "cluster.bind_host=0.0.0.0",
        "cluster.curve=on",
        f"cluster.keys_dir={job.run_dir / KEYS_DIR}",
    ]
    user_keys = {item.partition("=")[0].strip() for item in job.overrides}
    if layout.gpus_per_node and "learner.device" not in user_keys:
        sets.append("learner.device=cuda")
    return sets


def sbatch_lines(job: Job) -> list[str]:
    layout = job.layout
    lines = [
        f"#SBATCH --job-name=asyncrl-{job.name}",
        f"#SBATCH --nodes={layout.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --chdir={job.workdir}",
        f"#SBATCH --output={job.run_dir}/slurm/job-%j.out",
        "# A requeued allocation appends to the same output file.",
        "#SBATCH --open-mode=append",
        "# Requeueable: SLURM requeues the job after a node failure, this script after SIGUSR1.",
        "#SBATCH --requeue",
        f"# SIGUSR1 to this script (B:, the batch shell only) {job.warn_s} s before the time limit.",
        f"#SBATCH --signal=B:USR1@{job.warn_s}",
    ]
    if layout.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={layout.gpus_per_node}")
    if job.partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    if job.time:
        lines.append(f"#SBATCH --time={job.time}")
    return lines


def _bash_array(name: str, items: list[str], *, flag: str = "") -> str:
    """`NAME=(...)`, one item a line, each after `flag` when one is given."""
    if not items:
        return f"{name}=()"
    lead = f"{flag} " if flag else ""
    inner = "\n".join(f"    {lead}{shlex.quote(x)}" for x in items)
    return f"{name}=(\n{inner}\n)"


def variable_lines(job: Job) -> list[str]:
    layout = job.layout
    q = shlex.quote
    config = [str(job.config)] if job.config is not None else []
    worker_sets = ["generators.device=cuda"] if layout.gpus_per_node else []
    keys = " ".join(WORKER_KEY_FILES)
    return [
        f"RUN_DIR={q(str(job.run_dir))}",
        "# asyncrl's interpreter: the same path on every node.",
        f"PYTHON={q(job.python)}",
        f"LEARNER_NODES={layout.learner_nodes}",
        f"GENERATOR_NODES={layout.generator_nodes}",
        "# Learner ranks, and generator workers, per node: one per GPU (one on CPU nodes).",
        f"PER_NODE={layout.per_node}",
        f"GPUS_PER_NODE={layout.gpus_per_node}",
        "# 1: the generators run on the learner's nodes (--colocate).",
        f"COLOCATE={int(layout.colocate)}",
        "# Requeues after SIGUSR1, at most (SLURM_RESTART_COUNT counts them).",
        f"MAX_REQUEUES={job.max_requeues}",
        f"# What a generator host holds of the run's keys: {keys}.",
        f'WORKER_KEYS="$RUN_DIR/{WORKER_KEYS_DIR}"',
        "# A fresh start: `asyncrl launch` with the job file, your --set, then the ones asyncrl slurm adds.",
        _bash_array("CONFIG", config),
        _bash_array("SETS", [*job.overrides, *launch_overrides(job)], flag="--set"),
        "# Each worker's own --set (its host's generator options).",
        _bash_array("WORKER_SETS", worker_sets, flag="--set"),
    ]


def render(job: Job) -> str:
    """The batch script's text."""
    head = [
        "#!/bin/bash",
        f"# asyncrl on SLURM: run {job.name}, written by `asyncrl slurm` (docs/slurm.md walks through it).",
        "# Yours to edit; submit it again with `sbatch` on this file. Later allocations of the job",
        "# (requeues) run this same file.",
        *sbatch_lines(job),
        "",
        *variable_lines(job),
    ]
    return "\n".join(head) + "\n" + BODY


BODY = r"""
set -uo pipefail # not -e: the script reaches its end, where it decides about the requeue
export RUN_DIR
export PYTHONUNBUFFERED=1 # the logs below show each line as it is written
say() { echo "asyncrl-slurm $(date -u +%H:%M:%S): $*"; }
note() { echo "$(date -u +%FT%TZ) job $SLURM_JOB_ID restart $RESTART: $*" >>"$RUN_DIR/slurm/jobs.log"; }

# ---- Nodes: from SLURM's environment -----------------------------------------------------------
RESTART=${SLURM_RESTART_COUNT:-0}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]} # the launcher runs here (the batch step), and learner rank 0
HEAD_ADDR=$(scontrol show node -o "$HEAD" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
LEARNER_LIST=$(IFS=,; echo "${NODES[*]:0:LEARNER_NODES}")
FIRST_GENERATOR=$((COLOCATE ? 0 : LEARNER_NODES))
GENERATOR_LIST=$(IFS=,; echo "${NODES[*]:FIRST_GENERATOR:GENERATOR_NODES}")
LOGS=$RUN_DIR/slurm/logs/$SLURM_JOB_ID.$RESTART # this allocation's logs, one per node and step
mkdir -p "$LOGS"
say "job $SLURM_JOB_ID (restart $RESTART) on $SLURM_JOB_NODELIST: head $HEAD ($HEAD_ADDR), learner $LEARNER_LIST, generators $GENERATOR_LIST"
note "started on $SLURM_JOB_NODELIST (head $HEAD, learner $LEARNER_LIST, generators $GENERATOR_LIST), logs $LOGS"

# ---- Fresh start or resume ---------------------------------------------------------------------
rm -f "$RUN_DIR/learner_join.json" # an earlier allocation's: its addresses are gone
STATE=$("$PYTHON" -m asyncrl.slurm.join --state "$RUN_DIR") # fresh, resume or complete
if [[ $STATE == complete ]]; then
    # (e.g. requeued after a node failure, or signalled after the last step was trained)
    say "the run trained every step in an earlier allocation: nothing to do"
    note "already complete: nothing to do"
    exit 0
elif [[ $STATE == resume ]]; then
    LAUNCH=(--resume "$RUN_DIR")
    say "resuming from the newest checkpoint in $RUN_DIR/checkpoints"
else
    # An earlier allocation stopped before its first checkpoint: set its files aside.
    shopt -s dotglob nullglob
    for entry in "$RUN_DIR"/*; do
        if [[ $(basename "$entry") != slurm ]]; then
            mkdir -p "$RUN_DIR/slurm/attempt-$SLURM_JOB_ID.$RESTART"
            mv "$entry" "$RUN_DIR/slurm/attempt-$SLURM_JOB_ID.$RESTART/"
        fi
    done
    shopt -u dotglob nullglob
    LAUNCH=("${CONFIG[@]}" "${SETS[@]}")
fi

# ---- The launcher, in this batch step on the head node ------------------------------------------
"$PYTHON" -m asyncrl launch --no-tui "${LAUNCH[@]}" >"$LOGS/launcher-$HEAD.log" 2>&1 &
LAUNCHER=$!
REQUEUE=0
# SIGUSR1 (the time-limit warning, or `scancel --signal=USR1 --batch JOB`): the launcher stops
# with a checkpoint (SIGTERM is its graceful stop), then the job requeues itself and resumes.
# SIGTERM (scancel, pre-emption): the same stop, no requeue, even after a SIGUSR1 (a cancel wins).
on_signal() {
    say "SIG$1: $2"
    note "SIG$1: $2"
    if [[ $1 == USR1 ]]; then REQUEUE=1; else REQUEUE=0; fi
    kill -TERM "$LAUNCHER" 2>/dev/null
}
trap 'on_signal USR1 "stopping with a checkpoint, then requeueing"' USR1
trap 'on_signal TERM "stopping with a checkpoint"' TERM

# ---- The learner: one torchrun per learner node, a job step -------------------------------------
# Started with the launcher: its ranks import and wait for RUN_DIR/learner_join.json meanwhile.
# Steps ignore SIGUSR1 (`scancel --signal=USR1 --full` reaches them too): the launcher stops them.
MASTER_PORT=$("$PYTHON" -m asyncrl.slurm.join --free-port)
GPU_STEP=()
((GPUS_PER_NODE)) && GPU_STEP=(--gpus-per-node="$GPUS_PER_NODE")
srun --job-name=learner --overlap --kill-on-bad-exit=1 --nodes="$LEARNER_NODES" --ntasks="$LEARNER_NODES" \
    --ntasks-per-node=1 --nodelist="$LEARNER_LIST" "${GPU_STEP[@]}" \
    --output="$LOGS/learner-%N.log" \
    bash -c 'trap "" USR1; exec "$@" --node-rank="$SLURM_PROCID" -m asyncrl.learner.torchrun "$RUN_DIR"' _ \
    "$PYTHON" -m torch.distributed.run --nnodes="$LEARNER_NODES" --nproc-per-node="$PER_NODE" \
    --master-addr="$HEAD_ADDR" --master-port="$MASTER_PORT" &
STEPS=($!)

# The launcher's control address, once it has written it (when it is ready for the learner).
JOIN=$("$PYTHON" -m asyncrl.slurm.join "$RUN_DIR" --pid "$LAUNCHER" --timeout 600)
if [[ -n $JOIN ]]; then
    # ---- The generators: one worker per GPU (or per CPU node), each serving one slot, a job step -
    GPU_WORKER=()
    ((GPUS_PER_NODE)) && GPU_WORKER=(--gpus-per-task=1)
    srun --job-name=generators --overlap --nodes="$GENERATOR_NODES" --ntasks=$((GENERATOR_NODES * PER_NODE)) \
        --ntasks-per-node="$PER_NODE" --nodelist="$GENERATOR_LIST" "${GPU_WORKER[@]}" \
        --output="$LOGS/worker-%N-%t.log" \
        bash -c 'trap "" USR1; exec "$@"' _ \
        "$PYTHON" -m asyncrl worker --join "$JOIN" --count 1 --keys "$WORKER_KEYS" --timeout 600 \
        "${WORKER_SETS[@]}" &
    STEPS+=($!)
    say "launcher at $JOIN; learner and generator steps started"
fi

# ---- Until the launcher ends (a trapped signal interrupts `wait`; wait again) ---------------------
while kill -0 "$LAUNCHER" 2>/dev/null; do wait "$LAUNCHER"; done
wait "$LAUNCHER"
CODE=$?
say "the launcher exited with $CODE (log: $LOGS/launcher-$HEAD.log)"
# It told the learner and the workers to stop; their steps end with them (or are cancelled).
for _ in $(seq 120); do
    RUNNING=0
    for pid in "${STEPS[@]}"; do kill -0 "$pid" 2>/dev/null && RUNNING=1; done
    ((RUNNING)) || break
    sleep 0.5 # polling the steps' srun processes; nothing else says when they end
done
for pid in "${STEPS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
wait

# ---- Requeue: after SIGUSR1, when the launcher stopped with a checkpoint (exit 130) -------------
if ((REQUEUE && CODE == 130)); then
    if ((RESTART < MAX_REQUEUES)); then
        note "requeued (the next allocation resumes)"
        say "requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    note "not requeued: $MAX_REQUEUES requeues already (MAX_REQUEUES)"
fi
note "ended with exit code $CODE"
exit "$CODE"
"""
