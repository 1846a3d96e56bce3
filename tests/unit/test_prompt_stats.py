"""The per-prompt record (scheduler/prompt_stats.py): the Beta update rule on hand-computed cases,
exact sums whatever the order TaskDones arrive in, degenerate groups, the step summary, and a
checkpoint round trip that restores it bit for bit."""

from __future__ import annotations

import msgspec
import pytest

from asyncrl.messages import PromptTask, SamplingParams, TaskDone
from asyncrl.scheduler.prompt_stats import QUANTUM, PromptRecord, PromptStats, StatsState, prompt_key
from asyncrl.scheduler.selection import Selection, UniformSelector
from asyncrl.tasks.base import Problem


def stats_with(*groups: tuple[int, str, float, int], window: int = 0) -> PromptStats:
    """Groups (id, prompt key, primary reward sum, samples), admitted then observed in order."""
    stats = PromptStats()
    for group_id, key, total, n in groups:
        stats.admitted(group_id, group_id, key, window)
        stats.observe(group_id, total=total, num_samples=n)
    return stats


def test_binary_rewards_are_the_bernoulli_update_from_the_uniform_prior():
    stats = stats_with((0, "p", 3.0, 4), (1, "p", 1.0, 4))
    assert stats.posterior("p") == (1 + 4.0, 1 + 4.0)  # 4 successes, 4 failures in all
    assert stats.records["p"] == PromptRecord(successes=4.0, failures=4.0, groups=2, last_seen=0, index=1)
    assert stats.posterior("never") == (1.0, 1.0) and stats.mean("never") == 0.5


def test_fractional_rewards_count_as_fractions_of_a_success_and_are_clipped_to_0_n():
    stats = stats_with((0, "a", 2.5, 4), (1, "b", 5.3, 4), (2, "c", -1.0, 4))
    assert stats.posterior("a") == (3.5, 2.5)
    assert stats.posterior("b") == (5.0, 1.0)  # over n: every sample a success
    assert stats.posterior("c") == (1.0, 5.0)  # below 0: every sample a failure


def test_sums_are_exact_so_the_arrival_order_does_not_matter():
    # In float64 (0.1 + 0.2) + 0.3 != 0.1 + (0.2 + 0.3); on the 2**-20 grid both orders are equal.
    assert (0.1 + 0.2) + 0.3 != 0.1 + (0.2 + 0.3)
    totals = [0.1, 0.2, 0.3, 0.7, 1.9]
    forward = stats_with(*[(g, "p", t, 2) for g, t in enumerate(totals)])
    backward = stats_with(*[(g, "p", t, 2) for g, t in reversed(list(enumerate(totals)))])
    assert forward.records["p"] == backward.records["p"]
    assert forward.records["p"].successes / QUANTUM == int(forward.records["p"].successes / QUANTUM)
    assert forward.records["p"].successes == pytest.approx(sum(totals), abs=len(totals) * QUANTUM)


def test_last_seen_is_the_latest_window_and_its_index_whatever_the_order():
    stats = PromptStats()
    stats.admitted(5, 50, "p", 3)
    stats.admitted(2, 20, "p", 1)
    stats.observe(5, total=1.0, num_samples=2)
    stats.observe(2, total=1.0, num_samples=2)  # arrives last, from an earlier window
    assert (stats.records["p"].last_seen, stats.records["p"].index, stats.records["p"].groups) == (3, 50, 2)


def test_degenerate_groups_and_the_step_summary_hand_computed():
    # Posterior means 1/5, 2/5, 3/5, 4/5 (groups of 3 with 0..3 successes); two are degenerate.
    stats = stats_with((0, "a", 0.0, 3), (1, "b", 1.0, 3), (2, "c", 2.0, 3), (3, "d", 3.0, 3))
    fields = stats.step_fields()
    assert fields["prompts_seen"] == 4 and fields["groups_observed"] == 4
    assert fields["degenerate_fraction"] == 0.5
    # Linear between order statistics: q10 at position 0.3, q25 at 0.75, q50 at 1.5.
    assert fields["pass_rate_quantiles"] == {"q10": 0.26, "q25": 0.35, "q50": 0.5, "q75": 0.65, "q90": 0.74}
    again = stats.step_fields()  # the per-step counts start again
    assert again["groups_observed"] == 0 and again["degenerate_fraction"] is None


def test_a_group_observed_twice_or_never_admitted_is_refused():
    stats = stats_with((0, "a", 1.0, 2))
    with pytest.raises(ValueError, match="group 0 was not admitted, or was observed already"):
        stats.observe(0, total=1.0, num_samples=2)


def test_the_state_survives_a_json_round_trip_exactly():
    stats = stats_with((0, "a", 0.1, 3), (1, "b", 2.7, 3), window=4)
    stats.groups_trained([0, 1])
    stats.admitted(7, 70, "c", 5)
    data = msgspec.json.decode(msgspec.json.encode(stats.state()))  # as a checkpoint file holds it
    assert data["open"] == {"7": [70, "c", 5]}
    back = PromptStats()
    back.restore(msgspec.convert(data, StatsState, strict=False))
    assert back.records == back.trained == stats.records and back.open == {}


def test_a_checkpoint_holds_the_trained_groups_only():
    """A group finished and not trained is admitted again by a resume and counted then; one
    trained before its TaskDone arrived counts when it does."""
    stats = stats_with((0, "a", 1.0, 2), (1, "a", 2.0, 2), (2, "b", 0.0, 2))
    stats.admitted(3, 3, "b", 0)
    stats.groups_trained([0, 3])  # group 3's TaskDone has not arrived
    assert stats.state().records == {
        "a": PromptRecord(successes=1.0, failures=1.0, groups=1, last_seen=0, index=0)
    }
    assert stats.records["a"].groups == 2 and stats.records["b"].groups == 1  # selection reads all
    stats.observe(3, total=2.0, num_samples=2)
    assert stats.state().records["b"] == PromptRecord(
        successes=2.0, failures=0.0, groups=1, last_seen=0, index=3
    )


