"""Config loading: defaults, TOML, --set overrides, and errors that name the field path."""

from __future__ import annotations

from pathlib import Path

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


def test_relative_paths_in_a_file_are_relative_to_the_file(tmp_path, monkeypatch):
    """A config file's relative paths resolve against its directory, wherever it is loaded from
    (the word-problems example used to fail outside the repository root: "model.path
    examples/word_problems/model is not a Hugging Face model directory")."""
    conf = tmp_path / "project" / "conf"
    conf.mkdir(parents=True)
    (conf / "job.toml").write_text(
        '[run]\nout_dir = "runs"\n'
        '[model]\npath = "model"\n'
        '[task.dataset]\npath = "data/train.jsonl"\neval_path = "../shared/test.jsonl"\n'
        '[opd]\nteacher = "./teacher"\n'
        '[weights]\ndir = "/dev/shm/w"\n'
        '[cluster]\nkeys_dir = "~/keys"\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config("../project/conf/job.toml")  # a relative path to the file itself, too
    assert cfg.run.out_dir == str(conf / "runs")
    assert cfg.model.path == str(conf / "model")
    assert cfg.task.dataset.path == str(conf / "data" / "train.jsonl")
    assert cfg.task.dataset.eval_path == str(tmp_path / "project" / "shared" / "test.jsonl")
    assert cfg.opd.teacher == str(conf / "teacher")
    assert cfg.weights.dir == "/dev/shm/w"  # absolute: as written
    assert cfg.cluster.keys_dir == "~/keys"  # the home directory: as written, expanded where used


def test_unset_paths_and_keywords_stay_as_written(tmp_path):
    (tmp_path / "job.toml").write_text('[model]\npath = ""\n[opd]\nteacher = "self"\n')
    cfg = load_config(tmp_path / "job.toml")
    assert cfg.model.path == "" and cfg.opd.teacher == "self"


def test_set_paths_stay_relative_to_the_current_directory(tmp_path, monkeypatch):
    """`--set` values are not from the file: a relative one is relative to where the user runs."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "job.toml").write_text('[model]\npath = "model"\n')
    monkeypatch.chdir(tmp_path)
    cfg = load_config(conf / "job.toml", ["model.path=mine/model", "task.dataset.path=data.jsonl"])
    assert cfg.model.path == "mine/model" and cfg.task.dataset.path == "data.jsonl"
    assert Path(cfg.model.path).resolve() == tmp_path / "mine" / "model"


@pytest.mark.parametrize("name", ["nan", "inf", "-inf", "true", "1e3", "42", "[1]", "2024-01-01"])
def test_a_string_key_takes_the_set_value_as_written(name):
    """`--set run.name=nan` was parsed as a float before the schema saw it ("config error at
    run.name: Expected `str`, got `float`"); a string key now keeps the text."""
    assert load_config(overrides=[f"run.name={name}"]).run.name == name


def test_a_quoted_set_string_is_unquoted():
    assert load_config(overrides=['run.name="my run"']).run.name == "my run"
    assert load_config(overrides=["run.name='x'"]).run.name == "x"


def test_other_keys_parse_set_values_as_before():
    cfg = load_config(
        overrides=[
            "learner.lr=1e-3",  # float
            "learner.steps=5",  # int
            "learner.shared_prefix=false",  # bool
            "learner.cpus=[0, 1]",  # list
            "generators.max_batch_groups=4",  # a union: PosInt | "auto"
            "staleness.max_staleness=auto",
            "learner.norm_constant=2.5",  # optional: PosFloat | None
            "staleness.freshness.lambda_roll=1.0",  # a key inside an optional dict
            "staleness.params.anchor=current",  # a dict of a union of scalars
        ]
    )
    assert cfg.learner.lr == pytest.approx(1e-3) and cfg.learner.steps == 5
    assert cfg.learner.shared_prefix is False and cfg.learner.cpus == [0, 1]
    assert cfg.generators.max_batch_groups == 4 and cfg.staleness.max_staleness == "auto"
    assert cfg.learner.norm_constant == 2.5
    assert cfg.staleness.freshness == {"lambda_roll": 1.0}
    assert cfg.staleness.params == {"anchor": "current"}
    assert load_config(overrides=["generators.max_batch_groups=auto"]).generators.max_batch_groups == "auto"


def test_a_misspelt_set_key_still_names_the_valid_keys():
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=["run.nmae=nan"])
    message = str(exc.value)
    assert "unknown key 'run.nmae'" in message
    assert "name" in message.split("valid keys here:")[1]
    with pytest.raises(ConfigError, match="unknown key 'nope'"):
        load_config(overrides=["nope.deeper=1"])


def test_an_unknown_loss_name_lists_the_registered_ones():
    with pytest.raises(
        ConfigError,
        match=r"learner\.loss: unknown policy loss 'sapoo' \(did you mean 'sapo'\?\); "
        r"valid names: cispo, gspo, ppo, sapo",
    ):
        load_config(overrides=["learner.loss=sapoo"])


def test_loss_params_are_the_chosen_loss_own():
    cfg = load_config(overrides=["learner.loss=sapo", "learner.loss_params.tau_neg=2"])
    assert cfg.learner.loss_params == {"tau_neg": 2.0}
    assert cfg.learner.clip_range() is None  # sapo never clips
    with pytest.raises(
        ConfigError,
        match=r"learner\.loss_params: loss 'sapo' has no parameter 'tau'.*"
        r"valid parameters: tau_neg, tau_pos",
    ):
        load_config(overrides=["learner.loss=sapo", "learner.loss_params.tau=2"])
    with pytest.raises(
        ConfigError, match=r"learner\.loss_params: loss 'ppo' takes no parameters, got 'tau_pos'"
    ):
        load_config(overrides=["learner.loss_params.tau_pos=2"])
    with pytest.raises(ConfigError, match=r"learner\.loss_params: tau_pos and tau_neg must be > 0"):
        load_config(overrides=["learner.loss=sapo", "learner.loss_params.tau_pos=0"])


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["learner.loss=sapo", "learner.clip_high=0.28"], "'sapo' never clips the ratio"),
        (["learner.loss=gspo", "learner.dual_clip=3"], "dual_clip applies to loss 'ppo' only, not 'gspo'"),
        (["learner.clip_low=1"], "clip_low must be < 1"),
    ],
)
def test_clip_keys_follow_the_loss_registry(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=sets)
    assert load_config(overrides=["learner.loss=cispo", "learner.clip_low=1"]).learner.clip_range() == (
        1.0,
        0.28,
    )


def test_the_optimal_baseline_refuses_a_loss_that_never_streams():
    """OPOB trains each trajectory on its own, so a loss never linear in A (SAPO with the paper's
    tau_pos != tau_neg) would stop the run at its first trajectory; it fails at load instead."""
    opob = ["staleness.policy=vcpo", "staleness.vcpo_baseline=opob"]
    with pytest.raises(ConfigError, match=r"vcpo_baseline = 'opob' needs each trajectory's loss linear"):
        load_config(overrides=[*opob, "learner.loss=sapo"])
    assert (
        load_config(overrides=[*opob, "learner.loss=sapo", "learner.loss_params.tau_neg=1"]).learner.loss
        == "sapo"
    )
