"""Log-probs of the weight-load canary's tokens under a model (pure; one batched forward).

Place in the data flow: the learner scores the canary (`messages.CanaryReference`) with the
weights it publishes, and the torch generator scores the same sequences with the weights it
loaded (docs/weights.md, "Canary"); both call `sequence_logprobs`, so the two numbers differ only
by what the weights and the engine do, never by how they were computed.

Legend: B sequences, T tokens (the longest sequence; shorter ones are right-padded).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.kernels.logprobs import causal_lm_logprobs


def sequence_logprobs(
    model: torch.nn.Module, ids: Sequence[Sequence[int]], *, pad_token_id: int
) -> list[list[float]]:
    """For each sequence, log pi(ids[t] | ids[:t]) for t = 1 .. len - 1 (plain log-softmax, no
    temperature), as float lists; a sequence of fewer than 2 tokens gives [].

    Right padding with `pad_token_id` and no attention mask is exact: attention is causal, so a
    real token never sees the padding after it. Runs without gradients, on the model's device, in
    whatever mode the caller left the model in.
    """
    if not ids:
        return []
    device = next(model.parameters()).device
    width = max(len(seq) for seq in ids)
    ids_BT = torch.full((len(ids), max(width, 2)), pad_token_id, dtype=torch.long)
    for i, seq in enumerate(ids):
        ids_BT[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
    with torch.no_grad():
        logp_BT = causal_lm_logprobs(model, ids_BT.to(device)).logp.float().cpu()
    return [logp_BT[i, 1 : len(seq)].tolist() for i, seq in enumerate(ids)]
