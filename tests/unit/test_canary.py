"""The weight-load canary's pure parts: the sequences, the deviation, the launcher's verdicts, the
log-prob kernel both sides score with, the generator's scoring hooks and the learner's test fault."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from asyncrl.generators.canary import GeneratorCanary
from asyncrl.kernels.canary import sequence_logprobs
from asyncrl.learner.canary import FAULT_ENV, corrupt, fault_from
from asyncrl.messages import CanaryReference, CanaryScores, ShardsPublished
from asyncrl.scheduler.canary import CanaryBook, Deviation, assemble_canary, build_canary, deviation


# ---------------------------------------------------------------------- the sequences
def test_assemble_takes_prompt_and_answer_in_order_until_the_budget_and_cuts_the_last():
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
    answers = [[9], [10, 11], [12]]
    assert assemble_canary(prompts, answers, num_tokens=100) == [[1, 2, 3, 9], [4, 5, 10, 11], [6, 7, 8, 12]]
    # 4 + 4 = 8 taken, 2 left: the third is cut to its last two tokens, its answer kept
    assert assemble_canary(prompts, answers, num_tokens=10) == [[1, 2, 3, 9], [4, 5, 10, 11], [8, 12]]
    # 4 + 3 = 7 taken, 1 left: a 1-token sequence has nothing to score, so none follows
    assert assemble_canary(prompts, answers, num_tokens=7) == [[1, 2, 3, 9], [5, 10, 11]]
    assert assemble_canary([[1, 2, 3, 4, 5]], [[6]], num_tokens=3) == [[4, 5, 6]]


def test_assemble_leaves_out_sequences_with_nothing_to_score():
    assert assemble_canary([[1], [2, 3]], [[], [4]], num_tokens=10) == [[2, 3, 4]]


class _Task:
    """Problem i is 'i+i=' with answer str(2i); render is one token per character."""

    def train_problem(self, i):
        return SimpleNamespace(prompt=f"{i}+{i}=", answer=str(2 * i))

    def render(self, problems, tokenizer):
        return [tokenizer(p.prompt)["input_ids"] for p in problems]


def _char_tokenizer(text, add_special_tokens=True):
    return {"input_ids": [ord(c) for c in text]}


def test_build_canary_is_the_tasks_first_problems_with_their_answers():
    ids = build_canary(_Task(), _char_tokenizer, num_tokens=12)
    assert ids == [[ord(c) for c in "0+0=0"], [ord(c) for c in "1+1=2"], [ord(c) for c in "=4"]]
    assert build_canary(_Task(), _char_tokenizer, num_tokens=12) == ids  # deterministic


# ---------------------------------------------------------------------- the deviation
def test_deviation_hand_computed():
    ref = [[-1.0, -2.0], [-0.5]]
    got = deviation(ref, [[-1.5, -2.0], [-0.25]])
    assert got == Deviation(0.5, 0.25, 3)  # |d| = 0.5, 0, 0.25


@pytest.mark.parametrize(
    "scored",
    [[[-1.0, -2.0]], [[-1.0], [-0.5]], [[-1.0, -2.0, -3.0], [-0.5]], [[-1.0, math.nan], [-0.5]]],
    ids=["a sequence missing", "a token missing", "a token too many", "nan"],
)
def test_deviation_of_something_else_is_infinite(scored):
    assert deviation([[-1.0, -2.0], [-0.5]], scored).max_abs == math.inf


# ---------------------------------------------------------------------- the launcher's verdicts
def _book(**kw) -> CanaryBook:
    return CanaryBook(**{"dtype": "float32", "tolerance": 0.1, "max_refusals": 2, **kw})


def _scores(*values, engine="torch"):
    return [CanaryScores(engine=engine, logprobs=[list(values)])]


def test_an_ack_within_the_tolerance_is_accepted_and_recorded():
    book = _book()
    book.on_published(3, [[-1.0, -2.0]])
    v = book.on_loaded("gen-0", 3, _scores(-1.05, -2.1))
    assert v.checked and not v.refused and not v.fail
    assert v.record["outcome"] == "accepted" and v.record["version"] == 3 and v.record["generator"] == "gen-0"
    assert v.worst.max_abs == pytest.approx(0.1) and v.worst.mean_abs == pytest.approx(0.075)


def test_refusals_in_a_row_fail_the_run_naming_generator_version_deviation_and_tolerance():
    book = _book()
    for version in (1, 2, 3):
        book.on_published(version, [[-1.0, -2.0]])
    first = book.on_loaded("gen-1", 1, _scores(-1.0, -2.5))  # mean 0.25 > 0.1
    assert first.refused and not first.fail and first.record["outcome"] == "refused"
    second = book.on_loaded("gen-1", 2, _scores(-1.0, -2.5))
    assert second.refused and second.fail
    for part in ("generator gen-1", "weights version 2", "2 times in a row", "0.25", "0.1", "float32"):
        assert part in second.fail, (part, second.fail)


def test_an_accepted_version_resets_the_refusals_in_a_row():
    book = _book()
    for version in (1, 2, 3):
        book.on_published(version, [[-1.0]])
    assert book.on_loaded("gen-0", 1, _scores(-2.0)).refused
    assert not book.on_loaded("gen-0", 2, _scores(-1.0)).refused
    third = book.on_loaded("gen-0", 3, _scores(-2.0))
    assert third.refused and not third.fail  # one in a row again
    tally = book.summary().by_generator["gen-0"]
    assert (tally.checked, tally.refused, tally.refused_in_a_row) == (3, 2, 1)


def test_refusals_are_counted_per_generator():
    book = _book()
    book.on_published(1, [[-1.0]])
    assert not book.on_loaded("gen-0", 1, _scores(-2.0)).fail
    assert not book.on_loaded("gen-1", 1, _scores(-2.0)).fail


def test_the_worst_engine_decides_and_is_named():
    book = _book()
    book.on_published(1, [[-1.0]])
    scores = [
        CanaryScores(engine="http://a", logprobs=[[-1.0]]),
        CanaryScores(engine="http://b", logprobs=[[-1.5]]),
    ]
    v = book.on_loaded("gen-0", 1, scores)
    assert v.refused and v.engine == "http://b" and v.record["engine"] == "http://b"


def test_nothing_to_compare_is_unchecked_and_accepted():
    book = _book()
    book.on_published(1, None)  # the canary was off, or the learner could not compute it
    v = book.on_loaded("gen-0", 1, _scores(-1.0))
    assert not v.checked and not v.refused and v.record["outcome"] == "unchecked"
    book.on_published(2, [[-1.0]])
    assert not book.on_loaded("gen-0", 2, []).checked  # a plugin that cannot score
    s = book.summary()
    assert (s.checked, s.unchecked, s.refused) == (0, 2, 0)


def test_summary_hand_computed():
    book = _book(tolerance=1.0)
    book.on_published(1, [[-1.0, -1.0]])
    book.on_published(2, [[-1.0, -1.0]])
    book.on_loaded("gen-0", 1, _scores(-1.0, -1.5))  # max 0.5, mean 0.25
    book.on_loaded("gen-0", 2, _scores(-1.25, -1.25))  # max 0.25, mean 0.25
    book.on_loaded("gen-1", 1, _scores(-1.0, -1.0))
    s = book.summary()
    assert (s.dtype, s.tolerance, s.checked, s.refused, s.max_abs_delta) == ("float32", 1.0, 3, 0, 0.5)
    assert s.by_generator["gen-0"].mean_abs_delta == pytest.approx(0.25)
    assert s.by_generator["gen-1"].max_abs_delta == 0.0


def test_old_references_are_let_go():
    book = _book()
    for version in range(1, 40):
        book.on_published(version, [[-1.0]])
    assert not book.on_loaded("gen-0", 1, _scores(-1.0)).checked
    assert book.on_loaded("gen-0", 39, _scores(-1.0)).checked


# ---------------------------------------------------------------------- the kernel
class _LM(torch.nn.Module):
    """A causal toy LM whose logits at t depend on tokens <= t only (embedding + cumulative mean)."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids):
        h = self.emb(input_ids).cumsum(1) / torch.arange(1, input_ids.shape[1] + 1).view(1, -1, 1)
        return SimpleNamespace(logits=self.head(h))


