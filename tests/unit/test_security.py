"""The `cluster` config section, the run's key files and the roles bound to keys (no sockets)."""

from __future__ import annotations

import os
import stat
import typing

import pytest
from typer.testing import CliRunner

from asyncrl import messages as m
from asyncrl.cli import app
from asyncrl.config_load import load_config
from asyncrl.config_sections import SERVER_PUBLIC_KEY, ClusterConfig, ConfigError
from asyncrl.transport import security


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_defaults_stay_on_loopback_without_curve():
    cluster = load_config().cluster
    assert cluster == ClusterConfig()
    assert cluster.loopback and not cluster.curve_enabled
    policy = security.policy_from_config(cluster, role="generator")
    assert policy.bind_url == "tcp://127.0.0.1" and policy.endpoint(5) == "tcp://127.0.0.1:5"
    assert policy.curve is None and policy.max_message_bytes == security.DEFAULT_MAX_MESSAGE_BYTES


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["cluster.bind_host=10.0.0.5", "cluster.curve=off"], "allow_insecure"),
        (["cluster.bind_host=0.0.0.0"], "asyncrl keys DIR"),  # curve auto -> on, no keys_dir
        (["cluster.curve=on"], "asyncrl keys DIR"),
        (["cluster.curve=on", "cluster.keys_dir=/nonexistent/keys"], "not a directory"),
        (["cluster.bind_host="], "cluster.bind_host is empty"),
        (["cluster.max_message_mb=0"], "cluster.max_message_mb"),
        (["cluster.curve=maybe"], "'auto', 'on', 'off'"),
        (["cluster.bindhost=1.2.3.4"], "valid keys here: bind_host"),
    ],
)
def test_cluster_mistakes_fail_at_load(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, overrides)


def test_curve_off_beyond_loopback_needs_allow_insecure():
    cfg = load_config(
        None, ["cluster.bind_host=10.0.0.5", "cluster.curve=off", "cluster.allow_insecure=true"]
    )
    assert not cfg.cluster.curve_enabled
    assert security.policy_from_config(cfg.cluster, role="learner").insecure
    with pytest.raises(ValueError, match="needs CURVE keys"):
        security.SocketPolicy(bind_host="10.0.0.5")


def test_keys_dir_without_server_key_fails_at_load(tmp_path):
    with pytest.raises(ConfigError, match="server.key is missing"):
        load_config(None, ["cluster.curve=on", f"cluster.keys_dir={tmp_path}"])
    # config.py checks the server's public key by this name (a leaf: it cannot ask this module)
    assert security.key_files(tmp_path, security.SERVER)[0].name == SERVER_PUBLIC_KEY


def test_keys_command_writes_owner_only_files_and_refuses_to_overwrite(tmp_path):
    keys_dir = tmp_path / "keys"
    result = CliRunner().invoke(app, ["keys", str(keys_dir)])
    assert result.exit_code == 0, result.output
    assert _mode(keys_dir) == 0o700
    names = sorted(p.name for p in keys_dir.iterdir())
    expected = sorted(f"{n}{s}" for n in ("server", *security.ROLES) for s in (".key", ".key_secret"))
    assert names == expected
    assert all(_mode(p) == 0o600 for p in keys_dir.iterdir())
    before = (keys_dir / "server.key_secret").read_text()

    again = CliRunner().invoke(app, ["keys", str(keys_dir)])
    assert again.exit_code != 0 and "--force" in again.output
    assert (keys_dir / "server.key_secret").read_text() == before

    os.chmod(keys_dir / "server.key_secret", 0o644)
    forced = CliRunner().invoke(app, ["keys", str(keys_dir), "--force"])
    assert forced.exit_code == 0, forced.output
    assert (keys_dir / "server.key_secret").read_text() != before
    assert _mode(keys_dir / "server.key_secret") == 0o600


