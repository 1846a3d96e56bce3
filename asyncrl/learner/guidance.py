"""Guided samples in the learner (pure): their group baseline and their off-policy tokens.

Place in the data flow: with `sampling.guidance` on, a generator draws part of the group of a
prompt whose groups keep failing with a prefix of the task's worked solution forced at the start
of the completion (`Trajectory.guided_prefix` tokens, never sampled) and the rest sampled by the
policy after it. The learner trains such a group as one whole batch (`RLObjective.fallback_reason`):

* Baseline (OraRL's fix of advantage inversion): the group's baseline is the mean reward of its
  *unguided* members only, so a guided success cannot lower the advantages of the policy's own
  samples. GRPO: A_i = (r_i - mean_u r) / (std_g r + eps), std_g over the whole group (ddof 1, as
  GRPO's); Dr. GRPO: A_i = r_i - mean_u r. A group without a guided member gets exactly GRPO's
  (Dr. GRPO's) advantages; unguided members whose rewards are all equal get exactly 0, and so does
  every member of a group whose rewards are all equal.
* Off-policy tokens (`sampling.guidance.prefix_loss`): the forced prefix was not sampled from the
  policy. "mask": its tokens carry no gradient (the continuation, sampled by the policy after the
  prefix, is on-policy and trains as usual). "shaped": LUFFY's regularised importance sampling:
  each prefix token t adds  l_t = -A f(pi_theta(y_t | x, y_<t)),  f(p) = p / (p + gamma),  with no
  clip and no behaviour ratio (the demonstration's own probability is taken as 1, as LUFFY does),
  so its gradient is -A gamma p / (p + gamma)^2 grad log p: tokens the policy already finds likely
  or very unlikely are pushed little. The continuation trains under the run's policy loss either way.

Legend: G groups, N samples per group, B sequences, L packed length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.learner.advantages import GRPO_EPS, dr_grpo_advantages, grpo_advantages

GUIDED_ADVANTAGES = ("grpo", "dr_grpo")  # config_objective's copy (the launcher imports no torch)


def guided_advantages(
    rewards_GN: torch.Tensor, guided_GN: torch.Tensor, *, advantage: str = "grpo", eps: float = GRPO_EPS
) -> torch.Tensor:
    """Group advantages whose baseline comes from the unguided members (module docstring).

    Every group must have at least one unguided member (ValueError otherwise)."""
    if advantage not in GUIDED_ADVANTAGES:
        raise ValueError(f"guided samples take learner.advantage 'grpo' or 'dr_grpo', not {advantage!r}")
    if guided_GN.shape != rewards_GN.shape:
        raise ValueError(f"guided mask {tuple(guided_GN.shape)} != rewards {tuple(rewards_GN.shape)}")
    guided_GN = guided_GN.bool()
    unguided_GN = ~guided_GN
    count_G1 = unguided_GN.sum(dim=1, keepdim=True)
    if bool((count_G1 == 0).any()):
        raise ValueError(
            "a group with guided samples only has no baseline; keep at least one unguided sample"
        )
    plain = grpo_advantages(rewards_GN, eps=eps) if advantage == "grpo" else dr_grpo_advantages(rewards_GN)
    mean_u_G1 = torch.where(unguided_GN, rewards_GN, 0.0).sum(dim=1, keepdim=True) / count_G1
    adv_GN = rewards_GN - mean_u_G1
    if advantage == "grpo":
        if rewards_GN.shape[1] < 2:
            return torch.zeros_like(rewards_GN)
        adv_GN = adv_GN / (rewards_GN.std(dim=1, keepdim=True) + eps)
    first_u_G1 = torch.where(unguided_GN, rewards_GN, float("nan")).nanmean(dim=1, keepdim=True)
    # Unguided rewards all equal (e.g. every policy sample failed): their advantage is exactly 0.
    flat_u_G1 = torch.where(unguided_GN, rewards_GN == first_u_G1, True).all(dim=1, keepdim=True)
    adv_GN = torch.where(flat_u_G1 & unguided_GN, 0.0, adv_GN)
    flat_G1 = (rewards_GN == rewards_GN[:, :1]).all(dim=1, keepdim=True)
    adv_GN = torch.where(flat_G1, 0.0, adv_GN)
    has_guided_G1 = guided_GN.any(dim=1, keepdim=True)
    return torch.where(has_guided_G1, adv_GN, plain)


def prefix_mask(samples: Sequence, width: int) -> torch.Tensor | None:
    """bool [B, width]: the forced prefix tokens of each packed row (`step.pack`'s layout: the
    prompt, then the completion); None when no sample is guided."""
    if not any(s.guided_prefix for s in samples):
        return None
    out = torch.zeros((len(samples), width), dtype=torch.bool)
    for b, s in enumerate(samples):
        if s.guided_prefix:
            start = len(s.prompt_ids)
            out[b, start : start + s.guided_prefix] = True
    return out


def shaped_weight(logp: torch.Tensor, gamma: float) -> torch.Tensor:
    """f(p) = p / (p + gamma), p = exp(logp): LUFFY's shaping of an off-policy token's probability."""
    p = logp.exp()
    return p / (p + gamma)


def shaped_loss(
    logp_BL: torch.Tensor, adv_BL: torch.Tensor, mask_BL: torch.Tensor, *, gamma: float
) -> torch.Tensor:
    """Unnormalised sum over `mask_BL` of -A_t f(pi_theta(y_t)) (module docstring); the step's
    denominator divides it with the rest of the loss. Masked positions contribute exactly 0."""
    logp = torch.where(mask_BL, logp_BL, 0.0)
    per_BL = -adv_BL * shaped_weight(logp, gamma)
    return torch.where(mask_BL, per_BL, 0.0).sum()
