"""Token fidelity of agentic episodes on both backends (issue #35, acceptance 2).

Multi-turn episodes of the `digits` environment (the model writes, the environment answers with
digits, three model turns) on a small model whose BPE tokenizer merges digit pairs, so model and
environment tokens merge when an episode is decoded and tokenised again. In sync mode (no weight
update), the learner's log-prob of every model token, recomputed with one plain forward over
prompt + completion (the ids as the trajectory carries them), equals the behavior log-prob the
generator recorded, within FIDELITY_TOL, on the torch generator and on the SGLang stand-in. The
same check on the re-tokenised episodes fails: the test would catch a runner that re-tokenised.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from asyncrl.config_sections import EnvConfig
from asyncrl.messages import PromptTask, SamplingParams
from tests.conftest import set_up_generator
from tests.support.env_models import create_bpe_model

pytest.importorskip("transformers")

# float32 forwards of the same ids in another batch shape (a row decoded next to others, a KV
# cache against one full forward) differ by rounding only.
FIDELITY_TOL = 2e-4
ENV = EnvConfig(kind="tests.support.env_envs:digits", workers=0, max_turns=3, max_tokens=64)


@pytest.fixture(scope="module")
def bpe_model_dir(tmp_path_factory):
    return create_bpe_model(tmp_path_factory.mktemp("bpe-model"))


def tasks(model_dir, max_new_tokens: int = 4) -> list[PromptTask]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    return [
        PromptTask(
            task_id=i,
            group_id=i,
            prompt_ids=[*bos, *tok(text, add_special_tokens=False)["input_ids"]],
            num_samples=6,
            sampling=sampling,
            dataset_index=i,
            window=0,
            answer="",
        )
        for i, text in enumerate(["12+34=", "7+8="])
    ]


def learner_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log pi(completion[t] | prompt, completion[:t]) from one forward, as the learner scores."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), dim=-1)
    targets = ids[0, 1:]
    return logp.gather(1, targets[:, None])[:, 0][len(prompt) - 1 :].tolist()


def fidelity_error(model, prompt, completion, behavior, mask) -> float:
    """Largest |learner - behavior| over model tokens (inf when the streams do not line up)."""
    if len(completion) != len(behavior):
        return float("inf")
    learner = learner_logprobs(model, prompt, completion)
    return max(abs(a - b) for a, b, m in zip(learner, behavior, mask, strict=True) if m)


def check_fidelity_on(model_dir, env: EnvConfig, *, max_new_tokens: int, mixed: bool) -> None:
    """Episodes of `env` on the torch generator with `model_dir` keep the sampled tokens
    (`mixed`: every episode has environment tokens too)."""
    from asyncrl.generators.torch_gen import TorchGenerator

    gen = set_up_generator(TorchGenerator, model_dir, env=env)
    task_list = tasks(model_dir, max_new_tokens)
    check_fidelity(model_dir, task_list, run(gen, task_list), need_merges=False, mixed=mixed)


def check_fidelity(model_dir, task_list, rollouts, *, need_merges: bool = True, mixed: bool = True) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    by_id = {t.task_id: t for t in task_list}
    assert len(rollouts) == sum(t.num_samples for t in task_list)
    merged = 0
    for r in rollouts:
        prompt = list(by_id[r.task_id].prompt_ids)
        mask = r.loss_mask
        assert mask is not None and any(mask)
        assert not mixed or not all(mask), "model and environment tokens both"
        assert all(lp == 0.0 for lp, m in zip(r.behavior_logprobs, mask, strict=True) if not m)
        err = fidelity_error(model, prompt, r.completion_ids, r.behavior_logprobs, mask)
        assert err < FIDELITY_TOL, (
            f"model token log-probs differ by {err} (task {r.task_id} sample {r.sample_index})"
        )
        retokenised = tok(tok.decode(r.completion_ids), add_special_tokens=False)["input_ids"]
        if retokenised != r.completion_ids:
            merged += 1
            assert fidelity_error(model, prompt, retokenised, r.behavior_logprobs, mask) > FIDELITY_TOL
    assert not need_merges or merged >= len(rollouts) // 4, f"only {merged} episodes merge when re-tokenised"


def run(gen, task_list):
    async def go():
        try:
            return await gen.generate(task_list)
        finally:
            await gen.close()

    return asyncio.run(go())


def test_torch_generator_episodes_keep_the_sampled_tokens(bpe_model_dir):
    from asyncrl.generators.torch_gen import TorchGenerator

    gen = set_up_generator(TorchGenerator, bpe_model_dir, env=ENV)
    task_list = tasks(bpe_model_dir)
    rollouts = run(gen, task_list)
    check_fidelity(bpe_model_dir, task_list, rollouts)
    assert all(r.finish_reason in ("stop", "length") for r in rollouts)


def test_sglang_generator_episodes_keep_the_sampled_tokens(bpe_model_dir):
    from asyncrl.generators.sglang import SGLangGenerator
    from tests.support.sglang.server import StandInServer

    server = StandInServer(str(bpe_model_dir)).start()
    try:
        gen = set_up_generator(
            SGLangGenerator,
            bpe_model_dir,
            env=ENV,
            run_seed=7,
            options={"urls": server.url, "health_interval_s": 0.05},
        )
        task_list = tasks(bpe_model_dir)
        rollouts = run(gen, task_list)
    finally:
        server.stop()
    check_fidelity(bpe_model_dir, task_list, rollouts)


def test_episode_samples_are_reproducible_and_distinct(bpe_model_dir):
    """Seeds are per sample and per turn: the same run seed gives the same episodes, and the
    samples of a group differ."""
    from asyncrl.generators.torch_gen import TorchGenerator

    def episodes():
        gen = set_up_generator(TorchGenerator, bpe_model_dir, env=ENV)
        return sorted(
            (r.task_id, r.sample_index, tuple(r.completion_ids)) for r in run(gen, tasks(bpe_model_dir))
        )

    first, second = episodes(), episodes()
    assert first == second
    assert len({ids for _, _, ids in first}) > len(first) // 2


def test_weights_offered_between_turns_version_the_later_tokens(bpe_model_dir):
    """weights.inflight = keep: a version offered while episodes wait on their environments is
    applied by the turn server before the next turn decodes; every model token carries the
    version that produced it, environment tokens the version of the model token before them."""
    from asyncrl.generators.torch_gen import TorchGenerator
    from tests.support.env_envs import OFFERS

    env = msgspec.structs.replace(ENV, kind="tests.support.env_envs:offering")
    gen = set_up_generator(TorchGenerator, bpe_model_dir, env=env)
    state = {k: v.detach().clone() for k, v in gen.model.state_dict().items()}
    OFFERS.append(lambda: gen.offer_weights(1, state))
    rollouts = run(gen, tasks(bpe_model_dir))
    assert gen.version == 1 and not OFFERS
    seen = set()
    for r in rollouts:
        assert r.token_versions == sorted(r.token_versions)
        seen.update(r.token_versions)
        for i, trained in enumerate(r.loss_mask):
            if not trained and i:
                assert r.token_versions[i] == r.token_versions[i - 1]
    assert seen == {0, 1}
    assert any(r.token_versions[0] == 0 and r.token_versions[-1] == 1 for r in rollouts)  # across turns


@pytest.mark.slow
def test_real_model_episodes_keep_the_sampled_tokens():
    """The same check on the real pretrained model (SmolLM2-135M-Instruct, a 49k BPE vocabulary),
    when it is prepared: three-turn `digits` episodes."""
    from tests.support.real_model import real_model_dir

    check_fidelity_on(real_model_dir(), ENV, max_new_tokens=6, mixed=True)
