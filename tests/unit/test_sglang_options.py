"""The sglang generator's pure parts: option checks (load time), the launch command line, GPU
assignment, the weight-group rank layout and the HTTP buckets of a distributed update."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from asyncrl.config_load import load_config
from asyncrl.generators.sglang.group import member_ranks, name_buckets
from asyncrl.generators.sglang.launch import LaunchSpec, assign_gpus, server_argv
from asyncrl.generators.sglang.options import check_config, parse_options, servers_per_generator
from asyncrl.messages import TensorMeta


def test_attach_and_launch_defaults():
    attach = parse_options({"urls": "http://127.0.0.1:1,http://127.0.0.1:2"}, "keep")
    assert (
        attach["launch"] == 0 and attach["startup_timeout_s"] == 120.0 and attach["pause_mode"] == "in_place"
    )
    assert servers_per_generator(attach) == 2
    launch = parse_options({"launch": 3}, "retract")
    assert launch["launch_command"] == ["python", "-m", "sglang.launch_server"]
    assert launch["launch_args"] == [] and launch["gpus"] is None and launch["model_path"] == ""
    assert launch["startup_timeout_s"] == 600.0 and launch["pause_mode"] == "retract"
    assert servers_per_generator(launch) == 3
    custom = parse_options(
        {
            "launch": 2,
            "launch_command": "python -m tests.support.sglang.server",
            "launch_args": "--disable-cuda-graph --log-level 'warning'",
            "gpus": "2, 3",
            "mem_fraction_static": 0.5,
            "startup_timeout_s": 30,
        },
        "keep",
    )
    assert custom["launch_args"] == ["--disable-cuda-graph", "--log-level", "warning"]
    assert custom["gpus"] == ("2", "3") and custom["startup_timeout_s"] == 30
    assert parse_options({"launch": 1, "gpus": 3}, "keep")["gpus"] == ("3",)  # `--set ...gpus=3` is an int


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({}, "needs servers"),
        ({"urls": "http://127.0.0.1:1", "launch": 1}, "exclude each other"),
        ({"launch": 0}, "launch must be >= 1"),
        ({"launch": True}, "wrong type"),
        ({"launch": 2, "gpus": "0"}, "gpus lists 1 devices for launch = 2"),
        ({"launch": 1, "launch_args": "--port 3000"}, "must not set --port"),
        ({"launch": 1, "launch_args": "--model-path=/x"}, "must not set --model-path=/x"),
        ({"launch": 1, "launch_args": "--log-level 'warning"}, "cannot be split"),
        ({"launch": 1, "launch_command": "  "}, "launch_command is empty"),
        ({"launch": 1, "mem_fraction_static": 1.5}, "mem_fraction_static must be in (0, 1)"),
        ({"urls": "http://127.0.0.1:1", "model_path": "/m"}, "model_path applies only with"),
        ({"launch": 1, "lunch": 2}, "lunch is not an sglang generator option"),
    ],
)
def test_bad_options_name_the_option(options, fragment):
    with pytest.raises(ValueError) as err:
        parse_options(options, "keep")
    assert fragment in str(err.value)


def test_check_config_rejects_what_one_generator_process_cannot_drive():
    base = ['generators.kind="sglang"', "generators.options.launch=2"]
    assert check_config(load_config(None, base))["launch"] == 2
    with pytest.raises(ValueError, match="num_generators = 1"):
        check_config(load_config(None, [*base, "generators.num_generators=2"]))
    attach = ['generators.kind="sglang"', 'generators.options.urls="http://127.0.0.1:1"']
    check_config(load_config(None, [*attach, "generators.num_generators=2"]))  # shards: shared servers
    with pytest.raises(ValueError, match="weight update group"):
        check_config(
            load_config(None, [*attach, "generators.num_generators=2", "weights.transport=broadcast"])
        )


def test_server_command_line():
    spec = LaunchSpec(
        command=("python", "-m", "sglang.launch_server"),
        model_path="/ckpt",
        num_servers=2,
        log_dir=Path("/tmp"),
        extra_args=("--disable-cuda-graph",),
        mem_fraction_static=0.3,
    )
    assert server_argv(spec, 30001) == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--weight-version",
        "0",
        "--mem-fraction-static",
        "0.3",
        "--disable-cuda-graph",
    ]


def test_gpu_assignment():
    assert assign_gpus(2, None, None) == ["0", "1"]
    assert assign_gpus(2, None, "4,5,6") == ["4", "5"]
    assert assign_gpus(2, ("7", "3"), "4,5,6") == ["7", "3"]
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        assign_gpus(3, None, "4,5")


def test_member_ranks_follow_the_owner_list():
    assert member_ranks(("gen-0", "gen-0", "gen-1"), "gen-0") == [1, 2]
    assert member_ranks(("gen-0", "gen-0", "gen-1"), "gen-1") == [3]
    assert member_ranks(("gen-0",), "gen-0-r1") == []  # a restarted generator is not a member


def test_name_buckets_keep_the_broadcast_order():
    metas = [
        TensorMeta(name="a", dtype="float32", shape=(10,)),  # 40 bytes
        TensorMeta(name="b", dtype="bfloat16", shape=(10,)),  # 20
        TensorMeta(name="big", dtype="float32", shape=(100,)),  # 400 > bucket: alone
        TensorMeta(name="c", dtype="int64", shape=(2, 2)),  # 32
        TensorMeta(name="d", dtype="float32", shape=(0, 3)),  # 0
    ]
    buckets = name_buckets(metas, 64)
    assert [[m.name for m in b] for b in buckets] == [["a", "b"], ["big"], ["c", "d"]]
    assert [m for b in buckets for m in b] == metas
    with pytest.raises(ValueError, match="unknown torch dtype"):
        name_buckets([TensorMeta(name="x", dtype="float99", shape=(1,))], 64)
