"""Learner ranks at scale, launched for real: a 2-rank FSDP2 learner killed and resumed gives the
uninterrupted run's parameters bitwise (sync mode, whole-batch steps); its checkpoint loads on one
plain rank with the same parameters and optimizer state and trains on; ranks started by torchrun
join a launch and complete it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch
from conftest import read_records, short_job_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 5
GROUPS = 4
SETS = [
    'model.path=""',  # the shipped model earns rewards, so every step changes the weights
    "mode=sync",
    f"learner.steps={STEPS}",
    f"learner.groups_per_step={GROUPS}",
    "learner.samples_per_group=4",
    "sampling.max_new_tokens=5",
    "run.checkpoint_every=2",
    "run.seed=5",
    "learner.streaming=off",  # steps packed in trajectory-id order: sums independent of arrival
    "learner.world_size=2",
    "learner.sharding=fsdp",
]


def _params(model_dir):
    from safetensors.torch import load_file

    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def _run(*args, timeout=280):
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def _kill_learner_after_first_checkpoint(tiny_model_dir, tmp_path, sets=tuple(SETS)):
    run_dir = tmp_path / "crash"
    proc = subprocess.Popen(
        short_job_args(tiny_model_dir, tmp_path, *sets, name="crash"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # The launcher saves its checkpoint of version 2 before it reports step 3 (sync mode,
        # checkpoint_every = 2): read its output until then; steps 3 and 4 are still to come.
        for line in proc.stdout:
            if line.startswith("step 3/"):
                break
        assert (run_dir / "checkpoints" / "launcher-00000002.json").exists()
        learner_pid = next(r["pid"] for r in read_records(run_dir, "spawn") if r["role"] == "learner")
        os.kill(learner_pid, signal.SIGKILL)  # rank 0; its worker rank exits when it is gone
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out
    return run_dir


def test_two_rank_fsdp_resume_is_bitwise_and_loads_on_one_rank(tiny_model_dir, tmp_path):
    _run(*short_job_args(tiny_model_dir, tmp_path, *SETS, name="whole"))
    whole = _params(tmp_path / "whole" / "final_model")
    run_dir = _kill_learner_after_first_checkpoint(tiny_model_dir, tmp_path)
    one_rank_dir = tmp_path / "one-rank"
    shutil.copytree(run_dir, one_rank_dir)

    # Resumed on two ranks: the uninterrupted run's parameters, bit for bit.
    _run(sys.executable, "-m", "asyncrl", "launch", "--no-tui", "--resume", str(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == STEPS
    assert summary["resumed_from"] == 2 and summary["trajectories_lost"] == 0
    resumed = _params(run_dir / "final_model")
    assert resumed.keys() == whole.keys()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)

    # The 2-rank checkpoint on one plain rank: the same parameters and optimizer state at load.
    _check_loads_on_one_rank(one_rank_dir, version=2)
    _run(
        sys.executable, "-m", "asyncrl", "launch", "--no-tui", "--resume", str(one_rank_dir),
        "--set", "learner.world_size=1", "--set", "learner.sharding=none",
    )  # fmt: skip
    summary = json.loads((one_rank_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == STEPS
    assert summary["resumed_from"] == 2
    trained_on = _params(one_rank_dir / "final_model")
    # It trained on (steps 2 to 4 moved the weights) to about where two ranks got.
    assert any(not torch.equal(trained_on[k], _checkpoint_params(one_rank_dir, 2)[k]) for k in whole)
    for k in whole:
        # Float rounding of other reduction orders, grown by AdamW over 3 steps: close, not equal.
        torch.testing.assert_close(trained_on[k], whole[k], rtol=0, atol=1e-3)


def test_two_rank_ewma_copies_resume_as_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """The EWMA proxy's weight copies, FSDP2-sharded on 2 ranks, go into each rank's checkpoint
    (`copies-rank{r}.pt`) and come back on resume: killed after version 2 and resumed, the run
    ends with the uninterrupted run's parameters bit for bit. (Copies restarted from the resumed
    weights would give other corrections in steps 3 and 4.)"""
    sets = [*SETS, "staleness.policy=ewma"]
    _run(*short_job_args(tiny_model_dir, tmp_path, *sets, name="whole"))
    whole = _params(tmp_path / "whole" / "final_model")
    run_dir = _kill_learner_after_first_checkpoint(tiny_model_dir, tmp_path, sets)
    copies = sorted(p.name for p in (run_dir / "checkpoints").rglob("copies-rank*.pt"))
    assert copies and {"copies-rank0.pt", "copies-rank1.pt"} <= set(copies)
    _run(sys.executable, "-m", "asyncrl", "launch", "--no-tui", "--resume", str(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == 2
    resumed = _params(run_dir / "final_model")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def _checkpoint_params(run_dir, version):
    """The model of a DCP learner checkpoint, read as one full state dict (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir / f"full-{version}.pt"
    if not out.exists():
        dcp_to_torch_save(run_dir / "checkpoints" / f"learner-{version:08d}", out)
    state = torch.load(out, weights_only=True)
    return {k.removeprefix("lm."): v for k, v in state["model"].items()}


def _check_loads_on_one_rank(run_dir, version):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from asyncrl.config_load import load_resolved_config
    from asyncrl.learner.checkpoint import load_learner_checkpoint
    from asyncrl.learner.loop import build_trainer, load_policy_model
    from asyncrl.models.default import DEFAULT_MODEL_DIR

    saved_path = run_dir / f"full-{version}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"learner-{version:08d}", saved_path)
    saved = torch.load(saved_path, weights_only=True)
    config = load_resolved_config(run_dir / "config.json")
    config = type(config)(**{**{f: getattr(config, f) for f in config.__struct_fields__}})
    from asyncrl.config_load import config_from_tree, config_to_dict

    config = config_from_tree(config_to_dict(config), ["learner.world_size=1", "learner.sharding=none"])
    actor, tokenizer = load_policy_model(DEFAULT_MODEL_DIR, config)
    trainer = build_trainer(config, actor, pad_token_id=tokenizer.pad_token_id)
    load_learner_checkpoint(run_dir, version, trainer)
    params = dict(trainer.actor.named_parameters())
    assert params and all(torch.equal(params[k], saved["model"][k]) for k in params)
    state = trainer.optimizer.state_dict()["state"]
    names = [n for n, p in trainer.actor.named_parameters() if p.requires_grad]
    assert len(state) == len(names)  # Adam moments for every parameter
    for i, name in enumerate(names):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[i][moment], saved["optim"]["state"][name][moment]), (name, moment)


