"""The launcher: spawns and supervises the learner and generator processes, owns the prompt
stream and admission, routes control messages, aggregates metrics, and ends the run cleanly.

Sockets: one ROUTER bound on loopback; every child connects a DEALER with its peer id as the
ZeroMQ identity. Flow:
  learner Hello(endpoint) -> spawn generators -> generator Hellos -> admit + dispatch PromptTasks
  WeightsPublished (learner) -> every generator;  WeightsLoaded (generator) -> learner, admission
  StepDone (learner) -> metrics, reporter; the last one ends the run.
Shutdown: on completion, Ctrl-C, or any child failing, every child gets Shutdown, then SIGTERM,
then SIGKILL after a grace period; only processes this launcher started are signalled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
import zmq
import zmq.asyncio

from asyncrl.config import Config
from asyncrl.messages import (
    Fatal,
    Heartbeat,
    Hello,
    Metrics,
    PromptTask,
    SamplingParams,
    Shutdown,
    StepDone,
    TaskDone,
    WeightsLoaded,
    WeightsPublished,
)
from asyncrl.scheduler.admission import Admission, step_of
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
POLL_S = 0.2


class RunFailed(RuntimeError):
    """A child process failed; the message says which and why."""


class Reporter(Protocol):
    def update(self, state: RunState) -> None: ...
    def event(self, text: str) -> None: ...


@dataclass
class RunState:
    """Everything the live view and the summary need; updated by the launcher only."""

    total_steps: int
    max_staleness_bound: int
    started: float = field(default_factory=time.perf_counter)
    step: int = 0
    policy_version: int = 0
    trajectories_generated: int = 0
    trajectories_trained: int = 0
    tokens_generated: int = 0
    groups_admitted: int = 0
    groups_in_flight: int = 0
    max_staleness: int = 0
    last_reward: float = 0.0
    last_loss: float = 0.0
    last_clip_fraction: float = 0.0
    rewards: list[float] = field(default_factory=list)
    loaded_versions: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    phase: str = "starting"

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started


@dataclass
class Child:
    peer_id: str
    role: str
    proc: subprocess.Popen
    log_path: Path
    ready: bool = False
    outstanding: int = 0
    stopping: bool = False
    last_seen: float = field(default_factory=time.monotonic)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Launcher:
    def __init__(self, config: Config, run_dir: Path, model_path: Path, reporter: Reporter) -> None:
        from asyncrl.tasks.arithmetic import AdditionTask

        self.cfg = config
        self.run_dir = run_dir
        self.model_path = model_path
        self.reporter = reporter
        self.state = RunState(
            total_steps=config.learner.steps, max_staleness_bound=config.effective_max_staleness
        )
        self.task = AdditionTask(
            seed=config.task.seed,
            eval_seed=config.task.eval_seed,
            num_eval=config.task.num_eval,
            max_operand=config.task.max_operand,
        )
        self.admission = Admission(
            groups_per_step=config.learner.groups_per_step,
            max_staleness=config.effective_max_staleness,
            total_steps=config.learner.steps,
        )
        self.children: dict[str, Child] = {}
        self.generator_ids = [f"gen-{i}" for i in range(config.generators.num_generators)]
        self.learner_endpoint = ""
        self.finished = asyncio.Event()
        self.failure: str | None = None
        self.interrupted = False
        self.metrics_file = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in run()
        self.task_started: dict[int, float] = {}
        self._tokenizer = None

    # ------------------------------------------------------------------ processes
    def spawn(self, peer_id: str, role: str, module: str, ctrl_address: str, extra: dict[str, str]) -> Child:
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        log_path = logs / f"{peer_id}.log"
        cmd = [
            sys.executable,
            "-m",
            module,
            "--ctrl",
            ctrl_address,
            "--peer-id",
            peer_id,
            "--run-dir",
            str(self.run_dir),
        ]
        for k, v in extra.items():
            cmd += ["--extra", f"{k}={v}"]
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        child = Child(peer_id, role, proc, log_path)
        self.children[peer_id] = child
        self.event(f"started {peer_id} (pid {proc.pid})")
        return child

    async def supervise(self) -> None:
        """Any child that exits, or falls silent, before the run is over fails the run."""
        timeout_s = self.cfg.monitor.heartbeat_timeout_s
        while not self.finished.is_set():
            for child in self.children.values():
                code = child.proc.poll()
                if code is not None and not child.stopping:
                    self.fail(
                        f"{child.role} {child.peer_id} (pid {child.proc.pid}) exited with code {code}.\n"
                        f"Last lines of {child.log_path}:\n{child.tail()}"
                    )
                    return
                silent_s = time.monotonic() - child.last_seen
                if child.ready and silent_s > timeout_s:
                    self.fail(
                        f"{child.role} {child.peer_id} (pid {child.proc.pid}) sent nothing for {silent_s:.0f} s "
                        f"(monitor.heartbeat_timeout_s = {timeout_s:g}): it is hung; see {child.log_path}"
                    )
                    return
            await asyncio.sleep(POLL_S)  # polling child exit status; no message to wait for

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        self.finished.set()

    async def stop_children(self, ctrl: Endpoint) -> None:
        for child in self.children.values():
            child.stopping = True
            if child.proc.poll() is None:
                reason = "run finished" if self.failure is None else "run failed"
                await self.send_to(ctrl, child.peer_id, Shutdown(reason=reason))
        deadline = time.monotonic() + STOP_GRACE_S
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            alive = [c for c in self.children.values() if c.proc.poll() is None]
            if not alive:
                return
            if sig is not None:
                for c in alive:
                    c.proc.send_signal(sig)
                deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in alive):
                await asyncio.sleep(0.05)  # waiting for exit codes

    # ------------------------------------------------------------------ messages
    async def send_to(self, ctrl: Endpoint, peer_id: str, msg) -> bool:
        """Send to one child. A child that is gone (or never connected) is not an error here:
        supervision sees its exit and decides; the message is logged as undeliverable."""
        try:
            await ctrl.send(msg, to=peer_id.encode())
            return True
        except zmq.ZMQError as exc:
            log.warning("could not deliver %s to %s: %s", type(msg).__name__, peer_id, exc)
            return False

    def event(self, text: str) -> None:
        log.info(text)
        self.reporter.event(text)

    def write_record(self, kind: str, payload: dict) -> None:
        record = {**payload, "type": kind, "time_s": round(self.state.elapsed_s, 4)}
        self.metrics_file.write(json.dumps(record) + "\n")

    def min_loaded_version(self) -> int:
        return min(self.state.loaded_versions.get(g, 0) for g in self.generator_ids)

    async def dispatch(self, ctrl: Endpoint) -> None:
        s = self.cfg.sampling
        sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)
        for j in self.admission.admit(self.min_loaded_version()):
            problem = self.task.train_problem(j)
            gen = min((self.children[g] for g in self.generator_ids), key=lambda c: c.outstanding)
            task = PromptTask(
                task_id=j,
                group_id=j,
                prompt_ids=self._tokenizer(problem.prompt)["input_ids"],
                num_samples=self.cfg.learner.samples_per_group,
                sampling=sampling,
                dataset_index=j,
                step=step_of(j, groups_per_step=self.cfg.learner.groups_per_step),
                answer=problem.answer,
            )
            gen.outstanding += 1
            self.state.groups_admitted += 1
            self.state.groups_in_flight += 1
            self.task_started[j] = time.perf_counter()
            await self.send_to(ctrl, gen.peer_id, task)

    async def on_message(self, ctrl: Endpoint, sender: bytes, msg) -> None:
        peer = sender.decode(errors="replace")
        child = self.children.get(peer)
        if child is None:
            log.error("message from unknown peer %r dropped", peer)
            return
        child.last_seen = time.monotonic()
        match msg:
            case Hello():
                child.ready = True
                if child.role == "learner":
                    self.learner_endpoint = msg.endpoint
            case TaskDone():
                child.outstanding -= 1
                self.state.groups_in_flight -= 1
                self.state.trajectories_generated += msg.num_trajectories
                self.state.tokens_generated += msg.num_tokens
                self.write_record("task", msgspec.to_builtins(msg))
            case WeightsPublished():
                self.write_record("publish", msgspec.to_builtins(msg))
                for g in self.generator_ids:
                    await self.send_to(ctrl, g, msg)
            case WeightsLoaded():
                self.state.loaded_versions[msg.generator_id] = msg.version
                self.write_record("loaded", msgspec.to_builtins(msg))
                await self.send_to(ctrl, "learner", msg)
                await self.dispatch(ctrl)
            case StepDone():
                self.on_step(msg)
            case Metrics():
                self.state.metrics.update(msg.values)
                self.write_record("metrics", {"source": msg.source, **msg.values})
            case Heartbeat():
                pass
            case Fatal():
                # The traceback is in the child's log; the user gets the reason and where to look.
                self.fail(f"{child.role} {msg.peer_id} failed: {msg.error} (details: {child.log_path})")
            case _:
                log.error("unexpected %s from %s dropped", type(msg).__name__, peer)
        self.reporter.update(self.state)

    def on_step(self, msg: StepDone) -> None:
        st = self.state
        st.step = msg.step + 1
        st.policy_version = msg.version
        st.trajectories_trained += msg.num_trajectories
        st.max_staleness = max(st.max_staleness, msg.max_staleness)
        st.last_reward = msg.mean_reward
        st.last_loss = msg.loss
        st.last_clip_fraction = msg.clip_fraction
        st.rewards.append(msg.mean_reward)
        record = msgspec.to_builtins(msg)
        record["samples_per_s"] = st.trajectories_trained / max(1e-9, st.elapsed_s)
        self.write_record("step", record)
        if msg.step + 1 >= self.cfg.learner.steps:
            self.finished.set()

    # ------------------------------------------------------------------ main
    async def wait_ready(self, peers: list[str], recv) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(self.children[p].ready for p in peers):
            if self.finished.is_set():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                slow = [p for p in peers if not self.children[p].ready]
                self.fail(
                    f"{', '.join(slow)} did not say Hello within {STARTUP_TIMEOUT_S:.0f} s; see {self.run_dir / 'logs'}"
                )
                return
            await recv(remaining)

    async def run(self) -> RunState:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.interrupt)
        zctx = zmq.asyncio.Context()
        ctrl = Endpoint(zctx, zmq.ROUTER, name="launcher.ctrl")
        address = ctrl.bind_loopback()
        inbox: asyncio.Queue = asyncio.Queue()

        async def receive() -> None:
            while True:
                inbox.put_nowait(await ctrl.recv())

        async def recv_one(timeout_s: float) -> None:
            getter = asyncio.ensure_future(inbox.get())
            stop = asyncio.ensure_future(self.finished.wait())
            done, _ = await asyncio.wait(
                {getter, stop}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            stop.cancel()
            if getter in done:
                sender, msg, _ = getter.result()
                await self.on_message(ctrl, sender, msg)
            else:
                getter.cancel()

        receiver = asyncio.create_task(receive(), name="launcher-recv")
        supervisor = asyncio.create_task(self.supervise(), name="launcher-supervise")
        try:
            self.state.phase = "starting learner"
            self.reporter.update(self.state)
            common = {"model": str(self.model_path)}
            self.spawn(
                "learner",
                "learner",
                "asyncrl.learner.service",
                address,
                {**common, "generators": ",".join(self.generator_ids)},
            )
            await self.wait_ready(["learner"], recv_one)
            if not self.finished.is_set():
                self.state.phase = "starting generators"
                self.reporter.update(self.state)
                for i, g in enumerate(self.generator_ids):
                    self.spawn(
                        g,
                        "generator",
                        "asyncrl.generators.service",
                        address,
                        {**common, "data": self.learner_endpoint, "index": str(i)},
                    )
                await self.wait_ready(self.generator_ids, recv_one)
            if not self.finished.is_set():
                self.state.phase = "training"
                self.state.started = time.perf_counter()
                await self.dispatch(ctrl)
                while not self.finished.is_set():
                    await recv_one(1.0)
            self.state.phase = "stopping"
            self.reporter.update(self.state)
        finally:
            self.finished.set()
            await self.stop_children(ctrl)
            receiver.cancel()
            supervisor.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            ctrl.close()
            zctx.term()
            self.metrics_file.close()
        if self.failure is not None:
            raise RunFailed(self.failure)
        return self.state

    def interrupt(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            self.event("interrupted: stopping every process")
        self.finished.set()
