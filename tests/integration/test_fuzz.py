"""Hostile input: 10,000 malformed messages to each socket a run binds, while the run is going on.

Sockets that accept connections: the launcher's ROUTER (control) and the learner's PULL
(trajectories). Generators bind nothing (a DEALER and a PUSH, both connecting), so there is no
generator socket to attack. Every message must be rejected and counted exactly once, no process
may crash, and the run's results must be those of a clean run: every step trains its full window,
nothing lost, nothing invalid got through, nothing duplicated.

Determinism on a loaded machine: the generator is a plugin that holds back step 2's groups until
the test opens a FIFO gate (tests/support/gated_generator.py), so the fuzzing happens in the
middle of the run; the gate opens only once both processes have counted every message (the
launcher's `rejected` records on the run's record stream; the learner's log line at each
thousandth rejection, read on each write to the log). The learner's count is also in its metrics
record (`LearnerMetrics.rejected_frames`, the summary's `rejected_frames.learner`), but that
record goes out only when a step ends, and the step the learner waits for cannot end before the
gate opens: the log line is its only report in time. Every wait blocks on what happens (a line,
a record, a write), never on a sleep.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import random
from pathlib import Path

import msgspec
import pytest
import zmq

import asyncrl
from asyncrl.messages import (
    PROTOCOL_VERSION,
    Hello,
    PromptTask,
    SamplingParams,
    ShardsPublished,
    Shutdown,
    StepDone,
    TensorRef,
    Trajectories,
    Trajectory,
    WeightsLoaded,
)
from asyncrl.transport.codec import MAX_FRAMES, MAX_HEADER_BYTES, encode
from tests.conftest import read_records
from tests.support.gated_generator import gated_job_args
from tests.support.waiting import RunRecords, wait_for_log_text

pytestmark = pytest.mark.slow

NUM_MESSAGES = 10_000  # per socket; a multiple of 1000 so the receiver's log shows the last one
STEPS, GROUPS, SAMPLES = 5, 2, 2
GATED_STEP = 2  # groups of this step and later wait for the gate
WAIT_S = 300  # hang guard of each wait on the run


class _Canary:
    """Unpickling this creates a file: proof that someone unpickled bytes from the wire."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _trajectory(**refs: TensorRef) -> Trajectory:
    ok = TensorRef(frame=0, dtype="int64", shape=(2,))
    fields = {
        "completion_ids": ok,
        "behavior_logprobs": TensorRef(frame=1, dtype="float32", shape=(2,)),
        "token_versions": TensorRef(frame=2, dtype="int64", shape=(2,)),
        **refs,
    }
    return Trajectory(
        traj_id=10**9,
        group_id=10**8,
        task_id=10**8,
        sample_index=0,
        window=0,
        num_samples=2,
        prompt_ids=[1],
        reward=0.0,
        finish_reason="stop",
        generator_id="fuzz",
        **fields,
    )


def malformed_messages(rng: random.Random, *, wrong_types: list, canary: Path) -> list[list[bytes]]:
    """NUM_MESSAGES multipart messages none of which a receiver may accept, of every kind."""
    valid = encode(
        PromptTask(
            task_id=1,
            group_id=1,
            prompt_ids=[1, 2, 3, 4, 5, 6],
            num_samples=2,
            sampling=SamplingParams(),
            dataset_index=1,
            window=0,
            answer="7",
        )
    )[0]
    tensor = bytes(16)
    kinds = [
        lambda: [rng.randbytes(rng.randrange(0, 300))],  # garbage
        lambda: [valid[: rng.randrange(0, len(valid))]],  # truncated
        lambda: [valid + rng.randbytes(rng.randrange(1, 8))],  # trailing bytes
        lambda: [msgspec.msgpack.encode({"type": rng.choice(["Bogus", "", "hello"]), "x": 1})],  # unknown tag
        lambda: encode(
            Hello(role="generator", peer_id="fuzz", protocol_version=rng.randrange(PROTOCOL_VERSION + 1, 99))
        ),
        lambda: encode(rng.choice(wrong_types)),  # well-formed, wrong type for this socket
        lambda: [encode(_trajectory())[0], tensor, tensor],  # a tensor frame missing
        lambda: [encode(_trajectory())[0], tensor, tensor, tensor, tensor],  # one too many
        lambda: [encode(Trajectories(items=[_trajectory(), _trajectory()]))[0], tensor, tensor, tensor],
        # ^ a group whose second item's frames are missing
        lambda: (
            [encode(_trajectory(completion_ids=TensorRef(frame=0, dtype="object", shape=(2,))))[0]]
            + [tensor] * 3
        ),  # dtype not allowed
        lambda: (
            [encode(_trajectory(completion_ids=TensorRef(frame=0, dtype="int64", shape=(-2,))))[0]]
            + [tensor] * 3
        ),  # negative shape
        lambda: (
            [encode(_trajectory(completion_ids=TensorRef(frame=0, dtype="int64", shape=(3,))))[0]]
            + [tensor] * 3
        ),  # byte size does not match the shape
        lambda: [b"x"] * (MAX_FRAMES + 1),  # too many frames
        lambda: [pickle.dumps(_Canary(str(canary)))],  # a pickle that would create a file
    ]
    messages = [kinds[i % len(kinds)]() for i in range(NUM_MESSAGES - 2)]
    messages += [[b"\x00" * (MAX_HEADER_BYTES + 1)]] * 2  # oversized headers
    rng.shuffle(messages)
    return messages


