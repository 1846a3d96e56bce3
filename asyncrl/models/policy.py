"""The policy as the learner runs it: a causal LM whose forward returns log-probs, not logits.

Place in the data flow: the learner's `Trainer` calls `PolicyLM(input_ids)` for every forward
(training, the staleness policy's extra inputs, distillation); the generators never use it. Two
reasons to put the log-prob computation inside one module's forward:

* memory: the decoder's final hidden states go through the LM head in chunks of `chunk_size`
  tokens, so a micro-batch's `[tokens, vocab]` logits never exist at once, in the forward or the
  backward (asserted by peak tensor memory in tests/unit/test_policy_lm.py). Sampled tokens at
  top_p = 1 take the fused kernel (`kernels.fused_logprobs`: about 3.5 chunks of logits at the
  peak, against about 6 for the checkpointed reference, and 3x faster on CPU); top_p < 1 takes
  `kernels.logprobs.token_logprobs` (the nucleus sorts each chunk: int64 indices, about twice the
  memory and several times the time); candidates take `kernels.logprobs.candidate_logprobs`;
* sharding: FSDP2 (`learner/parallel.py`) gathers a module's parameters around that module's
  forward and reduce-scatters their gradients after its backward. The embedding, final norm and
  LM head belong to the root unit, this module, so they are gathered while the head is applied
  chunk by chunk, which a call to the decoder alone would skip.

The decoder runs rows that begin alike (a group's prompt) through a shared-prefix layout when it
pays (`models.shared_prefix`, `learner.shared_prefix`): those tokens once, padding not at all.

`PolicyLM.lm` is the Hugging Face model itself: its `state_dict()` keeps the checkpoint's names
(what is published, checkpointed and saved); only forwards go through the wrapper.

Legend: B sequences, L tokens, N candidate tokens per position, V vocab, D hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.kernels.fused_logprobs import fused_token_logprobs
from asyncrl.kernels.logprobs import (
    TokenLogprobs,
    candidate_logprobs,
    check_chunk_size,
    token_logprobs,
    unchunkable_reason,
)
from asyncrl.models import shared_prefix

# Tokens per chunk of [tokens, vocab] logits (learner.logprob_chunk_size): 1024 x 150k x 4 bytes
# = 614 MB per live chunk, small next to a 7B model's weights, large enough for full-width matmuls.
DEFAULT_CHUNK_SIZE = 1024


def _shift(values_BS: torch.Tensor) -> torch.Tensor:
    """[B, L-1, ...] values of tokens 1..L-1 -> [B, L, ...] aligned with the inputs (position 0 = 0)."""
    pad = (0, 0) * (values_BS.dim() - 2) + (1, 0)
    return F.pad(values_BS, pad, value=0.0)


def check_chunkable(lm: torch.nn.Module) -> None:
    """Chunked log-probs need logits == lm_head(hidden): no logit scaling or soft-capping."""
    reason = unchunkable_reason(lm)
    if reason is not None:
        raise ValueError(f"the learner's chunked log-probs need logits == lm_head(hidden); {reason}")


class PolicyLM(torch.nn.Module):
    """`forward(input_ids_BL)` -> log pi(x_t | x_<t) and entropies, aligned with the inputs."""

    def __init__(
        self, lm: torch.nn.Module, *, chunk_size: int = DEFAULT_CHUNK_SIZE, share_prefixes: bool = True
    ) -> None:
        super().__init__()
        check_chunkable(lm)
        check_chunk_size(chunk_size)
        self.lm = lm
        self.chunk_size = chunk_size
        # Rows that start alike (a group's prompt) run their common tokens once: models.shared_prefix.
        self.share_prefixes = share_prefixes and shared_prefix.enable(lm)

    def forward(
        self,
        input_ids_BL: torch.Tensor,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        candidates_BLN: torch.Tensor | None = None,
        lengths_B: torch.Tensor | None = None,
    ) -> TokenLogprobs | torch.Tensor:
        """Log-probs of every input token given its prefix (position 0 holds 0: mask it out).

        Rows are right-padded (causal attention keeps real tokens independent of the padding);
        `lengths_B` (real tokens per row) lets the forward skip the padding (the values at padding
        positions are then not a forward of the pad tokens: mask them out too).
        Outputs are float32 (float64 for a float64 model), whatever the compute dtype.
        With `candidates_BLN`, log pi(candidates_BLN[b, t, k] | x_<t) instead ([B, L, N], for
        distillation's cached tokens), over the full vocabulary at `temperature`: a nucleus
        (`top_p` < 1) is refused there, as the unchunked reference has none either.
        """
        if candidates_BLN is not None and top_p != 1.0:
            raise ValueError(f"candidate log-probs are over the full vocabulary; got top_p={top_p}")
        # No KV cache: a training forward never decodes, and the cache would keep every layer's
        # keys and values alive until the backward, even under activation checkpointing.
        hidden_BSD = self._hidden(input_ids_BL, lengths_B)[:, :-1]
        head = self.lm.get_output_embeddings()
        if candidates_BLN is not None:
            out_BSN = candidate_logprobs(
                hidden_BSD,
                head.weight,
                candidates_BLN[:, 1:],
                bias_V=head.bias,
                temperature=temperature,
                chunk_size=self.chunk_size,
            )
            return _shift(out_BSN)
        targets_BS = input_ids_BL[:, 1:]
        if top_p == 1.0:
            out = fused_token_logprobs(
                hidden_BSD,
                head.weight,
                targets_BS,
                bias_V=head.bias,
                temperature=temperature,
                chunk_size=self.chunk_size,
            )
        else:
            out = token_logprobs(
                hidden_BSD,
                head.weight,
                targets_BS,
                bias_V=head.bias,
                temperature=temperature,
                chunk_size=self.chunk_size,
                top_p=top_p,
            )
        return TokenLogprobs(_shift(out.logp), _shift(out.entropy))

    def _hidden(self, input_ids_BL: torch.Tensor, lengths_B: torch.Tensor | None) -> torch.Tensor:
        """The decoder's final hidden states [B, L, D], through a shared-prefix layout when one
        pays (`models.shared_prefix`), else the padded rows."""
        decoder = self.lm.get_decoder()
        layout = shared_prefix.plan_layout(input_ids_BL, lengths_B) if self.share_prefixes else None
        if layout is None:
            return decoder(input_ids=input_ids_BL, use_cache=False).last_hidden_state
        inputs = shared_prefix.decoder_inputs(layout, input_ids_BL.device)
        hidden_ND = decoder(**inputs, use_cache=False).last_hidden_state[0]
        return hidden_ND[layout.hidden_at_BL.to(hidden_ND.device)]
