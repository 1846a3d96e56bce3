"""LoRA RL (`asyncrl/learner/lora.py`) and the adapter's way to the generators.

- `serving_state` equals peft's own `merge_and_unload` of a copy (and W + (alpha/r) B A by hand),
  under the base model's names, without touching the model being trained;
- only the adapters train; their initialisation depends on the seed alone;
- `PolicyLM` over the wrapped model computes the merged model's log-probs;
- `adapter_state` + `adapter_config`, published by `AdapterPublisher`, is a PEFT adapter directory
  that `PeftModel.from_pretrained` loads back to the same adapter (and the stand-in SGLang engine
  serves with the merged model's log-probs).
"""

from __future__ import annotations

import asyncio
import copy
import json
from types import SimpleNamespace

import pytest
import torch

from asyncrl.learner import lora

pytest.importorskip("peft")


def lora_cfg(**kw):
    return SimpleNamespace(**{"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": [], **kw})


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def trained(model_dir, *, seed: int = 0, **kw):
    """A wrapped model whose B matrices are non-zero (as after some training)."""
    model = lora.apply_lora(load(model_dir), lora_cfg(**kw), seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def ids_BL() -> torch.Tensor:
    return torch.tensor([[1, 5, 6, 15, 7, 8, 17, 9], [1, 9, 9, 15, 3, 4, 17, 2]])


def test_serving_state_equals_a_merged_copy(tiny_model_dir):
    base_keys = list(load(tiny_model_dir).state_dict())
    model = trained(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    served = lora.serving_state(model)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(served) == list(merged) == base_keys  # the base model's names, in its order
    for name, t in merged.items():
        assert served[name].shape == t.shape and torch.equal(served[name], t), name
    # by hand for one layer: W + (alpha / r) B A
    layer = lora.base_model(model).model.layers[0].self_attn.q_proj
    by_hand = (
        layer.base_layer.weight + (8.0 / 4) * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    torch.testing.assert_close(served["model.layers.0.self_attn.q_proj.weight"], by_hand)
    # the trained model is untouched: same tensors, adapters still apart
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m.merged for m in lora._lora_layers(model).values())


def test_serving_state_casts_to_the_serving_dtype(tiny_model_dir):
    served = lora.serving_state(trained(tiny_model_dir), torch.bfloat16)
    assert {t.dtype for t in served.values()} == {torch.bfloat16}


def test_only_the_adapters_train(tiny_model_dir):
    from asyncrl.models.policy import PolicyLM

    model = trained(tiny_model_dir)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    hidden = model.config.hidden_size
    q_proj = [n for n in trainable if "layers.0.self_attn.q_proj" in n]
    assert sorted(model.get_parameter(n).numel() for n in q_proj) == [4 * hidden, 4 * hidden]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    policy = PolicyLM(model, chunk_size=4)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    policy(ids_BL()).logp[:, 1:].sum().backward()
    opt.step()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert any(not torch.equal(model.get_parameter(n), t) for n, t in adapters.items())


def test_initialisation_depends_on_the_seed_alone(tiny_model_dir):
    def adapters(seed):
        state = lora.adapter_state(lora.apply_lora(load(tiny_model_dir), lora_cfg(), seed=seed))
        return state

    rng = torch.get_rng_state()
    a, b, c = adapters(5), adapters(5), adapters(6)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left alone
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "lora_A" in k)
    assert all(not t.any() for k, t in a.items() if "lora_B" in k)  # B = 0: starts as the base


def test_a_fresh_adapter_serves_the_base_model(tiny_model_dir):
    from asyncrl.models.policy import PolicyLM

    base = load(tiny_model_dir)
    want = {k: v.clone() for k, v in base.state_dict().items()}
    with torch.no_grad():
        ref = PolicyLM(load(tiny_model_dir), chunk_size=4)(ids_BL()).logp
        model = lora.apply_lora(base, lora_cfg(), seed=0)
        got = PolicyLM(model, chunk_size=4)(ids_BL()).logp
    served = lora.serving_state(model)
    assert all(torch.equal(served[k], want[k]) for k in want)
    torch.testing.assert_close(got, ref)


def test_policy_lm_runs_the_adapted_model(tiny_model_dir):
    """What PolicyLM gets: the wrapped model itself (get_decoder / get_output_embeddings / config
    pass through to the Hugging Face model, whose layers carry the adapters)."""
    from asyncrl.models.policy import PolicyLM

    model = trained(tiny_model_dir)
    merged = load(tiny_model_dir)
    merged.load_state_dict(lora.serving_state(model))
    with torch.no_grad():
        got = PolicyLM(model, chunk_size=4)(ids_BL())
        want = PolicyLM(merged, chunk_size=4)(ids_BL())
    torch.testing.assert_close(got.logp, want.logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-5, rtol=1e-5)


def test_target_modules(tiny_model_dir):
    model = lora.apply_lora(load(tiny_model_dir), lora_cfg(target_modules=["q_proj", "v_proj"]), seed=0)
    adapted = {name.rsplit(".", 1)[-1] for name in lora._lora_layers(model)}
    assert adapted == {"q_proj", "v_proj"}
    assert lora.default_target_modules(load(tiny_model_dir)) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    with pytest.raises(ValueError, match=r"learner.lora.target_modules names \['qkv'\]"):
        lora.apply_lora(load(tiny_model_dir), lora_cfg(target_modules=["qkv"]), seed=0)


def test_save_merged_is_a_plain_model(tiny_model_dir, tmp_path):
    model = trained(tiny_model_dir)
    lora.save_merged(model, tmp_path / "final")
    reloaded = load(tmp_path / "final").state_dict()
    served = lora.serving_state(model)
    assert all(torch.equal(reloaded[k], served[k]) for k in served)


def publish_adapters(model, root, versions, **kw):
    from asyncrl.transport.publisher import AdapterPublisher

    publisher = AdapterPublisher(
        root,
        adapter_config=lora.adapter_config(model),
        keep_last=kw.get("keep_last", 2),
        generator_ids=["g0"],
    )
    sent = []

    async def announce(msg):
        sent.append(msg)

    async def go():
        for v in versions:
            await publisher.publish(lora.adapter_state(model), v, announce)

    asyncio.run(go())
    return publisher, sent


def test_published_adapter_round_trips_through_peft(tiny_model_dir, tmp_path):
    from peft import PeftModel

    from asyncrl.transport.retention import version_dir

    model = trained(tiny_model_dir)
    _, (msg,) = publish_adapters(model, tmp_path / "w", [1])
    vdir = version_dir(tmp_path / "w", 1)
    names = sorted(p.name for p in vdir.iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    config = json.loads((vdir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert config["target_modules"] == lora.default_target_modules(load(tiny_model_dir))
    state = lora.adapter_state(model)
    assert msg.adapter and msg.transport == "shards" and msg.version == 1
    assert msg.num_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert msg.num_bytes < sum(t.numel() * t.element_size() for t in lora.serving_state(model).values()) / 4

    loaded = PeftModel.from_pretrained(load(tiny_model_dir), str(vdir))
    assert set(lora.adapter_state(loaded)) == set(state)
    assert all(torch.equal(lora.adapter_state(loaded)[k], state[k]) for k in state)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids_BL()).logits, model(input_ids=ids_BL()).logits)


def test_adapter_versions_are_retained_like_shards(tiny_model_dir, tmp_path):
    from asyncrl.transport.retention import list_versions

    publisher, sent = publish_adapters(trained(tiny_model_dir), tmp_path / "w", [1, 2, 3, 4])
    assert [m.version for m in sent] == [1, 2, 3, 4] and all(m.adapter for m in sent)
    publisher.on_loaded("g0", 4)
    assert list_versions(tmp_path / "w") == [3, 4]


def test_make_publisher_picks_the_adapter_publisher(tiny_model_dir, tmp_path):
    """Given the adapter's config (what the learner passes with learner.lora.publish = "adapter"),
    make_publisher gives the adapter publisher; without it, full weights as shards."""
    from asyncrl.config_load import load_config
    from asyncrl.transport.publisher import AdapterPublisher, ShardPublisher, make_publisher

    sets = ["generators.kind=sglang", 'generators.options.urls="http://127.0.0.1:1"']
    config = load_config(None, sets)

    def build(adapter_config):
        return make_publisher(
            config.weights,
            generator_kind=config.generators.kind,
            generator_options=config.generators.options,
            run_dir=tmp_path,
            model_dir=tiny_model_dir,
            generator_ids=["g0"],
            adapter_config=adapter_config,
        )

    assert type(build(lora.adapter_config(trained(tiny_model_dir)))) is AdapterPublisher
    assert type(build(None)) is ShardPublisher


def test_single_file_needs_a_safetensors_name(tmp_path):
    from asyncrl.transport.shards import write_shards

    state = {"a": torch.zeros(2)}
    for bad in ("adapter.bin", "../x.safetensors"):
        with pytest.raises(ValueError):
            write_shards(state, tmp_path, 1, max_shard_bytes=1 << 20, fsync=False, single_file=bad)


# ---------------------------------------------------------------------- the stand-in SGLang engine
def engine(model_dir, **settings):
    from tests.support.sglang.engine import Engine
    from tests.support.sglang.lora import LoraSettings

    return Engine(model_dir, skip_tokenizer_init=True, lora=LoraSettings(**settings))


def test_stand_in_checks_adapters_as_sglang_does(tiny_model_dir, tmp_path):
    from asyncrl.transport.retention import version_dir

    publish_adapters(trained(tiny_model_dir), tmp_path / "w", [1])
    path = str(version_dir(tmp_path / "w", 1))
    cases = [
        ({}, "LoRA is not enabled"),
        ({"enabled": True, "max_rank": 2}, "exceeds --max-lora-rank 2"),
        ({"enabled": True, "target_modules": ("q_proj", "v_proj")}, "not in --lora-target-modules"),
    ]
    for settings, message in cases:
        e = engine(tiny_model_dir, **settings)
        try:
            ok, error = e.load_lora_adapter("a", path)
            assert not ok and message in error, error
        finally:
            e.close()
    e = engine(tiny_model_dir, enabled=True, max_rank=8, target_modules=("all",))
    try:
        assert e.load_lora_adapter("a", path) == (True, "")
        ok, error = e.load_lora_adapter("a", path)
        assert not ok and "already exists" in error
        ok, error = e.load_lora_adapter("b", str(tmp_path / "missing"))
        assert not ok and "Failed to load LoRA adapter b" in error
        assert e.unload_lora_adapter("a") == (True, "")
        ok, error = e.unload_lora_adapter("a")
        assert not ok and "does not exist" in error
        assert e.lora_events == [("load", "a"), ("unload", "a")]
    finally:
        e.close()


def test_stand_in_serves_the_merged_model(tiny_model_dir, tmp_path):
    """A request naming the adapter samples from W + (alpha/r) B A: its log-probs are the merged
    model's; a request without one samples from the base."""
    from asyncrl.transport.retention import version_dir
    from tests.support.sglang.engine import new_request
    from tests.support.sglang.params import RequestError, parse_sampling_params

    model = trained(tiny_model_dir)
    publish_adapters(model, tmp_path / "w", [1])
    merged = load(tiny_model_dir)
    merged.load_state_dict(lora.serving_state(model))
    e = engine(tiny_model_dir, enabled=True)
    try:
        assert e.load_lora_adapter("v1", str(version_dir(tmp_path / "w", 1)))[0]
        spec = parse_sampling_params(
            {"max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 1}, vocab_size=e.vocab_size
        )
        prompt = [1, 5, 6, 15, 7, 8, 17]
        with pytest.raises(RequestError, match="not loaded: v2"):
            e.submit(new_request(prompt, spec, lora="v2"))
        reqs = [new_request(prompt, spec, lora="v1"), new_request(prompt, spec)]
        for r in reqs:
            e.submit(r)
        for r in reqs:
            assert r.done.wait(60)
    finally:
        e.close()
    for req, ref_model in zip(reqs, (merged, load(tiny_model_dir)), strict=True):
        with torch.no_grad():
            logits = ref_model(input_ids=torch.tensor([prompt + req.output_ids])).logits[0]
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        ref = logp.gather(1, torch.tensor(req.output_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor([p.logprob for p in req.picks]), ref, atol=1e-4, rtol=0)
    assert e.lora_requests == {"v1": 1}