def send_all(address: str, kind: int, messages: list[list[bytes]]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 10_000)  # flush everything before close returns
    sock.connect(address)
    for frames in messages:
        sock.send_multipart(frames)
    sock.close()
    ctx.term()


def worker_addresses(launcher_pid: int, learner_pid: int, run_dir: Path) -> dict[str, str]:
    """The launcher's control address (the port it listens on besides the monitor's, named in
    monitor.json) and the learner's trajectory address (the one port it listens on), found from
    the sockets themselves: workers forked from the fork server carry no addresses on their
    command lines, and generators learn the learner's only after it has started."""
    monitor = json.loads((run_dir / "monitor.json").read_text())["endpoint"]
    ctrl = [p for p in listening_ports(launcher_pid) if f"tcp://127.0.0.1:{p}" != monitor]
    (data,) = listening_ports(learner_pid)
    assert len(ctrl) == 1, ctrl
    return {"ctrl": f"tcp://127.0.0.1:{ctrl[0]}", "data": f"tcp://127.0.0.1:{data}"}


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on."""
    return [int(hex_port, 16) for _, hex_port in (a.split(":") for a in _listening([pid]))]


def listening_addresses(pids: list[int]) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* prints them) of TCP sockets the pids listen on."""
    return [a.split(":")[0] for a in _listening(pids)]


def _listening(pids: list[int]) -> list[str]:
    """`address:port` (hex) of the TCP sockets the pids listen on."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                found.append(fields[1])
    return found


LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


@pytest.mark.timeout(600)
def test_malformed_messages_on_every_socket_are_rejected_and_counted(
    tiny_model_dir, tmp_path, pid_alive, gate, launch_streamed
):
    canary = tmp_path / "unpickled"
    args, env = gated_job_args(
        tiny_model_dir,
        tmp_path,
        gate.path,
        first_held=GATED_STEP * GROUPS,
        steps=STEPS,
        groups=GROUPS,
        samples=SAMPLES,
        name="fuzz",
    )
    run_dir = tmp_path / "fuzz"
    lines = launch_streamed(args, env)
    lines.wait_for(r"^step 1/", timeout_s=WAIT_S, what="the first step")
    spawned = {m[1]: int(m[2]) for m in lines.matches(r"^started (\S+) \(pid (\d+)\)")}
    addresses = worker_addresses(lines.proc.pid, spawned["learner"], run_dir)
    pids = [lines.proc.pid, *spawned.values()]
    listening = listening_addresses(pids)
    assert len(listening) >= 2 and set(listening) <= LOOPBACK_HEX, listening

    rng = random.Random(0)
    to_launcher = malformed_messages(
        rng, wrong_types=[Shutdown(), _trajectory(), any_prompt_task()], canary=canary
    )
    to_learner = malformed_messages(
        rng,
        wrong_types=[
            Shutdown(),
            WeightsLoaded(generator_id="gen-0", version=1),
            ShardsPublished(version=1, root="/", num_bytes=0),
            any_step_done(),
        ],
        canary=canary,
    )
    with RunRecords(run_dir, lines) as records:
        send_all(addresses["ctrl"], zmq.DEALER, to_launcher)
        send_all(addresses["data"], zmq.PUSH, to_learner)
        records.wait_for(
            lambda r: any(x["num_rejected"] >= NUM_MESSAGES for x in r.of("rejected")),
            timeout_s=WAIT_S,
            what="the launcher to count every message",
        )
    wait_for_log_text(
        run_dir / "logs" / "learner.log",
        f"{NUM_MESSAGES} rejected so far",
        timeout_s=WAIT_S,
        lines=lines,
        what="the learner to count every message",
    )
    gate.open()
    code = lines.wait_exit(timeout_s=400)
    assert code == 0, lines.tail()
    assert not canary.exists(), "a pickle from the wire was unpickled"

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["rejected_frames"]["launcher"] == NUM_MESSAGES, summary["rejected_frames"]
    assert summary["rejected_frames"]["learner"] == NUM_MESSAGES, summary["rejected_frames"]
    assert summary["rejected_frames"]["launcher_by_reason"].get("unknown peer", 0) > 0
    # The run's results are a clean run's: full windows, nothing lost, invalid or duplicated.
    assert summary["trajectories_trained"] == STEPS * GROUPS * SAMPLES
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["duplicates"] == 0 and summary["generator_restarts"] == 0
    steps = read_records(run_dir, "step")
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert all(s["num_trajectories"] == GROUPS * SAMPLES for s in steps)
    learner_metrics = [r for r in read_records(run_dir, "metrics") if r["source"] == "learner"]
    assert learner_metrics and all(r["learner/invalid_trajectories"] == 0 for r in learner_metrics)
    assert all(r.get("gen/rejected_frames", 0) == 0 for r in read_records(run_dir, "metrics"))
    assert not [p for p in pids if pid_alive(p)]


def any_prompt_task() -> PromptTask:
    return PromptTask(
        task_id=0,
        group_id=0,
        prompt_ids=[1],
        num_samples=2,
        sampling=SamplingParams(),
        dataset_index=0,
        window=0,
        answer="0",
    )


def any_step_done() -> StepDone:
    return StepDone(
        step=0,
        version=1,
        num_trajectories=4,
        num_tokens=4,
        loss=0.0,
        mean_reward=0.0,
        max_staleness=0,
        mean_staleness=0.0,
        clip_fraction=0.0,
        grad_norm=0.0,
        step_s=0.0,
        idle_s=0.0,
    )


# Listeners that are not ZeroMQ sockets, and what guards them instead of CURVE.
NOT_ZMQ_BINDS = {
    # Probes a free port for a launched SGLang server, then closes it; the server itself binds
    # cluster.bind_host and checks generators.options.api_key.
    "generators/sglang/launch.py": "sglang api key",
    # The same-host weight ring's rendezvous: a Unix socket in the abstract namespace (no network),
    # admitting only our uid (SO_PEERCRED) with the secret sent over the broadcast group's pair.
    "transport/shm_ring.py": "unix socket, same uid and a secret",
}


def test_nothing_in_the_package_pickles_or_binds_beyond_loopback_without_curve():
    """Static guard: no pickle (nor pyzmq's pickling send/recv), no raw `bind`, and every `bind` /
    `bind_to_random_port` either on loopback (the `LOOPBACK` constant or a 127.0.0.1 literal) or in
    a function that first makes the socket a CURVE server when CURVE is on (`apply_server`). That
    binding beyond loopback implies CURVE on is `SocketPolicy`'s invariant (tests/unit/test_security.py)."""
    root = Path(asyncrl.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        tree = ast.parse(path.read_text(), filename=str(path))
        secured = _binds_after_apply_server(tree)
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "cPickle", "dill", "cloudpickle") for n in names):
                    offenders.append(f"{where} imports pickle")
            if isinstance(node, ast.Attribute) and node.attr in ("send_pyobj", "recv_pyobj"):
                offenders.append(f"{where} uses .{node.attr}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("bind", "bind_to_random_port")
                and node.args
                and not _is_loopback(node.args[0])
                and id(node) not in secured
                and rel not in NOT_ZMQ_BINDS
            ):
                offenders.append(f"{where} binds beyond loopback without CURVE (call apply_server first)")
    assert not offenders, offenders


