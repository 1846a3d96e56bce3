"""weights.broadcast_local (docs/weights.md): how the CPU broadcast group reaches generators on the
learner's host, validated at load and handed to the publisher."""

from __future__ import annotations

import pytest

from asyncrl.config_load import load_config
from asyncrl.config_sections import ConfigError
from asyncrl.transport.publisher import BroadcastPublisher, make_publisher


def test_the_shared_memory_ring_is_the_default_and_gloo_can_be_chosen() -> None:
    assert load_config(None).weights.broadcast_local == "shm"
    assert load_config(None, ['weights.broadcast_local="gloo"']).weights.broadcast_local == "gloo"


def test_an_unknown_value_names_the_key_and_the_valid_values() -> None:
    with pytest.raises(ConfigError, match=r"weights\.broadcast_local.*'tcp'.*valid values: 'shm', 'gloo'"):
        load_config(None, ['weights.broadcast_local="tcp"'])


@pytest.mark.parametrize("local", ["shm", "gloo"])
def test_the_broadcast_publisher_sends_as_configured(tmp_path, local: str) -> None:
    config = load_config(None, ['weights.transport="broadcast"', f'weights.broadcast_local="{local}"'])
    publisher = make_publisher(
        config.weights,
        generator_kind=config.generators.kind,
        generator_options=config.generators.options,
        run_dir=tmp_path,
        model_dir=tmp_path,
        generator_ids=["gen-0"],
    )
    try:
        assert isinstance(publisher, BroadcastPublisher) and publisher.local == local
    finally:
        publisher.close()
