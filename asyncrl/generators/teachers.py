"""The teachers a generator scores its samples with (config `opd`), behind one `score` call.

Place in the data flow: the torch generator (`torch_gen.py`) samples a batch, lays out each
sample's [T, N] ids (`opd.cache_arrays`) and asks its teacher for log pi_T of every id; the
scores, and the teacher's policy_version when the teacher is the policy itself, go into the
Rollout and on to the learner (docs/opd.md).

* `ModelTeacher`: a teacher directory loaded in this process (opd.placement = "generator"),
  scoring each completion after the prompt the student saw.
* `SelfTeacher`: self-distillation (opd.teacher = "self"): the policy's own weights, as
  `opd.self_weights` says, scoring each completion after the task's privileged prompt
  (`PromptTask.privileged_ids`).
* `teacher_client.TeacherClient`: the teacher every generator shares (opd.placement = "service").

What a teacher returns per sample is one `opd.TeacherScoring` record: log pi_T of the [T, N] cached
ids and, with opd.teacher_top_k = K > 0, the teacher's top-K ids and log-probs ([T, K]) from the
same forward. A teacher that answers bare [T, N] tensors (the shared teacher's client) means no
top-K (`opd.as_scoring`).

With a distillation horizon (opd.horizon, `fixed` or `linear` schedule) a teacher scores only the
first H(v) positions of each completion, v the policy version the generator holds (`on_weights`):
the rows past it come back NaN, which the learner never distils (docs/opd.md, "Horizon and token
control"); the teacher's forward is over prompt + those H(v) tokens.

Every `score` runs on the thread that owns the generator's models (the sampling thread), which
is also the thread that applies new weights: a teacher never sees weights change mid-forward.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

import torch

from asyncrl.config_sections import scheduled_horizon
from asyncrl.generators.opd import TeacherScoring, score_prefixes, teacher_scores
from asyncrl.messages import PromptTask

log = logging.getLogger(__name__)

SELF_WEIGHTS = ("initial", "current", "lagged", "ewma")


class Teacher(Protocol):
    def score(
        self, tasks: Sequence[PromptTask], ids_TN: Sequence[torch.Tensor]
    ) -> tuple[list[TeacherScoring] | list[torch.Tensor], int | None]:
        """(each sample's scores: a `TeacherScoring`, or log pi_T of its [T, N] ids as a float32
        [T, N] tensor on the CPU; the teacher's policy_version or None for a teacher outside the
        policy); sample i belongs to `tasks[i]`."""


class Horizon(NamedTuple):
    """opd.horizon as the teachers apply it (`config_sections.scheduled_horizon`)."""

    horizon: int = 0
    schedule: str = "fixed"
    growth: int = 1
    horizon_max: int = 0

    @staticmethod
    def from_config(opd) -> Horizon:
        return Horizon(opd.horizon, opd.horizon_schedule, opd.horizon_growth, opd.horizon_max)

    def at(self, version: int) -> int:
        return scheduled_horizon(self.horizon, self.schedule, self.growth, self.horizon_max, version)


NO_HORIZON = Horizon()


class ModelTeacher:
    """A fixed teacher model in this process: scores each completion after its plain prompt."""

    def __init__(self, model, *, pad_token_id: int, top_k: int = 0, horizon: Horizon = NO_HORIZON) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.top_k = top_k  # opd.teacher_top_k
        self.horizon = horizon
        self.policy_version = 0  # the version the generator samples with (the horizon's clock)

    def on_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """The policy now holds `version` (its weights are not the teacher's)."""
        self.policy_version = version

    def score(
        self, tasks: Sequence[PromptTask], ids_TN: Sequence[torch.Tensor]
    ) -> tuple[list[TeacherScoring], int | None]:
        prompts = [t.prompt_ids for t in tasks]

        def score(ids):
            return teacher_scores(self.model, prompts, ids, pad_token_id=self.pad_token_id, top_k=self.top_k)

        return score_prefixes(score, ids_TN, self.horizon.at(self.policy_version)), None


def _named_tensors(model) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name, as the generator's weight updates address them."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


def _frozen_copy(model):
    """A copy of `model` (same device and dtype) that no update of the policy touches."""
    twin = copy.deepcopy(model).eval()
    twin.requires_grad_(False)
    return twin


class SelfTeacher:
    """The policy as its own teacher, on privileged prompts (module docstring).

    `weights`: "initial" = a frozen copy of the weights at setup (policy_version 0: a generator
    starts from the run's initial model); "current" = the policy itself, so the teacher's version
    is the one the generator samples with when it scores (that of the sample's last token);
    "lagged" = the newest version this generator has held that is at least `lag` behind the
    policy (version 0, the initial weights, until it holds one); "ewma" = an exponential moving
    average theta_T <- d theta_T + (1 - d) theta_v over the versions it receives (d =
    `ewma_decay`), whose version is recorded as the floor of the same average of version numbers
    (its centre of mass).
    """

    def __init__(
        self,
        policy,
        *,
        weights: str,
        lag: int = 1,
        ewma_decay: float = 0.9,
        pad_token_id: int,
        top_k: int = 0,
        horizon: Horizon = NO_HORIZON,
    ) -> None:
        if weights not in SELF_WEIGHTS:
            raise ValueError(f"opd.self_weights = {weights!r}; one of {', '.join(SELF_WEIGHTS)}")
        self.weights = weights
        self.lag = lag
        self.ewma_decay = ewma_decay
        self.pad_token_id = pad_token_id
        self.top_k = top_k  # opd.teacher_top_k
        self.horizon = horizon
        self.policy_version = 0  # the version the generator samples with (the horizon's clock)
        self.model = policy if weights == "current" else _frozen_copy(policy)
        self.version = 0
        # lagged: versions received and not yet the teacher's, oldest first (their CPU tensors,
        # complete and never written to after they were handed over).
        self._held: deque[tuple[int, Mapping[str, torch.Tensor]]] = deque()
        self._centre = 0.0  # ewma: the average's weighted mean version
        self._master: dict[str, torch.Tensor] = {}  # ewma: a float32 average for lower-precision models
        if weights == "ewma":
            self._master = {
                name: t.detach().to(torch.float32, copy=True)
                for name, t in _named_tensors(self.model).items()
                if t.is_floating_point() and t.dtype != torch.float32
            }

    def on_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """The policy now holds `version`, whose tensors are `state` (called by the generator on
        the thread that applied them)."""
        self.policy_version = version
        if self.weights == "current":
            self.version = version
        elif self.weights == "lagged":
            self._held.append((version, state))
            chosen = None
            while self._held and self._held[0][0] <= version - self.lag:
                chosen = self._held.popleft()
            if chosen is not None:
                self._load(chosen[1])
                self.version = chosen[0]
        elif self.weights == "ewma":
            self._fold(state)
            self._centre = self.ewma_decay * self._centre + (1.0 - self.ewma_decay) * version
            self.version = int(self._centre)

    @torch.no_grad()
    def _load(self, state: Mapping[str, torch.Tensor]) -> None:
        targets = _named_tensors(self.model)
        for name, tensor in state.items():
            if (target := targets.get(name)) is not None:
                target.copy_(tensor)

    @torch.no_grad()
    def _fold(self, state: Mapping[str, torch.Tensor]) -> None:
        weight = 1.0 - self.ewma_decay
        for name, target in _named_tensors(self.model).items():
            tensor = state.get(name)
            if tensor is None:
                continue
            if not target.is_floating_point():
                target.copy_(tensor)  # integer buffers are not averaged
                continue
            master = self._master.get(name)
            if master is None:
                target.lerp_(tensor.to(target.device, target.dtype), weight)
            else:
                master.lerp_(tensor.to(master.device, torch.float32), weight)
                target.copy_(master)

    def score(
        self, tasks: Sequence[PromptTask], ids_TN: Sequence[torch.Tensor]
    ) -> tuple[list[TeacherScoring], int | None]:
        missing = [t.task_id for t in tasks if not t.privileged_ids]
        if missing:
            raise ValueError(
                f"opd.teacher = 'self': tasks {sorted(set(missing))[:5]} came without privileged_ids; the "
                "launcher renders them (Task.privileged_render) when the run's config says opd.teacher = 'self'"
            )
        prompts = [t.privileged_ids for t in tasks]

        def score(ids):
            return teacher_scores(self.model, prompts, ids, pad_token_id=self.pad_token_id, top_k=self.top_k)

        return score_prefixes(score, ids_TN, self.horizon.at(self.policy_version)), self.version