def test_keys_load_per_role(tmp_path):
    security.write_keys(tmp_path)
    head = security.CurveKeys.load(tmp_path, role="learner")
    assert head.server_secret is not None and head.secret is not None
    assert sorted(head.clients.values()) == sorted(security.ROLES)
    assert head.clients[head.public] == "learner"
    # A generator host holds the server's public key and its role's keypair only.
    (tmp_path / "server.key_secret").unlink()
    gen = security.CurveKeys.load(tmp_path, role="generator")
    assert gen.server_secret is None and gen.clients == {} and gen.public != head.public
    with pytest.raises(ValueError, match="cannot bind a CURVE socket"):
        policy = security.SocketPolicy(role="generator", curve=gen)
        import zmq

        ctx = zmq.Context()
        try:
            with ctx.socket(zmq.PULL) as sock:
                policy.apply_server(sock)
        finally:
            ctx.term()
    (tmp_path / "monitor.key_secret").unlink()
    with pytest.raises(ValueError, match="monitor.key_secret is missing"):
        security.CurveKeys.load(tmp_path, role="monitor")


def test_secret_key_readable_by_others_is_refused(tmp_path):
    security.write_keys(tmp_path)
    os.chmod(tmp_path / "generator.key_secret", 0o640)
    with pytest.raises(ValueError, match="chmod 600"):
        security.CurveKeys.load(tmp_path, role="generator")


def test_every_message_type_says_who_may_send_it():
    """A message added to asyncrl.messages must be classified, or CURVE runs would reject it."""
    assert {t.__name__ for t in typing.get_args(m.Message)} <= set(security.SENDERS)
    assert all(roles <= set(security.ROLES) for roles in security.SENDERS.values())


def test_a_role_cannot_speak_as_another():
    step = m.StepDone(
        step=0, version=1, num_trajectories=1, num_tokens=1, loss=0.0, mean_reward=0.0, max_staleness=0,
        mean_staleness=0.0, clip_fraction=0.0, grad_norm=0.0, step_s=0.0, idle_s=0.0,
    )  # fmt: skip
    published = m.ShardsPublished(version=1, root="/w", num_bytes=0)
    for msg in (step, published):
        assert security.may_send("learner", msg)
        assert not security.may_send("generator", msg) and not security.may_send("worker", msg)
        assert not security.may_send("", msg)  # no key, no role
    assert security.may_send("generator", m.Hello(role="generator", peer_id="g0", pid=1))
    assert not security.may_send("generator", m.Hello(role="learner", peer_id="g0", pid=1))
    assert not security.may_send(
        "generator", m.Fatal(role="scheduler", peer_id="g0", error="x", traceback="")
    )
    assert not security.may_send("monitor", m.Trajectories(items=()))


def test_advertised_host():
    assert security.advertised_host(ClusterConfig(bind_host="10.1.2.3", curve="on")) == "10.1.2.3"
    assert (
        security.advertised_host(ClusterConfig(bind_host="0.0.0.0", curve="on", advertise_host="a.b"))
        == "a.b"
    )
    wildcard = security.advertised_host(ClusterConfig(bind_host="0.0.0.0", curve="on"))
    assert wildcard and wildcard != "0.0.0.0"


def test_a_shards_location_outside_the_weights_root_is_refused_and_counted(tmp_path):
    from asyncrl.transport.receiver import WeightsReceiver, weights_root

    root = weights_root("", tmp_path / "run")
    assert root == tmp_path / "run" / "weights"
    root.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "escape").symlink_to(tmp_path / "elsewhere")

    def announced(location) -> m.ShardsPublished:
        return m.ShardsPublished(version=1, root=str(location), num_bytes=0)

    receiver = WeightsReceiver("g0", root=root)
    for outside in ("/etc", root / ".." / "x", root / "escape", str(root) + "-twin", tmp_path):
        assert not receiver.plan(announced(outside)), outside
    assert receiver.num_refused_locations == 5
    assert receiver.plan(announced(root)) and receiver.plan(announced(root / "sub"))
    assert receiver.num_refused_locations == 5
    assert WeightsReceiver("g1").plan(announced("/etc"))  # no root given: the old behaviour
