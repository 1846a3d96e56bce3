"""The SGLang generator's weight-load canary: each server in service scores the canary's tokens.

Place in the data flow: after a version is loaded into the servers (`load_weights`, an adapter
switch, or `receive_broadcast`), the generator's weight task calls `score_canary`
(`generators/canary.py`); this module asks every server in service for the prompt log-probs of
each canary sequence (`/generate` with `logprob_start_len = 0`, `max_new_tokens = 0`:
`input_token_logprobs`, plain log-softmax without temperature, SGLANG_API.md 1.3), naming the
version's adapter with `lora_path` when the servers serve one. One `CanaryScores` per server,
engine = its URL, so the launcher names the server that differs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from asyncrl.generators.sglang.client import (
    Fleet,
    GenerateRequest,
    Server,
    ServerUnavailable,
    SGLangRequestError,
    decode_generate,
)
from asyncrl.messages import CanaryScores


async def score_sequence(
    fleet: Fleet, server: Server, seq: Sequence[int], *, rid: str, adapter: str | None, timeout_s: float
) -> list[float]:
    """log pi(seq[t] | seq[:t]) for t >= 1 on `server`, from its `input_token_logprobs`."""
    body = GenerateRequest(
        input_ids=list(seq),
        sampling_params={"max_new_tokens": 0, "temperature": 0.0},
        rid=rid,
        return_logprob=True,
        logprob_start_len=0,
        lora_path=adapter,
    )
    status, data = await fleet.call(server, "POST", "/generate", body, timeout_s=timeout_s)
    if status != 200:
        raise SGLangRequestError(f"SGLang server {server.url} refused the canary (HTTP {status})")
    rows = decode_generate(data).meta_info.input_token_logprobs
    values = [row[0] for row in rows[1:]]
    if len(rows) != len(seq) or any(v is None for v in values):
        raise SGLangRequestError(
            f"SGLang server {server.url} answered {len(rows)} prompt log-probs for a {len(seq)}-token canary"
        )
    return [float(v) for v in values]


async def score_on_servers(
    fleet: Fleet, ids: Sequence[Sequence[int]], *, name: str, adapter: str | None, timeout_s: float
) -> list[CanaryScores]:
    """Every server in service scores every sequence (concurrently); a server that fails is
    quarantined (as for any request) and left out of the scores."""

    async def one(server: Server) -> CanaryScores | None:
        try:
            rows = await asyncio.gather(
                *(
                    score_sequence(
                        fleet, server, seq, rid=f"{name}-canary-{i}", adapter=adapter, timeout_s=timeout_s
                    )
                    for i, seq in enumerate(ids)
                )
            )
        except (ServerUnavailable, SGLangRequestError) as exc:
            fleet.quarantine(server, f"weight-load canary: {exc}")
            return None
        return CanaryScores(engine=server.url, logprobs=list(rows))

    scored = await asyncio.gather(*(one(s) for s in fleet.in_service()))
    return [s for s in scored if s is not None]
