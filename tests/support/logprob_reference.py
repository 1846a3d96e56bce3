"""The plain, unchunked reference for the log-probs of N candidate tokens per position (what OPD's
teacher cache holds), against which the chunked kernels (`asyncrl.kernels.logprobs`) and the
policy's forwards are tested. Test-only: it materialises [B, L, V] log-probs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.kernels.logprobs import accumulation_dtype, check_temperature


def causal_lm_position_logprobs(
    model: torch.nn.Module, input_ids_BL: torch.Tensor, ids_BLN: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """log pi(ids_BLN[b, t, k] | x_<t) for N candidate tokens per position.

    Position t is predicted from the logits at t - 1; position 0 gets 0 and must be masked out.
    """
    check_temperature(temperature)
    logits_BLV = model(input_ids=input_ids_BL).logits[:, :-1]
    logp_BLV = torch.log_softmax(logits_BLV.to(accumulation_dtype(logits_BLV.dtype)) / temperature, dim=-1)
    out_BLN = logp_BLV.gather(-1, ids_BLN[:, 1:])
    return F.pad(out_BLN, (0, 0, 1, 0), value=0.0)