def _binds_after_apply_server(tree: ast.AST) -> set[int]:
    """ids of the bind calls in functions that call `.apply_server(...)` on an earlier line."""
    secured: set[int] = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
        first = min((n.lineno for n in calls if n.func.attr == "apply_server"), default=None)
        if first is not None:
            secured |= {
                id(n) for n in calls if n.func.attr in ("bind", "bind_to_random_port") and n.lineno > first
            }
    return secured


def _is_loopback(arg: ast.expr | None) -> bool:
    """The `LOOPBACK` constant, a tcp://127.0.0.1 literal, or a ("127.0.0.1", port) tuple; or in
    process: an inproc:// literal (or f-string), the ZAP handler's `ZAP_ENDPOINT`."""
    if isinstance(arg, ast.Name):
        return arg.id in ("LOOPBACK", "ZAP_ENDPOINT")
    if isinstance(arg, ast.JoinedStr) and arg.values:
        arg = arg.values[0]
        return isinstance(arg, ast.Constant) and str(arg.value).startswith("inproc://")
    if isinstance(arg, ast.Tuple) and arg.elts:
        arg = arg.elts[0]
    return isinstance(arg, ast.Constant) and str(arg.value).removeprefix("tcp://").startswith(
        ("127.0.0.1", "localhost", "[::1]", "::1", "inproc://")
    )


def test_fuzz_messages_are_never_acceptable(tmp_path):
    """Self-check of the hostile messages: none decodes to a Trajectory (which the learner would
    train on instead of rejecting), and building them unpickles nothing."""
    from asyncrl.transport.codec import MalformedFrame, decode

    canary = tmp_path / "unpickled"
    messages = malformed_messages(random.Random(1), wrong_types=[Shutdown()], canary=canary)
    assert len(messages) == NUM_MESSAGES
    num_decoded = 0
    for frames in messages:
        try:
            msg, _ = decode(frames)
        except MalformedFrame:
            continue
        num_decoded += 1
        assert isinstance(msg, Hello | Shutdown), msg
    assert 0 < num_decoded < NUM_MESSAGES
    assert not canary.exists()
