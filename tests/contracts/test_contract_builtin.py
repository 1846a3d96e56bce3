"""The generator contract suite (`asyncrl.testing.contract`) on every generator we ship: the
built-in `torch` generator, the `sglang` generator against an in-process stand-in server, and the
calculator environment of `examples/calculator_agent` on the torch generator."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config_sections import EnvConfig
from asyncrl.testing.contract import GeneratorContractTests, make_context

pytest.importorskip("transformers")

CALCULATOR = EnvConfig(
    kind="examples.calculator_agent.environment:calculator",
    stop_tokens=["="],
    workers=0,
    options={"max_answers": 3},
)

REPO = Path(__file__).resolve().parents[2]


class TestTorchGenerator(GeneratorContractTests):
    @pytest.fixture
    def generator_factory(self):
        from asyncrl.generators.base import resolve_generator

        return resolve_generator("torch")

    @pytest.fixture
    def generator_context(self, tiny_model_dir):
        return make_context(tiny_model_dir)


class TestSGLangGenerator(GeneratorContractTests):
    @pytest.fixture
    def server(self, tiny_model_dir):
        from tests.support.sglang.server import StandInServer

        s = StandInServer(str(tiny_model_dir)).start()
        yield s
        s.stop()

    @pytest.fixture
    def generator_factory(self):
        from asyncrl.generators.base import resolve_generator

        return resolve_generator("sglang")

    @pytest.fixture
    def generator_context(self, tiny_model_dir, server):
        return make_context(tiny_model_dir, options={"urls": server.url, "health_interval_s": 0.05})


class TestCalculatorEnvironmentOnTorch(GeneratorContractTests):
    """The torch generator running the calculator environment of examples/calculator_agent (every
    sample an episode) passes the same contract."""

    @pytest.fixture
    def generator_factory(self, monkeypatch):
        from asyncrl.generators.base import resolve_generator

        monkeypatch.syspath_prepend(str(REPO))
        return resolve_generator("torch")

    @pytest.fixture
    def generator_context(self, tiny_model_dir):
        return make_context(tiny_model_dir, env=CALCULATOR)

    def test_environment_tokens_are_masked(self, generator_factory):
        """On the shipped model (which answers, often wrongly, then ends its turn): environment
        tokens carry log-prob 0.0 and loss_mask False, model tokens are trained."""
        from asyncrl.models.default import DEFAULT_MODEL_DIR
        from asyncrl.testing.contract import check_generator

        report = check_generator(generator_factory, make_context(DEFAULT_MODEL_DIR, env=CALCULATOR))
        for r in report.rollouts:
            assert r.loss_mask is not None and r.loss_mask[0]
            for lp, trained in zip(r.behavior_logprobs, r.loss_mask, strict=True):
                assert trained or lp == 0.0
        assert any(not all(r.loss_mask) for r in report.rollouts)  # some episode took a second turn
