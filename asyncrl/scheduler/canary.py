"""The weight-load canary's decisions: which tokens it is, and whether a loaded version passes.

Place in the data flow: the launcher builds the canary once from the task's first training
problems (`build_canary`) and hands it to the learner (`WorkerArgs.canary_ids`); the learner
announces every version with its own log-probs of it (`WeightsPublished.canary`), every generator
acks a loaded version with its log-probs of the same tokens (`WeightsLoaded.canary`), and the
launcher asks `CanaryBook.on_loaded` what to do: accept the ack, or refuse the version for that
generator (the service restarts it, so it loads the version afresh), or fail the run when one
generator was refused `max_refusals` times in a row. docs/weights.md, "Canary".

Why it exists: checksums prove the bytes a generator read are the bytes the learner wrote, not
that the model samples with the learner's weights. A wrong dtype cast, a tensor under the wrong
name, an engine that silently kept its old weights all pass every checksum and move the
log-probs; the canary compares the log-probs themselves.

The test: the mean over the canary's tokens of |generator - learner| log-prob, against the
tolerance of the publish dtype (`weights.canary_tolerance`). The mean, not the largest: in bf16 the
largest honest deviation sits on some improbable token, where a log-prob is most sensitive, and is
far above the mean (docs/weights.md has the figures); the largest is reported beside it. Every
engine of a generator (an SGLang generator's servers) is judged; one beyond the tolerance refuses
the version for the whole generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from asyncrl.messages import CanaryScores

if TYPE_CHECKING:
    from asyncrl.config import Config

# References kept per version: acks arrive within a few versions of their publish (admission
# bounds how far a generator lags); an older ack is judged unchecked.
REFERENCES_KEPT = 16
# Canary sequences at most: one per training problem; a budget of tokens usually ends it first.
MAX_SEQUENCES = 64


def assemble_canary(
    prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], *, num_tokens: int
) -> list[list[int]]:
    """Prompt i followed by answer i, in order, until `num_tokens` tokens are taken; the last
    sequence is cut to fit from its start, so it keeps its answer (a chat prompt opens with a
    system prompt and a template, which any weights predict alike: the answer is what moves).
    Sequences of fewer than 2 tokens are left out (they have no scored token)."""
    out: list[list[int]] = []
    left = num_tokens
    for prompt, answer in zip(prompts, answers, strict=True):
        seq = [*prompt, *answer][-left:]
        if len(seq) >= 2:
            out.append(seq)
            left -= len(seq)
        if left < 2:
            break
    return out


def build_canary(task: Any, tokenizer: Any, *, num_tokens: int) -> list[list[int]]:
    """The canary of a run: the task's first training problems (stream indices 0, 1, ...) as the
    generators see them (`task.render`), each followed by its answer's tokens, about `num_tokens`
    tokens in all. Deterministic: the same task and tokenizer give the same canary."""
    problems = [task.train_problem(i) for i in range(MAX_SEQUENCES)]
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    for problem, prompt in zip(problems, task.render(problems, tokenizer), strict=True):
        prompts.append(list(prompt))
        answers.append(list(tokenizer(problem.answer, add_special_tokens=False)["input_ids"]))
        if sum(map(len, prompts)) + sum(map(len, answers)) >= num_tokens:
            break
    return assemble_canary(prompts, answers, num_tokens=num_tokens)


class Deviation(NamedTuple):
    """How far one engine's canary log-probs are from the learner's."""

    max_abs: float  # the largest |generator - learner| over every token (inf: a shape mismatch)
    mean_abs: float
    num_tokens: int


def deviation(reference: Sequence[Sequence[float]], scored: Sequence[Sequence[float]]) -> Deviation:
    """Token-by-token |scored - reference|. A different number of sequences or tokens (the engine
    scored something else) and a non-finite value are infinitely far."""
    if len(reference) != len(scored) or any(len(r) != len(s) for r, s in zip(reference, scored, strict=True)):
        return Deviation(math.inf, math.inf, 0)
    deltas = [
        abs(s - r) for ref, sc in zip(reference, scored, strict=True) for r, s in zip(ref, sc, strict=True)
    ]
    if not deltas:
        return Deviation(0.0, 0.0, 0)
    if not all(math.isfinite(d) for d in deltas):
        return Deviation(math.inf, math.inf, len(deltas))
    return Deviation(max(deltas), sum(deltas) / len(deltas), len(deltas))


class Verdict(NamedTuple):
    """What the launcher does with one ack: `checked` False = nothing to compare (no reference, or
    the generator sent no scores) and the ack is accepted; `refused` = restart the generator;
    `fail` = the run stops with this message (else "")."""

    checked: bool
    refused: bool
    worst: Deviation
    engine: str
    record: dict[str, Any]
    fail: str = ""


class GeneratorTally(msgspec.Struct, kw_only=True):
    """One generator slot's canary figures over the run."""

    checked: int = 0
    refused: int = 0
    unchecked: int = 0
    max_abs_delta: float = 0.0  # over every checked version and engine
    mean_abs_delta: float = 0.0  # the mean of the checked versions' mean |delta|
    refused_in_a_row: int = 0


