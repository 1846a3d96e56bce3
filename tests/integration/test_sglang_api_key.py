"""SGLang servers with an API key: launched servers get `--api-key`, the client sends it as a Bearer
token on every call, and the stand-in server refuses calls without it (as `--api-key` does)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.config_load import load_config
from asyncrl.generators.sglang.client import Fleet, http_call, wait_until_healthy
from asyncrl.generators.sglang.launch import LaunchSpec, server_argv
from asyncrl.generators.sglang.options import check_config, parse_options, resolve_api_key

pytest.importorskip("transformers")

KEY = "s3cret-key"


@pytest.fixture
def keyed_server(tiny_model_dir):
    from tests.support.sglang.server import StandInServer

    with StandInServer(str(tiny_model_dir), api_key=KEY) as server:
        yield server


@pytest.mark.timeout(60)
def test_the_stand_in_refuses_calls_without_the_key_and_the_client_sends_it(keyed_server):
    url = keyed_server.url
    assert http_call(url, "GET", "/health", None, 10.0)[0] == 200  # open, as in SGLang
    assert http_call(url, "GET", "/model_info", None, 10.0)[0] == 401
    assert http_call(url, "GET", "/model_info", None, 10.0, api_key="wrong")[0] == 401
    assert http_call(url, "GET", "/model_info", None, 10.0, api_key=KEY)[0] == 200
    assert keyed_server.num_unauthorized == 2
    wait_until_healthy([url], 10.0, api_key=KEY)

    async def fleet_calls() -> tuple[int, int]:
        with_key = Fleet([url], api_key=KEY, health_interval_s=1.0, wait_timeout_s=10.0)
        without = Fleet([url], health_interval_s=1.0, wait_timeout_s=10.0)
        try:
            ok, _ = await with_key.call(with_key.servers[0], "POST", "/flush_cache", {}, timeout_s=10.0)
            refused, _ = await without.call(without.servers[0], "GET", "/server_info", timeout_s=10.0)
            return ok, refused
        finally:
            await with_key.close()
            await without.close()

    assert asyncio.run(fleet_calls()) == (200, 401)
    assert keyed_server.num_unauthorized == 3


def test_launched_servers_get_the_key_and_the_host():
    spec = LaunchSpec(
        command=("python", "-m", "sglang.launch_server"),
        model_path="/m",
        num_servers=1,
        log_dir=Path("/tmp"),
        host="10.0.0.5",
        api_key=KEY,
    )
    argv = server_argv(spec, 1234)
    assert argv[argv.index("--host") + 1] == "10.0.0.5"
    assert argv[argv.index("--api-key") + 1] == KEY
    assert KEY not in repr(spec)
    assert "--api-key" not in server_argv(
        LaunchSpec(command=("x",), model_path="/m", num_servers=1, log_dir=Path("/")), 1
    )


def test_api_key_options():
    opts = parse_options({"urls": "http://127.0.0.1:1", "api_key_env": "MY_SGLANG_KEY"}, "keep")
    assert resolve_api_key(opts, {"MY_SGLANG_KEY": KEY}) == KEY
    with pytest.raises(ValueError, match=r"\$MY_SGLANG_KEY is not set"):
        resolve_api_key(opts, {})
    assert resolve_api_key(parse_options({"urls": "http://127.0.0.1:1"}, "keep"), {}) == ""
    with pytest.raises(ValueError, match="must name an environment variable"):
        parse_options({"urls": "http://127.0.0.1:1", "api_key_env": "Bearer abc"}, "keep")
    with pytest.raises(ValueError, match="--api-key"):
        parse_options({"launch": 1, "launch_args": f"--api-key {KEY}"}, "keep")


def test_launched_servers_beyond_loopback_need_a_key(tmp_path):
    from asyncrl.transport.security import write_keys

    write_keys(tmp_path)
    base = [
        "generators.kind=sglang",
        "generators.options.launch=1",
        "cluster.bind_host=10.0.0.5",
        f"cluster.keys_dir={tmp_path}",
    ]
    with pytest.raises(ValueError, match="api_key_env"):
        check_config(load_config(None, base))
    assert check_config(load_config(None, [*base, "generators.options.api_key_env=K"]))["api_key_env"] == "K"
