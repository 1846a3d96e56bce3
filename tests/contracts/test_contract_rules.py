"""The contract suite fails broken generators with messages naming the broken rule."""

from __future__ import annotations

import re

import pytest

from asyncrl.generators.base import Rollout
from asyncrl.testing.contract import ContractViolation, check_generator, make_context

pytest.importorskip("transformers")


class ScriptedGenerator:
    """Returns a fixed rollout per sample, edited by `mutate(rollout) -> rollout | None`."""

    mutate = staticmethod(lambda r: r)
    blocking = False

    def setup(self, ctx):
        self._version = 0

    @property
    def version(self):
        return self._version

    async def generate(self, tasks):
        import asyncio

        if not self.blocking:
            await asyncio.sleep(0)
        out = []
        for t in tasks:
            for k in range(t.num_samples):
                r = self.mutate(
                    Rollout(
                        task_id=t.task_id,
                        sample_index=k,
                        completion_ids=[5, 6, 2],
                        behavior_logprobs=[-0.5, -0.1, -0.2],
                        token_versions=[self._version] * 3,
                        reward=1.0,
                        finish_reason="stop",
                    )
                )
                if r is not None:
                    out.append(r)
        return out

    async def load_weights(self, version, location):
        self._version = version

    async def close(self):
        pass


def broken(**attrs):
    return type("Broken", (ScriptedGenerator,), attrs)


def rules_of(exc: ContractViolation) -> set[str]:
    return {v.rule for v in exc.violations}


def test_a_correct_generator_passes(tiny_model_dir, tmp_path):
    report = check_generator(ScriptedGenerator, make_context(tiny_model_dir), weights_dir=tmp_path / "w")
    assert report.loaded_version == 1 and len(report.rollouts) == 5


@pytest.mark.parametrize(
    ("mutate", "rule"),
    [
        (lambda r: None if r.sample_index == 1 else r, "samples-exact"),
        (lambda r: Rollout(**{**r.__dict__, "sample_index": 0}), "samples-exact"),
        (lambda r: Rollout(**{**r.__dict__, "behavior_logprobs": [-0.5, 0.3, -0.2]}), "logprobs-valid"),
        (
            lambda r: Rollout(**{**r.__dict__, "behavior_logprobs": [-0.5, float("nan"), -0.2]}),
            "logprobs-valid",
        ),
        (lambda r: Rollout(**{**r.__dict__, "token_versions": [0, 0]}), "lengths-match"),
        (lambda r: Rollout(**{**r.__dict__, "loss_mask": [True, False]}), "lengths-match"),
        (lambda r: Rollout(**{**r.__dict__, "loss_mask": [1, 0, 1]}), "loss-mask-bool"),
        (lambda r: Rollout(**{**r.__dict__, "token_versions": [0, 3, 3]}), "versions-valid"),
        (lambda r: Rollout(**{**r.__dict__, "reward": float("inf")}), "reward-finite"),
        (lambda r: Rollout(**{**r.__dict__, "finish_reason": "eos"}), "finish-reason"),
        (
            lambda r: Rollout(
                **{**r.__dict__, "completion_ids": [], "behavior_logprobs": [], "token_versions": []}
            ),
            "non-empty",
        ),
    ],
)
def test_each_broken_rule_is_named(tiny_model_dir, mutate, rule):
    with pytest.raises(ContractViolation, match=re.escape(f"[{rule}]")) as info:
        check_generator(broken(mutate=staticmethod(mutate)), make_context(tiny_model_dir))
    assert rule in rules_of(info.value)


def test_decreasing_versions_are_named(tiny_model_dir, tmp_path):
    """After a load, a rollout whose versions go 1 -> 0 breaks versions-valid."""

    class Decreasing(ScriptedGenerator):
        def mutate(self, r):
            if self._version == 0:
                return r
            return Rollout(**{**r.__dict__, "token_versions": [1, 0, 1]})

    with pytest.raises(ContractViolation, match=r"\[versions-valid\].*decrease"):
        check_generator(Decreasing, make_context(tiny_model_dir), weights_dir=tmp_path / "w")


def test_blocking_generate_is_named(tiny_model_dir):
    with pytest.raises(ContractViolation, match=r"\[yields-to-loop\].*asyncio.to_thread"):
        check_generator(broken(blocking=True), make_context(tiny_model_dir))


def test_load_weights_that_does_not_switch_is_named(tiny_model_dir, tmp_path):
    async def load_weights(self, version, location):
        pass

    with pytest.raises(
        ContractViolation, match=r"\[load-weights\] after load_weights\(1, \.\.\.\) version is 0"
    ):
        check_generator(
            broken(load_weights=load_weights), make_context(tiny_model_dir), weights_dir=tmp_path / "w"
        )


def test_close_that_fails_is_named(tiny_model_dir):
    class Once(ScriptedGenerator):
        closed = False

        async def close(self):
            if self.closed:
                raise RuntimeError("already closed")
            self.closed = True

    with pytest.raises(ContractViolation, match=r"\[close\] close\(\) raised RuntimeError: already closed"):
        check_generator(Once, make_context(tiny_model_dir))


def test_not_a_generator_is_named(tiny_model_dir):
    with pytest.raises(
        ContractViolation, match=r"\[protocol\].*lacks \['generate', 'load_weights', 'close'\]"
    ):
        check_generator(
            lambda: type("X", (), {"setup": lambda s, c: None, "version": 0})(), make_context(tiny_model_dir)
        )
