"""`make_publisher` picks the learner's weight publisher from the weights section and the generator
backend's name and options alone (never the whole config): the built-ins for
shards and broadcast, and a backend's own publisher found through the entry-point group
`asyncrl.publishers` (`<generator name>.<weights transport>`), so `transport/` names no backend.
The SGLang group publisher is chosen exactly when the run broadcasts into SGLang servers."""

from __future__ import annotations

import pytest

from asyncrl.config_load import load_config
from asyncrl.generators.sglang.publisher import SGLangGroupPublisher
from asyncrl.transport.publisher import (
    BroadcastPublisher,
    ShardPublisher,
    WeightPublisher,
    make_publisher,
    publisher_key,
)

TWO_URLS = 'generators.options.urls="http://127.0.0.1:1,http://127.0.0.1:2"'


def build(tmp_path, *overrides: str, generator_ids=("gen-0", "gen-1")):
    config = load_config(None, list(overrides))
    return make_publisher(
        config.weights,
        generator_kind=config.generators.kind,
        generator_options=config.generators.options,
        run_dir=tmp_path,
        model_dir=tmp_path,
        generator_ids=generator_ids,
    )


@pytest.mark.parametrize("transport", ["shards", "broadcast"])
def test_the_torch_generator_gets_the_built_in_publishers(tmp_path, transport):
    publisher = build(tmp_path, "generators.kind=torch", f"weights.transport={transport}")
    assert isinstance(publisher, WeightPublisher)
    assert type(publisher) is (ShardPublisher if transport == "shards" else BroadcastPublisher)


@pytest.mark.parametrize("kind", ["sglang", "asyncrl.generators.sglang:SGLangGenerator"])
def test_broadcast_into_sglang_servers_uses_their_group_publisher(tmp_path, kind):
    publisher = build(tmp_path, f"generators.kind={kind}", "weights.transport=broadcast", TWO_URLS)
    assert isinstance(publisher, SGLangGroupPublisher) and isinstance(publisher, WeightPublisher)
    assert publisher.members == ("gen-0", "gen-0", "gen-1", "gen-1")  # one rank per server
    assert isinstance(publisher.catchup, ShardPublisher) and publisher.catchup.catchup


def test_sglang_without_catchup_shards_gets_no_catchup(tmp_path):
    publisher = build(
        tmp_path,
        "generators.kind=sglang",
        "weights.transport=broadcast",
        "weights.catchup_shards=false",
        TWO_URLS,
    )
    assert isinstance(publisher, SGLangGroupPublisher) and publisher.catchup is None


def test_sglang_with_shards_keeps_the_shard_publisher(tmp_path):
    assert publisher_key("sglang", "shards") is None
    publisher = build(
        tmp_path, "generators.kind=sglang", "weights.transport=shards", TWO_URLS, generator_ids=["gen-0"]
    )
    assert type(publisher) is ShardPublisher and not publisher.catchup


def test_a_path_no_generator_registers_gets_the_built_in_broadcast(tmp_path):
    publisher = build(tmp_path, "generators.kind=my_pkg.gen:Mine", "weights.transport=broadcast")
    assert type(publisher) is BroadcastPublisher
