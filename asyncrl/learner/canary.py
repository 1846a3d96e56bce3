"""The learner's half of the weight-load canary: its own log-probs of the canary at each version
it publishes, and (tests only) a fault that publishes wrong weights under correct checksums.

Place in the data flow: after optimizer step s the service scores the canary
(`WorkerArgs.canary_ids`, built by the launcher from the task's prompts) with the model it trains,
on the training thread before the next step can change the weights, and announces version s + 1
with it (`WeightsPublished.canary`); the launcher compares each generator's scores with it
(`scheduler/canary.py`, docs/weights.md "Canary").

What the reference is: the model being trained, not the published bytes, so a fault anywhere
between the two (gathering, casting, naming, writing, loading) shows. With learner.world_size > 1
no reference is computed (a forward of a sharded model is a collective of every rank; the canary
is off there, said once at start).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from asyncrl.kernels.canary import sequence_logprobs
from asyncrl.messages import CanaryReference

log = logging.getLogger(__name__)

# Fault injection for tests: from this policy_version on, the learner publishes every version with
# one tensor changed (its first floating-point matrix outside the embeddings, which may be tied,
# negated) *before* the publisher writes it, so
# the shards' checksums are those of the wrong bytes and pass; only the canary can tell.
FAULT_ENV = "ASYNCRL_FAULT_CANARY"


def reference(model: torch.nn.Module, ids: Sequence[Sequence[int]], *, pad_token_id: int) -> CanaryReference:
    """The learner's log-probs of the canary under `model` as it is now, in eval mode (no dropout);
    the model's mode is restored."""
    training = model.training
    model.eval()
    try:
        logprobs = sequence_logprobs(model, ids, pad_token_id=pad_token_id)
    finally:
        model.train(training)
    return CanaryReference(ids=[list(seq) for seq in ids], logprobs=logprobs)


def fault_from(env: Mapping[str, str]) -> int | None:
    """The version `FAULT_ENV` corrupts from (None: no fault)."""
    text = env.get(FAULT_ENV, "").strip()
    return int(text) if text else None


def corrupt(
    state: Mapping[str, torch.Tensor], version: int, *, from_version: int | None
) -> Mapping[str, torch.Tensor]:
    """`state` as it should be published, or, at versions >= `from_version`, a copy with its first
    floating-point matrix outside the embeddings negated (the fault test's wrong weights; a tied
    embedding would be overwritten by its twin on loading). Other tensors are shared."""
    if from_version is None or version < from_version or not isinstance(state, dict):
        return state
    name = next(
        n
        for n, t in state.items()
        if t.is_floating_point() and t.dim() == 2 and "embed" not in n and "lm_head" not in n
    )
    log.warning("%s: publishing version %d with %s negated (a test fault)", FAULT_ENV, version, name)
    return {**state, name: -state[name]}