class CanarySummary(msgspec.Struct, frozen=True, kw_only=True):
    """The run's canary in summary.json (`CanaryBook.summary`)."""

    dtype: str  # learner.publish_dtype: the dtype the tolerance is for
    tolerance: float
    checked: int
    refused: int
    unchecked: int
    max_abs_delta: float
    by_generator: dict[str, GeneratorTally]


class CanaryBook:
    """The launcher's canary state: the learner's reference of recent versions, each generator
    slot's tally; decides every ack (`on_loaded`). Pure: no sockets, no clock."""

    def __init__(self, *, dtype: str, tolerance: float, max_refusals: int) -> None:
        self.dtype = dtype
        self.tolerance = tolerance
        self.max_refusals = max_refusals
        self.references: dict[int, list[list[float]]] = {}
        self.tallies: dict[str, GeneratorTally] = {}

    def on_published(self, version: int, reference: list[list[float]] | None) -> None:
        if reference is None:
            return
        self.references[version] = reference
        for old in sorted(self.references)[:-REFERENCES_KEPT]:
            del self.references[old]

    def on_loaded(self, slot: str, version: int, scores: Sequence[CanaryScores]) -> Verdict:
        """Judge generator `slot`'s ack of `version` with `scores` (one per engine)."""
        tally = self.tallies.setdefault(slot, GeneratorTally())
        reference = self.references.get(version)
        if reference is None or not scores:
            tally.unchecked += 1
            none = Deviation(math.nan, math.nan, 0)
            return Verdict(False, False, none, "", self._record(slot, version, none, "", "unchecked"))
        engine, worst = max(
            ((s.engine, deviation(reference, s.logprobs)) for s in scores), key=lambda ed: ed[1].mean_abs
        )
        refused = not worst.mean_abs <= self.tolerance
        tally.checked += 1
        tally.mean_abs_delta += (worst.mean_abs - tally.mean_abs_delta) / tally.checked
        tally.max_abs_delta = max(tally.max_abs_delta, worst.max_abs)
        tally.refused += refused
        tally.refused_in_a_row = tally.refused_in_a_row + 1 if refused else 0
        record = self._record(slot, version, worst, engine, "refused" if refused else "accepted")
        fail = ""
        if refused and tally.refused_in_a_row >= self.max_refusals:
            fail = (
                f"generator {slot}: weights version {version} failed the weight-load canary "
                f"{tally.refused_in_a_row} times in a row (weights.canary_max_refusals = {self.max_refusals}): "
                f"mean |delta log-prob| {worst.mean_abs:.3g} (max {worst.max_abs:.3g}) on {engine}, over the tolerance "
                f"{self.tolerance:g} for {self.dtype} (weights.canary_tolerance.{self.dtype}). The weights it "
                "samples with are not the learner's: check the weights path, dtype and tensor names "
                '(docs/weights.md, "Canary")'
            )
        return Verdict(True, refused, worst, engine, record, fail)

    def _record(self, slot: str, version: int, dev: Deviation, engine: str, outcome: str) -> dict[str, Any]:
        """The `canary` record of metrics.jsonl for one ack."""
        return {
            "generator": slot,
            "version": version,
            "outcome": outcome,
            "engine": engine,
            "max_abs_delta": dev.max_abs,
            "mean_abs_delta": dev.mean_abs,
            "num_tokens": dev.num_tokens,
            "dtype": self.dtype,
            "tolerance": self.tolerance,
        }

    def summary(self) -> CanarySummary:
        tallies = self.tallies.values()
        return CanarySummary(
            dtype=self.dtype,
            tolerance=self.tolerance,
            checked=sum(t.checked for t in tallies),
            refused=sum(t.refused for t in tallies),
            unchecked=sum(t.unchecked for t in tallies),
            max_abs_delta=max((t.max_abs_delta for t in tallies if t.checked), default=0.0),
            by_generator=dict(self.tallies),
        )


def canary_for_run(config: Config, task: Any, tokenizer: Any) -> tuple[list[list[int]], CanaryBook]:
    """The run's canary token ids ([] with weights.canary off) and the book that judges acks."""
    weights = config.weights
    ids = build_canary(task, tokenizer, num_tokens=weights.canary_tokens) if weights.canary else []
    dtype = config.learner.publish_dtype
    book = CanaryBook(
        dtype=dtype, tolerance=weights.canary_tolerance.of(dtype), max_refusals=weights.canary_max_refusals
    )
    return ids, book
