"""The `sglang` generator's options (`generators.options.*`): types, defaults and checks.

Place in the data flow: pure. `parse_options` runs in the generator's `setup` and, through
`check_config`, in `asyncrl launch` before any process starts, so a misspelled or inconsistent
option fails at load time with the option's name. The learner's weight publisher asks
`servers_per_generator` how many group ranks each generator brings (`publisher.py`).
The options table for users is at the top of `generator.py`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import Config

OPTIONS: dict[str, type | tuple[type, ...]] = {
    "urls": str,
    "launch": int,
    "model_path": str,
    "launch_command": str,
    "launch_args": str,
    "gpus": (str, int),  # `--set generators.options.gpus=3` arrives as an int
    "mem_fraction_static": (int, float),
    "max_concurrency": int,
    "max_connections": int,
    "request_timeout_s": (int, float),
    "startup_timeout_s": (int, float),
    "health_interval_s": (int, float),
    "max_retries": int,
    "pause_mode": str,
    "verify_shards": bool,
    "extra_sampling_params": str,
    "ignore_eos": bool,
    # The name of an environment variable holding the servers' API key (never the key itself:
    # the config is written to the run directory). Launched servers get `--api-key`; every call
    # sends `Authorization: Bearer`.
    "api_key_env": str,
}
PAUSE_MODES = {"keep": "in_place", "retract": "retract", "abort": "abort"}
DEFAULT_LAUNCH_COMMAND = "python -m sglang.launch_server"
ATTACH_STARTUP_TIMEOUT_S = 120.0  # running servers only need to answer /health
LAUNCH_STARTUP_TIMEOUT_S = 600.0  # a real server loads the model and captures CUDA graphs first
# Flags the launcher sets itself (one value per server); launch_args must not repeat them.
MANAGED_FLAGS = ("--model-path", "--model", "--host", "--port", "--weight-version", "--api-key")
LAUNCH_ONLY = ("model_path", "launch_command", "launch_args", "gpus", "mem_fraction_static")
# Control calls one server may have on the wire beside the samples (a weight push or readmission,
# plus an abort or an adapter unload): the room a connection cap must leave (`_check_connections`).
CONTROL_CONNECTIONS_PER_SERVER = 2


def _check_types(options: dict[str, Any]) -> None:
    for key, value in options.items():
        if key not in OPTIONS:
            raise ValueError(
                f"generators.options.{key} is not an sglang generator option; valid: {', '.join(OPTIONS)}"
            )
        if not isinstance(value, OPTIONS[key]) or (isinstance(value, bool) and OPTIONS[key] is not bool):
            raise ValueError(f"generators.options.{key} = {value!r} has the wrong type")


def _split_command(key: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"generators.options.{key} cannot be split into arguments: {exc}") from None


def _parse_launch(out: dict[str, Any]) -> None:
    """The launch options in place: commands as argv lists, GPUs as a tuple (or None = automatic)."""
    if out["launch"] < 1:
        raise ValueError(f"generators.options.launch must be >= 1 (servers to start), got {out['launch']}")
    command = _split_command("launch_command", out.get("launch_command", DEFAULT_LAUNCH_COMMAND))
    if not command:
        raise ValueError("generators.options.launch_command is empty; e.g. 'python -m sglang.launch_server'")
    out["launch_command"] = command
    args = _split_command("launch_args", out.get("launch_args", ""))
    managed = [a for a in args if a.split("=", 1)[0] in MANAGED_FLAGS]
    if managed:
        raise ValueError(
            f"generators.options.launch_args must not set {', '.join(managed)}: the generator sets "
            "--model-path (generators.options.model_path), --host (cluster.bind_host), --port, "
            "--weight-version and --api-key (generators.options.api_key_env) itself"
        )
    out["launch_args"] = args
    gpus = None
    if "gpus" in out:
        gpus = tuple(g.strip() for g in str(out["gpus"]).split(",") if g.strip())
        if len(gpus) != out["launch"]:
            raise ValueError(
                f"generators.options.gpus lists {len(gpus)} devices for launch = {out['launch']} servers; "
                "give one CUDA device per server, e.g. gpus='0,1'"
            )
    out["gpus"] = gpus
    fraction = out.get("mem_fraction_static")
    if fraction is not None and not 0 < fraction < 1:
        raise ValueError(f"generators.options.mem_fraction_static must be in (0, 1), got {fraction}")
    out["mem_fraction_static"] = fraction
    out.setdefault("model_path", "")


def parse_options(options: dict[str, Any], inflight: str) -> dict[str, Any]:
    """Checked options with defaults; ValueError naming the bad option and the valid ones.

    Exactly one of `urls` (attach to running servers) and `launch` (start that many) is given.
    """
    _check_types(options)
    out: dict[str, Any] = {
        "max_concurrency": 64,
        "max_connections": 0,
        "request_timeout_s": 600.0,
        "health_interval_s": 2.0,
        "max_retries": 2,
        "pause_mode": PAUSE_MODES.get(inflight, "retract"),
        "verify_shards": True,
        "extra_sampling_params": "{}",
        "ignore_eos": False,
        **options,
    }
    urls = [u.strip() for u in str(options.get("urls", "")).split(",") if u.strip()]
    launching = "launch" in options
    if launching and urls:
        raise ValueError(
            "generators.options.urls and generators.options.launch exclude each other: attach to "
            "running servers (urls) or let the generator start them (launch = N)"
        )
    if not launching and not urls:
        raise ValueError(
            "the sglang generator needs servers: --set generators.options.urls=http://127.0.0.1:30000,... "
            "(running servers) or --set generators.options.launch=N (start N servers, one per GPU)"
        )
    out["urls"] = urls
    if launching:
        _parse_launch(out)
    else:
        given = [k for k in LAUNCH_ONLY if k in options]
        if given:
            raise ValueError(
                f"generators.options.{given[0]} applies only with generators.options.launch "
                "(the generator starts the servers); remove it or set launch = N"
            )
        out["launch"] = 0
    out.setdefault("startup_timeout_s", LAUNCH_STARTUP_TIMEOUT_S if launching else ATTACH_STARTUP_TIMEOUT_S)
    if out["pause_mode"] not in ("in_place", "retract", "abort"):
        raise ValueError(
            f"generators.options.pause_mode must be in_place, retract or abort, got {out['pause_mode']!r}"
        )
    for key in ("max_concurrency", "request_timeout_s", "startup_timeout_s", "health_interval_s"):
        if out[key] <= 0:
            raise ValueError(f"generators.options.{key} must be > 0, got {out[key]}")
    if out["max_retries"] < 0:
        raise ValueError(f"generators.options.max_retries must be >= 0, got {out['max_retries']}")
    _check_connections(out)
    try:
        extra = json.loads(out["extra_sampling_params"])
    except ValueError as exc:
        raise ValueError(f"generators.options.extra_sampling_params is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError(
            "generators.options.extra_sampling_params must be a JSON object, e.g. '{\"top_k\": 20}'"
        )
    out["extra_sampling_params"] = extra
    env = out.setdefault("api_key_env", "")
    if env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", env):
        raise ValueError(
            f"generators.options.api_key_env = {env!r} must name an environment variable (e.g. SGLANG_API_KEY), "
            "not hold the key"
        )
    return out


def resolve_api_key(opts: dict[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """The servers' API key on this host ("" = none); ValueError naming the variable when
    generators.options.api_key_env names one that is not set here."""
    env = opts.get("api_key_env", "")
    if not env:
        return ""
    key = environ.get(env, "")
    if not key:
        raise ValueError(
            f"generators.options.api_key_env = {env!r} but ${env} is not set (or empty) on this host: "
            f"export {env}=<the key the servers take> before starting the generator"
        )
    return key


def _check_connections(out: dict[str, Any]) -> None:
    """`max_connections` is 0 (no cap: `max_concurrency` bounds the samples) or leaves every
    server room for its control calls beside all the samples: a weight update's
    /continue_generation queued behind samples that the paused server holds would never go out."""
    cap = out["max_connections"]
    need = out["max_concurrency"] + CONTROL_CONNECTIONS_PER_SERVER * servers_per_generator(out)
    if cap < 0:
        raise ValueError(f"generators.options.max_connections must be >= 0 (0: no cap), got {cap}")
    if 0 < cap < need:
        raise ValueError(
            f"generators.options.max_connections = {cap} is too small: use 0 (no cap; max_concurrency "
            f"already bounds the samples) or at least max_concurrency + {CONTROL_CONNECTIONS_PER_SERVER} "
            f"per server = {need}, so weight-update calls never wait behind samples a paused server holds"
        )


def servers_per_generator(opts: dict[str, Any]) -> int:
    """How many servers (and weight-update group ranks: tp_size 1 each) one generator drives."""
    return opts["launch"] or len(opts["urls"])


def check_config(config: Config) -> dict[str, Any]:
    """The options of `config` (an `asyncrl.config.Config`) checked against the rest of the job;
    ValueError naming the conflicting keys."""
    opts = parse_options(dict(config.generators.options), config.weights.inflight)
    num_generators = config.generators.num_generators
    if opts["launch"] and num_generators > 1:
        raise ValueError(
            "generators.options.launch starts the servers of one generator process, which drives all "
            f"of them; use generators.num_generators = 1 (got {num_generators}) and launch = N servers"
        )
    cluster = config.cluster
    if opts["launch"] and not cluster.loopback and not opts["api_key_env"] and not cluster.allow_insecure:
        raise ValueError(
            f"generators.options.launch starts servers on cluster.bind_host = {cluster.bind_host!r} (beyond "
            "loopback): give them an API key with generators.options.api_key_env = 'NAME' (an environment "
            "variable holding it), or set cluster.allow_insecure = true"
        )
    if config.weights.kind == "broadcast" and num_generators > 1:
        raise ValueError(
            "weights.transport = 'broadcast' with the sglang generator joins its servers to the "
            "learner's weight update group, which one generator process drives; use "
            f"generators.num_generators = 1 (got {num_generators})"
        )
    return opts
