"""Config loading: defaults, TOML, --set overrides, and errors that name the field path."""

from __future__ import annotations

import pytest

from asyncrl.config_load import load_config, load_resolved_config, write_resolved_config
from asyncrl.config_sections import ConfigError


def test_defaults_validate():
    cfg = load_config()
    assert cfg.mode == "async"
    assert cfg.effective_max_staleness == cfg.staleness.max_staleness


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('mode = "sync"\n[learner]\nsteps = 7\nlr = 0.01\n')
    cfg = load_config(path, ["learner.lr=3e-4", "generators.num_generators=2"])
    assert cfg.mode == "sync"
    assert cfg.learner.steps == 7
    assert cfg.learner.lr == pytest.approx(3e-4)
    assert cfg.generators.num_generators == 2
    assert cfg.effective_max_staleness == 0  # sync is strictly on-policy


def test_unknown_key_names_path_and_valid_keys():
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=["learner.lrr=0.1"])
    assert "learner.lrr" in str(exc.value)
    assert "lr" in str(exc.value).split("valid keys here:")[1]


def test_wrong_type_names_path():
    with pytest.raises(ConfigError, match=r"learner\.steps.*Expected `int`"):
        load_config(overrides=["learner.steps=many"])


def test_out_of_range_names_path():
    with pytest.raises(ConfigError, match=r"learner\.lr.*> 0"):
        load_config(overrides=["learner.lr=-1"])


def test_bad_enum_lists_valid_values():
    with pytest.raises(ConfigError, match="valid values: 'async', 'sync'"):
        load_config(overrides=["mode=fast"])


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(overrides=["learner.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_resolved_config_round_trip(tmp_path):
    cfg = load_config(overrides=["learner.steps=3", "sampling.temperature=0.7"])
    write_resolved_config(cfg, tmp_path / "config.json")
    assert load_resolved_config(tmp_path / "config.json") == cfg


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["buffer.order=freshest"], "buffer.order applies with buffer.mode = 'pool' only"),
        (["buffer.mode=pool", "learner.world_size=2"], "one learner rank"),
        (["buffer.mode=pool", "buffer.action=downweight", "opd.enabled=true"], "OPD does not use"),
        (["buffer.mode=pool", "buffer.action=downweight", "staleness.policy=exact"], "keeps the last"),
        (["buffer.mode=pool", "buffer.max_items=100"], "cannot hold 768 trajectories"),
        (["buffer.mode=pool", "buffer.max_items=1000", "buffer.max_replays=1"], "cannot hold 1536"),
    ],
)
def test_pool_mode_options_are_checked_at_load_time(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=sets)


def test_pool_mode_defaults_validate():
    cfg = load_config(overrides=["buffer.mode=pool", "buffer.max_replays=2", "buffer.max_items=1536"])
    assert cfg.buffer.mode == "pool" and cfg.admission_window_items == 768


def test_a_cpu_listed_twice_is_refused():
    with pytest.raises(ConfigError, match=r"learner\.cpus = \[0, 0\] lists a CPU twice"):
        load_config(overrides=["learner.cpus=[0, 0]"])
    assert load_config(overrides=["generators.cpus=[0]"]).generators.cpus == [0]


def test_auto_batch_groups_share_one_step_between_the_generators():
    cfg = load_config(overrides=["generators.max_batch_groups=auto", "generators.num_generators=3"])
    assert cfg.batch_groups == 11  # ceil(32 / 3)
    assert load_config(overrides=["generators.max_batch_groups=5"]).batch_groups == 5


def test_auto_staleness_bound_asserts_its_cap_and_refuses_pool_mode():
    cfg = load_config(overrides=["staleness.max_staleness=auto", "staleness.max_staleness_cap=3"])
    assert cfg.auto_staleness and cfg.effective_max_staleness == 3
    assert load_config(overrides=["staleness.max_staleness=auto", "mode=sync"]).effective_max_staleness == 0
    with pytest.raises(ConfigError, match="staleness.max_staleness = 'auto'.*pool"):
        load_config(overrides=["staleness.max_staleness=auto", "buffer.mode=pool"])
