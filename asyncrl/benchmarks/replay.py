"""A generator plugin that replays recorded trajectories: the learner-only run of
`asyncrl bench pipeline`.

`asyncrl bench record` records every window to `<run>/trajectories.jsonl` (one JSON object
per trajectory: step, group_id, sample_index, prompt_ids, completion_ids, behavior_logprobs,
token_versions, reward). A later run of the same workload (same `task.seed`, hence the same prompt
for every group index) selects this plugin with

    --set generators.kind=asyncrl.benchmarks.replay:ReplayGenerator
    --set generators.options.replay_path=RUN/trajectories.jsonl

and every PromptTask is answered at once with its recorded rollouts (matched by group_id and
sample_index), so the pipeline runs at the learner's own rate. Tokens are stamped with the version
the generator holds, so the learner's staleness check passes as it would for fresh samples; the
recorded behavior log-probs and rewards travel unchanged.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from asyncrl.generators.base import GeneratorContext, Rollout
from asyncrl.messages import PromptTask

REPLAY_PATH_OPTION = "replay_path"  # generators.options key naming the recording


class Recording:
    """Recorded trajectories keyed by (group_id, sample_index)."""

    def __init__(self, rows: dict[tuple[int, int], dict]) -> None:
        self.rows = rows

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"replay recording {path} does not exist; record one with `asyncrl bench record` "
                "(it writes <run>/trajectories.jsonl)"
            )
        rows: dict[tuple[int, int], dict] = {}
        with path.open() as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    key = (int(row["group_id"]), int(row["sample_index"]))
                    n = len(row["completion_ids"])
                    if not (n == len(row["behavior_logprobs"]) >= 1):
                        raise ValueError("completion_ids and behavior_logprobs differ in length or are empty")
                    float(row["reward"])
                    list(row["prompt_ids"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    raise ValueError(f"replay recording {path}, line {line_no}: {exc}") from None
                rows[key] = row
        if not rows:
            raise ValueError(f"replay recording {path} is empty")
        return cls(rows)

    def rollouts(self, task: PromptTask, *, version: int) -> list[Rollout]:
        """The recorded samples of `task`'s group, tokens stamped with `version`."""
        out = []
        for k in range(task.num_samples):
            row = self.rows.get((task.group_id, k))
            if row is None:
                raise ValueError(
                    f"the replay recording has no sample {k} of group {task.group_id}; record the same "
                    "workload (learner.steps, groups_per_step, samples_per_group) with `asyncrl bench record`"
                )
            if list(row["prompt_ids"]) != list(task.prompt_ids):
                raise ValueError(
                    f"group {task.group_id}'s prompt differs from the recording's; replay with the "
                    "task.seed and model (tokenizer) the recording was made with"
                )
            ids = [int(t) for t in row["completion_ids"]]
            out.append(
                Rollout(
                    task_id=task.task_id,
                    sample_index=k,
                    completion_ids=ids,
                    behavior_logprobs=[float(x) for x in row["behavior_logprobs"]],
                    token_versions=[version] * len(ids),
                    reward=float(row["reward"]),
                    finish_reason="length" if len(ids) >= task.sampling.max_new_tokens else "stop",
                )
            )
        return out


class ReplayGenerator:
    """`Generator` plugin answering each task from a recording, instantly; weights are
    acknowledged without being applied (there is no model)."""

    def __init__(self) -> None:
        self._version = 0
        self._recording: Recording | None = None
        self._lock = threading.Lock()  # guards _pending (offered from the loop, applied by a worker)
        self._pending: tuple[int, Callable[[int], None] | None] | None = None

    def setup(self, ctx: GeneratorContext) -> None:
        path = ctx.options.get(REPLAY_PATH_OPTION)
        if not path:
            raise ValueError(
                "the replay generator needs a recording: --set generators.options.replay_path=RUN/trajectories.jsonl"
            )
        self._recording = Recording.load(str(path))

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, tasks: Sequence[PromptTask]) -> list[Rollout]:
        assert self._recording is not None, "setup() was not called"
        return [r for task in tasks for r in self._recording.rollouts(task, version=self._version)]

    async def load_weights(self, version: int, location: str) -> None:
        self._version = max(self._version, version)

    # StagedWeights, so that weights.transport=broadcast works too: the service receives the bytes,
    # the replay only takes the version.
    def offer_weights(
        self, version: int, state: Mapping, on_applied: Callable[[int], None] | None = None
    ) -> None:
        with self._lock:
            if version > self._version and (self._pending is None or version > self._pending[0]):
                self._pending = (version, on_applied)

    def apply_pending(self) -> bool:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        version, on_applied = pending
        self._version = version
        if on_applied is not None:
            on_applied(version)
        return True

    async def close(self) -> None:
        self._recording = None
