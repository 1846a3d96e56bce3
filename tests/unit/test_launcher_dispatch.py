"""The launcher's side of the task protocol without processes: a dispatch sends each generator
its tasks in one PromptTasks message, each TaskDone of a TasksDone is handled on its own, and
workers start through the spawner with the module of their role."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.config import Config
from asyncrl.config_load import load_config
from asyncrl.job import load_task
from asyncrl.messages import PromptTasks, TaskDone, TasksDone, WorkerArgs
from asyncrl.models.default import DEFAULT_MODEL_DIR
from asyncrl.scheduler.children import Child
from asyncrl.scheduler.service import Launcher


class NoProcess:
    """A worker handle for a generator that exists only in the test."""

    pid = 0
    log_path = Path("log")

    def exit_code(self) -> None:
        return None


class FakeCtrl:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []
        self.rejected: list[str] = []

    async def send(self, msg, *, to: bytes) -> None:
        self.sent.append((to, msg))

    def reject(self, reason: str) -> None:
        self.rejected.append(reason)


class Quiet:
    def update(self, state) -> None:
        pass

    def event(self, text: str) -> None:
        pass


def make_launcher(config: Config, tmp_path: Path, **kwargs) -> Launcher:
    """A launcher with the run's task prepared once, as `asyncrl.job.run_job` hands it over."""
    task, tokenizer, _ = load_task(config, DEFAULT_MODEL_DIR)
    return Launcher(config, tmp_path, DEFAULT_MODEL_DIR, Quiet(), task=task, tokenizer=tokenizer, **kwargs)


def serving_launcher(tmp_path: Path, num_generators: int) -> Launcher:
    config = load_config(
        overrides=[
            f"generators.num_generators={num_generators}",
            "learner.groups_per_step=4",
            "staleness.max_staleness=1",
            "task.num_eval=0",
        ]
    )
    launcher = make_launcher(config, tmp_path)
    launcher.state.phase = "training"
    for slot in launcher.generator_ids:
        inc = launcher.pool.start(slot)
        launcher.children[inc.peer_id] = Child(inc.peer_id, "generator", NoProcess(), ready=True)
        launcher.pool.on_hello(inc.peer_id, latest_version=0)
        launcher.pool.on_loaded(inc.peer_id, 0)
    return launcher


def test_a_dispatch_sends_each_generator_one_prompt_tasks(tmp_path):
    launcher = serving_launcher(tmp_path, 2)
    ctrl = FakeCtrl()
    asyncio.run(launcher.dispatch(ctrl))
    # Staleness bound 1 at version 0: steps 0 and 1 are admitted, 8 groups.
    assert len(ctrl.sent) == 2 and all(isinstance(m, PromptTasks) for _, m in ctrl.sent)
    by_peer = {to.decode(): [t.task_id for t in m.tasks] for to, m in ctrl.sent}
    assert by_peer == {"gen-0": [0, 2, 4, 6], "gen-1": [1, 3, 5, 7]}  # fewest outstanding first
    for peer, ids in by_peer.items():
        assert launcher.dispatcher.outstanding[peer] == len(ids)
        assert all(launcher.book.ledger.is_in_flight(t, peer) for t in ids)


def test_requeued_tasks_go_first_in_the_same_message(tmp_path):
    launcher = serving_launcher(tmp_path, 1)
    ctrl = FakeCtrl()
    launcher.dispatcher.admit([2], loaded_version=0)  # admitted earlier, re-queued when its generator died
    launcher.book.requeued.append(2)
    launcher.mode.admission.num_admitted = 4  # groups 0-3 were admitted before; 4-7 are new now
    asyncio.run(launcher.dispatch(ctrl))
    ((_, sent),) = ctrl.sent
    assert isinstance(sent, PromptTasks) and [t.task_id for t in sent.tasks] == [2, 4, 5, 6, 7]


def test_tasks_done_handles_each_item_and_rejects_a_bad_one_alone(tmp_path):
    launcher = serving_launcher(tmp_path, 1)
    ctrl = FakeCtrl()
    asyncio.run(launcher.dispatch(ctrl))
    peer, child = next(iter(launcher.children.items()))
    ((_, sent),) = ctrl.sent

    def done(task_id: int) -> TaskDone:
        return TaskDone(
            task_id=task_id,
            generator_id=peer,
            num_trajectories=8,
            num_tokens=40,
            generate_s=0.1,
            mean_reward=0.5,
        )

    # Task 99 was never admitted: rejected, and tasks 0 and 1 on either side of it still count.
    asyncio.run(launcher.handle(ctrl, child, TasksDone(items=[done(0), done(99), done(1)])))
    assert len(ctrl.rejected) == 1 and "99" in ctrl.rejected[0]
    assert launcher.state.trajectories_generated == 16
    assert launcher.dispatcher.outstanding[peer] == len(sent.tasks) - 2
    assert 0 not in launcher.book.open and 1 not in launcher.book.open and 2 in launcher.book.open


class RecordingSpawner:
    """A spawner that starts nothing and remembers what it was asked to run."""

    def __init__(self) -> None:
        self.started: list[tuple[str, str]] = []

    def start(self, peer_id: str, module: str, *, ctrl_address: str, args) -> NoProcess:
        self.started.append((peer_id, module))
        return NoProcess()


def test_each_role_runs_its_module_through_the_spawner(tmp_path):
    config = load_config(overrides=["task.num_eval=0"])
    spawner = RecordingSpawner()
    launcher = make_launcher(config, tmp_path, spawner=spawner, role_modules={"learner": "bench.my_learner"})
    launcher.workers.spawn("learner", "learner", ctrl_address="tcp://127.0.0.1:1", args=WorkerArgs())
    launcher.spawn_generator(launcher.pool.start("gen-0"))
    assert spawner.started == [("learner", "bench.my_learner"), ("gen-0", "asyncrl.generators.service")]
    assert launcher.children["gen-0"].slot == "gen-0"
    with pytest.raises(ValueError, match="unknown role"):
        make_launcher(config, tmp_path, role_modules={"critic": "x"})
