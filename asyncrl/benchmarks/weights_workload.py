"""The weights `asyncrl bench weights` moves: a transformer-shaped state dict of a given size
(bf16 matrices, fp32 norms) and, for the delta row, versions of it as small-lr Adam steps make them.
Pure tensor construction: no files, no processes."""

from __future__ import annotations

import torch

HIDDEN = 1024
MATRIX_PARAMS = 4 * HIDDEN * HIDDEN  # one [4096, 1024] bf16 matrix = 8 MiB, like a mid-size MLP weight


def make_state_dict(num_params: int) -> dict[str, torch.Tensor]:
    """A transformer-shaped state dict of about `num_params` parameters: bf16 matrices, fp32 norms."""
    if num_params < HIDDEN * 2:
        raise ValueError(f"num_params must be >= {HIDDEN * 2}, got {num_params}")
    sd: dict[str, torch.Tensor] = {}
    vocab = max(1, num_params // 4 // HIDDEN)
    sd["model.embed_tokens.weight"] = torch.empty(vocab, HIDDEN, dtype=torch.bfloat16).uniform_()
    remaining = num_params - vocab * HIDDEN
    layer = 0
    while remaining > HIDDEN:
        rows = max(1, min(MATRIX_PARAMS, remaining - HIDDEN) // HIDDEN)
        sd[f"model.layers.{layer}.mlp.weight"] = torch.empty(rows, HIDDEN, dtype=torch.bfloat16).uniform_()
        sd[f"model.layers.{layer}.norm.weight"] = torch.ones(HIDDEN, dtype=torch.float32)
        remaining -= rows * HIDDEN + HIDDEN
        layer += 1
    return sd


def num_bytes_of(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def adam_like_states(sd: dict[str, torch.Tensor], *, lr: float, seed: int = 0):
    """Versions of `sd` as training with a small learning rate makes them: float32 master weights
    (matrices drawn N(0, 0.02) as at initialisation, the rest as given) each moved by `lr` times a
    random sign per element (Adam's first steps move every element by about lr), published in
    each tensor's dtype. Returns `state_of(version)`; versions must be asked for in order."""
    g = torch.Generator().manual_seed(seed)
    master = {
        n: (torch.empty(t.shape).normal_(0.0, 0.02, generator=g) if t.dim() > 1 else t.float().clone())
        for n, t in sd.items()
    }
    step = [0]

    def state_of(version: int) -> dict[str, torch.Tensor]:
        while step[0] < version:
            for t in master.values():
                signs = torch.randint(0, 2, t.shape, generator=g, dtype=torch.int8).float().mul_(2).sub_(1)
                t.add_(signs, alpha=lr)
            step[0] += 1
        return {n: master[n].to(sd[n].dtype) for n in sd}

    return state_of