def test_sequence_logprobs_equal_cross_entropy_of_each_sequence_alone():
    model = _LM()
    ids = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    got = sequence_logprobs(model, ids, pad_token_id=0)
    for seq, values in zip(ids, got, strict=True):
        t = torch.tensor([seq])
        want = -F.cross_entropy(model(t).logits[0, :-1], t[0, 1:], reduction="none")
        assert values == pytest.approx(want.tolist(), abs=1e-6)
        assert len(values) == len(seq) - 1


def test_sequence_logprobs_of_nothing():
    assert sequence_logprobs(_LM(), [], pad_token_id=0) == []
    assert sequence_logprobs(_LM(), [[3]], pad_token_id=0) == [[]]


# ---------------------------------------------------------------------- the generator's hooks
class _Scorer:
    def __init__(self, value=-1.0):
        self.value = value
        self.calls = []

    def score_canary(self, ids):
        self.calls.append(ids)
        return [CanaryScores(engine="torch", logprobs=[[self.value] * (len(s) - 1) for s in ids])]


class _AsyncScorer(_Scorer):
    async def score_canary(self, ids):
        return super().score_canary(ids)


def _announcement(version, ids=((1, 2, 3),)):
    ref = CanaryReference(ids=[list(s) for s in ids], logprobs=[[0.0] * (len(s) - 1) for s in ids])
    return ShardsPublished(version=version, root="/w", num_bytes=1, canary=ref)


