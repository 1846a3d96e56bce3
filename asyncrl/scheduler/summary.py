"""The run's summary: `<run>/summary.json`, one typed record written once at the end of a job.

Place in the data flow: the app layer (`asyncrl/job.py`) builds a `RunSummary` from the launcher's
`RunState` (`scheduler/records.py`), its task book's ledger, the held-out evaluations and the
config, and writes it as JSON (`write_summary`); tools, tests and the monitor's report read the
file. docs/monitor.md ("summary.json") lists every key. The struct is the schema: a key is added
here, with its comment, or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from asyncrl.scheduler.canary import CanarySummary


class RejectedFrames(msgspec.Struct, frozen=True, kw_only=True):
    """Frames refused by a socket (malformed, an unknown peer, a type the socket does not take)."""

    launcher: int  # on the launcher's control socket
    learner: int  # on the learner's sockets (its last metric record)
    launcher_by_reason: dict[str, int]


class AuthFailures(msgspec.Struct, frozen=True, kw_only=True):
    """Peers refused at the CURVE handshake (unknown key, no CURVE, another run's keys)."""

    launcher: int
    learner: int


class DatasetPosition(msgspec.Struct, frozen=True, kw_only=True):
    """Where the prompt stream of a dataset task stands: the next group to admit, as an epoch and
    a row in it."""

    next_group: int
    epoch: int
    row_in_epoch: int


class RunSummary(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """summary.json, key by key (in this order)."""

    mode: str  # "async" or "sync"
    resumed_from: int  # the policy_version a resume started at; 0 for a fresh run
    learner_recoveries: int  # learners recovered inside the run (run.recover_learner)
    status: str  # "completed", "failed" or "interrupted"
    policy_versions: int
    steps: int  # optimizer steps taken
    trajectories_generated: int
    trajectories_trained: int
    trajectories_lost: int  # admitted, neither trained, dropped nor pending (0 in a sound run)
    trajectories_pending: int  # admitted, not trained yet (a resume would generate them)
    # Samples trained more than once, or a group trained on more samples than configured.
    trajectories_duplicated: int
    tasks_requeued: int
    buffer_mode: str  # "window" or "pool"
    # Dropped by the buffer (pool mode: past a bound, or withheld and reclaimed), by reason.
    trajectories_evicted: int
    evicted_by_reason: dict[str, int]
    trajectories_replayed: int
    generator_restarts: int
    steps_skipped_nonfinite: int
    # Streamed groups the learner could hold open at once (learner.stream_memory_mb); 0 when it
    # holds no per-group buffers (lockstep ranks, whole batches).
    open_group_bound: int
    eval_before: float  # held-out accuracy; NaN when not evaluated
    eval_after: float
    eval_problems: int
    # With task.rewards: each reward's held-out mean, "total" (the weighted sum) and "num_failed"
    # (how many held-out samples had a reward that failed).
    eval_rewards_before: dict[str, float]
    eval_rewards_after: dict[str, float]
    # Background evaluation (eval.every): one point per evaluated version, as its `eval` record
    # (version, accuracy = pass@1, pass_at_k, rewards, problems, samples, eval_s); versions skipped
    # because the evaluator fell behind, and versions whose evaluation failed.
    eval_curve: list[dict]
    evals_skipped: list[int] = []
    evals_failed: list[int] = []
    reward_means: dict[str, float]  # each reward's mean over the samples generated
    reward_failures: dict[str, int]  # failed reward calls, by reward name
    samples_scored: int  # scorings, redraws included
    samples_with_failed_reward: int
    samples_regenerated: int  # drawn again after a failed reward (task.scoring.on_failure)
    samples_overlong: int  # cut at sampling.max_new_tokens
    samples_invalid_redrawn: int  # drawn again because the learner would reject them
    # Mean completion length of the samples generated, trained and dropped (length bias).
    completion_lengths: dict[str, float | None]
    task: dict[str, int]  # the task's preparation counts (prompts, dropped, ...)
    wall_s: float  # the job, evaluations included
    train_wall_s: float  # from the start of training to the end
    samples_per_s: float  # trained
    tokens_per_s: float  # generated
    max_staleness: int  # observed
    max_staleness_bound: int  # configured (staleness.max_staleness, resolved)
    num_generators: int
    # Copies the learner received and dropped (a re-run of a group a dead generator had begun).
    duplicates: int
    rejected_frames: RejectedFrames
    stale_messages: int  # from generator processes already replaced (dropped)
    auth_failures: AuthFailures
    lint: list[dict[str, str]]  # the settings linter's warnings (asyncrl/lint.py, docs/safety.md)
    run_dir: str
    dataset_position: DatasetPosition | None = None  # dataset tasks only
    # weights.canary: the weight-load canary's figures (docs/weights.md, "Canary"): the dtype and
    # tolerance in force, versions checked / refused / unchecked, max |delta log-prob| overall and
    # per generator (each version's figures are the `canary` records of metrics.jsonl)
    canary: CanarySummary | None = None
    # opd.cache: the teacher-score cache's counters over the run's generator processes (hits and
    # hit_tokens: samples and tokens whose teacher forward was saved; misses, miss_tokens: scored
    # by a teacher; teacher_calls, calls_saved), generators/teacher_routing.read_cache_counts.
    teacher_cache: dict[str, int] = {}
    error: str | None = None  # a failed run: why


def write_summary(summary: RunSummary, path: Path) -> None:
    """As JSON, indented; floats as Python writes them (a NaN accuracy stays NaN, not null)."""
    path.write_text(json.dumps(msgspec.to_builtins(summary), indent=2) + "\n")
