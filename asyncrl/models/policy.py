"""The policy as the learner runs it: a causal LM whose forward returns log-probs, not logits.

Place in the data flow: the learner's `Trainer` calls `PolicyLM(input_ids)` for every forward
(training, the staleness policy's extra inputs, distillation); the generators never use it. Two
reasons to put the log-prob computation inside one module's forward:

* memory: the decoder's final hidden states go through the LM head in chunks of `chunk_size`
  tokens (`kernels.logprobs.token_logprobs`), so a micro-batch's `[tokens, vocab]` logits never
  exist at once, in the forward or the backward;
* sharding: FSDP2 (`learner/parallel.py`) gathers a module's parameters around that module's
  forward and reduce-scatters their gradients after its backward. The embedding, final norm and
  LM head belong to the root unit, this module, so they are gathered while the head is applied
  chunk by chunk, which a call to the decoder alone would skip.

`PolicyLM.lm` is the Hugging Face model itself: its `state_dict()` keeps the checkpoint's names
(what is published, checkpointed and saved); only forwards go through the wrapper.

Legend: B sequences, L tokens, N candidate tokens per position, V vocab, D hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.kernels.logprobs import TokenLogprobs, candidate_logprobs, token_logprobs


def _shift(values_BS: torch.Tensor) -> torch.Tensor:
    """[B, L-1, ...] values of tokens 1..L-1 -> [B, L, ...] aligned with the inputs (position 0 = 0)."""
    pad = (0, 0) * (values_BS.dim() - 2) + (1, 0)
    return F.pad(values_BS, pad, value=0.0)


def check_chunkable(lm: torch.nn.Module) -> None:
    """Chunked log-probs need logits == lm_head(hidden): no logit scaling or soft-capping."""
    config = getattr(lm, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1.0):
            raise ValueError(f"the learner's chunked log-probs need logits == lm_head(hidden); model has {name}")
    head = lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"the learner needs an nn.Linear output embedding, got {type(head).__name__}")


class PolicyLM(torch.nn.Module):
    """`forward(input_ids_BL)` -> log pi(x_t | x_<t) and entropies, aligned with the inputs."""

    def __init__(self, lm: torch.nn.Module, *, chunk_size: int = 1024) -> None:
        super().__init__()
        check_chunkable(lm)
        self.lm = lm
        self.chunk_size = chunk_size

    def forward(
        self,
        input_ids_BL: torch.Tensor,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        candidates_BLN: torch.Tensor | None = None,
    ) -> TokenLogprobs | torch.Tensor:
        """Log-probs of every input token given its prefix (position 0 holds 0: mask it out).

        With `candidates_BLN`, log pi(candidates_BLN[b, t, k] | x_<t) instead ([B, L, N], for
        distillation's cached tokens), over the full vocabulary at `temperature`.
        """
        hidden_BLD = self.lm.get_decoder()(input_ids=input_ids_BL).last_hidden_state[:, :-1]
        head = self.lm.get_output_embeddings()
        if candidates_BLN is not None:
            out_BSN = candidate_logprobs(
                hidden_BLD,
                head.weight,
                candidates_BLN[:, 1:],
                bias_V=head.bias,
                temperature=temperature,
                chunk_size=self.chunk_size,
            )
            return _shift(out_BSN)
        out = token_logprobs(
            hidden_BLD,
            head.weight,
            input_ids_BL[:, 1:],
            bias_V=head.bias,
            temperature=temperature,
            top_p=top_p,
            chunk_size=self.chunk_size,
        )
        return TokenLogprobs(_shift(out.logp), _shift(out.entropy))