def test_prompts_are_named_by_their_text():
    p = Problem(index=3, prompt="2+2=", answer="4")
    assert prompt_key(p) == prompt_key(Problem(index=900, prompt="2+2=", answer="4"))
    assert prompt_key(p) != prompt_key(Problem(index=3, prompt="2+3=", answer="5"))


def task_done(total_reward: float, n: int, **sums: float) -> TaskDone:
    return TaskDone(
        task_id=0,
        generator_id="a",
        num_trajectories=n,
        num_tokens=0,
        generate_s=0.0,
        mean_reward=total_reward / n,
        reward_sums=sums,
    )


def admitted_group(reward_name: str, n: int) -> tuple[Selection, PromptTask]:
    """A uniform selection whose group 0 (n samples) was admitted for the prompt "p"."""
    selection = Selection("uniform", UniformSelector(), PromptStats(), reward_name=reward_name)
    task = PromptTask(
        task_id=0,
        group_id=0,
        prompt_ids=[1],
        num_samples=n,
        sampling=SamplingParams(),
        dataset_index=0,
        window=0,
        answer="",
    )
    selection.admitted(task, "p")
    return selection, task


@pytest.mark.parametrize(
    ("reward_name", "expected"),
    [("correct", (1 + 2.0, 1 + 2.0)), ("", (1 + 2.2, 1 + 1.8))],
    ids=["primary-reward", "task-score"],
)
def test_the_posterior_reads_the_primary_reward_not_the_weighted_sum(reward_name, expected):
    """Two correct of four with a 0.1-weighted format reward on every sample: the weighted sum is
    2.4; the primary reward's sum is 2. With no task.rewards the task's score (the mean) counts."""
    selection, task = admitted_group(reward_name, 4)
    total = 2.2 if not reward_name else 2.4
    selection.observe(task, task_done(total, 4, correct=2.0, format=4.0))
    selection.observe(task, task_done(total, 4, correct=2.0, format=4.0))  # a second copy: not counted
    assert selection.stats.posterior("p") == pytest.approx(expected, abs=QUANTUM)


def guided_done(total_reward: float, n: int, num_guided: int, guided_sum: float, **sums: float) -> TaskDone:
    return msgspec.structs.replace(
        task_done(total_reward, n, **sums), num_guided=num_guided, guided_reward_sum=guided_sum
    )


@pytest.mark.parametrize("reward_name", ["correct", ""], ids=["primary-reward", "task-score"])
def test_guided_successes_are_not_passes(reward_name):
    """A group of 6 whose last 2 members were guided and both succeeded, with 1 success among the 4
    unguided: the record adds 1 success and 3 failures (the unguided members' Beta update), not 3
    and 3; the group is not degenerate (its unguided members differ)."""
    selection, task = admitted_group(reward_name, 6)
    selection.observe(task, guided_done(3.0, 6, 2, 2.0, correct=3.0))
    assert selection.stats.posterior("p") == (1 + 1.0, 1 + 3.0)
    assert selection.stats.records["p"] == PromptRecord(
        successes=1.0, failures=3.0, groups=1, last_seen=0, index=0
    )
    assert selection.stats.step_fields()["degenerate_fraction"] == 0.0


def test_a_group_whose_unguided_members_all_failed_is_degenerate_and_counts_no_guided_pass():
    stats = PromptStats()
    stats.admitted(0, 0, "p", 0)
    assert stats.observe(0, total=2.0, num_samples=4, num_guided=2, guided_total=2.0)  # 0 of 2 unguided
    assert stats.posterior("p") == (1.0, 1.0 + 2.0)
    stats.admitted(1, 1, "p", 0)  # every member guided: no samples, no successes
    stats.observe(1, total=1.0, num_samples=1, num_guided=1, guided_total=1.0)
    assert stats.posterior("p") == (1.0, 3.0) and stats.records["p"].groups == 2
    stats.admitted(2, 2, "q", 0)
    with pytest.raises(ValueError, match="group 2 has 5 guided of 4 samples"):
        stats.observe(2, total=0.0, num_samples=4, num_guided=5)


def test_with_guidance_the_record_counts_the_reward_whose_guided_share_is_on_the_wire():
    """TaskDone's guided_reward_sum is of the weighted sum: with guidance and a weighted mix the
    record takes the task's score; with one reward of weight 1 (the same values) the primary."""
    from asyncrl.config_load import load_config  # noqa: PLC0415
    from asyncrl.config_sections import RewardConfig  # noqa: PLC0415
    from asyncrl.scheduler.selection import primary_reward  # noqa: PLC0415

    def with_rewards(config, *rewards):
        return msgspec.structs.replace(
            config, task=msgspec.structs.replace(config.task, rewards=list(rewards))
        )

    correct, fmt = (
        RewardConfig(kind="exact_match", name="correct"),
        RewardConfig(kind="regex", name="format", weight=0.1),
    )
    plain = load_config(overrides=["task.kind=dataset"])
    guided = msgspec.structs.replace(
        plain,
        sampling=msgspec.structs.replace(
            plain.sampling, guidance=msgspec.structs.replace(plain.sampling.guidance, enabled=True)
        ),
    )
    assert primary_reward(with_rewards(plain, correct, fmt)) == "correct"
    assert primary_reward(with_rewards(guided, correct, fmt)) == ""
    assert primary_reward(with_rewards(guided, correct)) == "correct"