def test_staged_callback_scores_before_it_acks():
    scorer = _Scorer()
    canary = GeneratorCanary(scorer)
    acked = []

    def on_applied(version):
        acked.append((version, canary.scores.get(version)))  # the scores are there when it acks

    callback = canary.applied_callback(_announcement(4), on_applied)
    callback(4)
    assert scorer.calls == [[[1, 2, 3]]]
    assert acked == [(4, [CanaryScores(engine="torch", logprobs=[[-1.0, -1.0]])])]


def test_staged_scorer_must_be_synchronous():
    canary = GeneratorCanary(_AsyncScorer())
    callback = canary.applied_callback(_announcement(1), lambda v: None)
    with pytest.raises(TypeError, match="must score synchronously"):
        callback(1)


def test_no_scorer_or_no_canary_acks_unchanged():
    def on_applied(version):
        return None

    assert GeneratorCanary(object()).applied_callback(_announcement(1), on_applied) is on_applied
    plain = ShardsPublished(version=1, root="/w", num_bytes=1)
    assert GeneratorCanary(_Scorer()).applied_callback(plain, on_applied) is on_applied


def test_after_load_awaits_an_async_scorer_and_take_drops_older_versions():
    canary = GeneratorCanary(_AsyncScorer(-2.0))
    asyncio.run(canary.after_load(_announcement(2)))
    asyncio.run(canary.after_load(_announcement(3)))
    assert canary.take(3) == [CanaryScores(engine="torch", logprobs=[[-2.0, -2.0]])]
    assert canary.scores == {} and canary.take(2) == []


# ---------------------------------------------------------------------- the learner's test fault
def test_fault_negates_one_matrix_from_its_version_on_and_leaves_the_rest():
    state = {
        "model.embed_tokens.weight": torch.ones(3, 2),
        "model.norm.weight": torch.ones(2),
        "model.layers.0.q_proj.weight": torch.full((2, 2), 2.0),
        "lm_head.weight": torch.ones(3, 2),
    }
    assert fault_from({}) is None and fault_from({FAULT_ENV: "3"}) == 3
    assert corrupt(state, 2, from_version=3) is state
    assert corrupt(state, 5, from_version=None) is state
    bad = corrupt(state, 3, from_version=3)
    assert torch.equal(bad["model.layers.0.q_proj.weight"], torch.full((2, 2), -2.0))
    assert torch.equal(state["model.layers.0.q_proj.weight"], torch.full((2, 2), 2.0))  # not in place
    assert all(bad[k] is state[k] for k in state if k != "model.layers.0.q_proj.weight")


# ---------------------------------------------------------------------- the send gate
def _rollout(task_id, *versions):
    from asyncrl.generators.base import Rollout

    n = len(versions)
    return Rollout(
        task_id=task_id,
        sample_index=0,
        completion_ids=[1] * n,
        behavior_logprobs=[-1.0] * n,
        token_versions=list(versions),
        reward=0.0,
        finish_reason="stop",
    )


def test_gate_holds_tokens_of_a_pending_version_and_everything_after_them_in_order():
    from asyncrl.generators.canary import SendGate

    gate = SendGate()
    old = [_rollout(1, 1, 1)]
    assert not gate.holds(old)  # nothing pending: straight through
    gate.expect(2)
    assert not gate.holds(old)
    switched = [_rollout(2, 1, 2)]  # its last token came from version 2
    assert gate.holds(switched)
    gate.hold(switched)
    later_old = [_rollout(3, 1)]
    assert gate.holds(later_old)  # order is kept behind a held batch
    gate.hold(later_old)
    assert gate.held_samples() == {(2, 0), (3, 0)}
    assert gate.releasable() == []
    gate.expect(3)
    gate.hold([_rollout(4, 3)])
    gate.accept(2)
    assert gate.releasable() == [switched, later_old]  # version 3 still pending for task 4
    assert gate.held_samples() == {(4, 0)}
    gate.forget(3)  # version 3 failed to load: it will not be judged
    assert [b[0].task_id for b in gate.releasable()] == [4] and gate.held_samples() == set()


def test_accepting_a_version_settles_the_older_ones():
    from asyncrl.generators.canary import SendGate

    gate = SendGate()
    gate.expect(2)
    gate.expect(3)  # 2 was superseded before it was applied: no ack of it will come
    gate.hold([_rollout(1, 3)])
    gate.accept(3)
    assert len(gate.releasable()) == 1 and gate.pending == set()


def test_a_version_is_expected_before_the_staged_offer_and_the_load():
    canary = GeneratorCanary(_Scorer())
    canary.applied_callback(_announcement(5), lambda v: None)
    assert canary.gate.pending == {5}
    canary.expect(_announcement(6))
    assert canary.gate.pending == {5, 6}
    unscored = GeneratorCanary(object())
    unscored.expect(_announcement(6))
    assert unscored.gate.pending == set()  # no scores, no verdict: nothing waits