def _torchrun_nodes(nodes: int, run_dir) -> list[subprocess.Popen]:
    """The learner's 2 ranks by torchrun: one node with 2 processes (`--standalone`), or 2 nodes
    with one each, meeting at node 0's address (static rendezvous, as on two hosts)."""
    module = ["-m", "asyncrl.learner.torchrun", str(run_dir)]
    if nodes == 1:
        cmds = [["--standalone", "--nproc-per-node", "2", *module]]
    else:
        with socket.socket() as s:  # a free port for the rendezvous (closed before torchrun binds it)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rendezvous = [
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        ]
        cmds = [[*rendezvous, "--node-rank", str(k), *module] for k in range(2)]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for cmd in cmds
    ]


@pytest.mark.parametrize("nodes", [1, 2])
def test_torchrun_ranks_join_a_launch(tiny_model_dir, tmp_path, nodes):
    sets = [
        "learner.world_size=2",
        "learner.sharding=fsdp",
        "learner.start=torchrun",
        "learner.steps=3",
        "learner.startup_timeout_s=240",
    ]
    # torchrun first, the launcher after: the ranks wait for its join file.
    ranks = _torchrun_nodes(nodes, tmp_path / "tr")
    launcher = subprocess.Popen(
        short_job_args(tiny_model_dir, tmp_path, *sets, name="tr"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = launcher.communicate(timeout=300)
        ranks_out = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for proc in (launcher, *ranks):
            if proc.poll() is None:
                proc.kill()
    assert launcher.returncode == 0, out
    assert all(rank.returncode == 0 for rank in ranks), ranks_out
    assert "torchrun --nproc-per-node 2 -m asyncrl.learner.torchrun" in out  # what to start, said
    summary = json.loads((tmp_path / "tr" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == 3
    assert summary["trajectories_trained"] == 3 * 2 * 4 and summary["trajectories_lost"] == 0


def test_torchrun_with_the_wrong_number_of_ranks_says_so(tiny_model_dir, tmp_path):
    from asyncrl.config_load import load_config, write_resolved_config

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    config = load_config(None, ["learner.world_size=2", "learner.start=torchrun"])
    write_resolved_config(config, run_dir / "config.json")
    (run_dir / "learner_join.json").write_text(
        json.dumps({"ctrl": "tcp://127.0.0.1:1", "peer_id": "learner", "args": {}})
    )
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.learner.torchrun", str(run_dir)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode != 0
    assert "torchrun started 3 ranks" in out.stderr and "Traceback" not in out.stderr
