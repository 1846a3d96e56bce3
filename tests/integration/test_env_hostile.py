"""Hostile environments in real launches (issue #35, acceptance 4).

`tests.support.env_envs:hostile` misbehaves per episode: a step that raises, one that allocates
past its worker's memory limit, one that writes outside its directory, one that opens a network
connection, one that answers malformed, one that never ends (a runaway only a budget stops), one
that hangs, one that kills its worker, and well-behaved ones. In jailed worker processes (env.workers = 2) every one is
counted and contained: the run completes with 0 lost and 0 duplicated, nothing reached the probe
directory or the probe port, the turn budget ended the runaways, and hung workers were killed and
replaced. Hangs and deaths get their own launch: they take their worker's other episodes down
with them (`worker_lost`), which would make the other kinds' counts depend on scheduling.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import uvloop

from asyncrl.config_sections import EnvConfig
from asyncrl.environments.base import Action, EnvironmentContext, EpisodeStart
from asyncrl.environments.host import EnvFailure
from asyncrl.environments.pool import ProcessPoolHost
from tests.integration.test_env_calculator import env_counters

EPISODES = 3 * 2 * 4  # steps x groups x samples of the short job


def launch(run_short_job, tmp_path, kinds: str, name: str, *extra: str):
    probe_dir = tmp_path / f"probe-{name}"
    probe_dir.mkdir()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    _, run_dir = run_short_job(
        'env.kind="tests.support.env_envs:hostile"',
        "env.workers=2",
        "env.step_timeout_s=2",
        'env.on_failure="fail"',
        "env.max_turns=3",
        f'env.options.kinds="{kinds}"',
        f'env.options.probe_dir="{probe_dir}"',
        f"env.options.probe_port={listener.getsockname()[1]}",
        "env.sandbox.memory_mb=1024",
        *extra,
        timeout=240,
        name=name,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == 3
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["generator_restarts"] == 0, summary  # an environment's failure is not the generator's
    assert summary["trajectories_generated"] == summary["trajectories_trained"] == EPISODES
    assert list(probe_dir.iterdir()) == []  # nothing escaped the jail
    with pytest.raises(BlockingIOError):  # no connection came out
        listener.accept()
    listener.close()
    assert list((run_dir / "logs").glob("env-gen-0-*.log"))
    c = env_counters(run_dir)
    assert c["env/episodes"] == EPISODES and c["env/jail_landlock_abi"] >= 1
    return c


@pytest.mark.slow
def test_hostile_environments_are_counted_and_contained(run_short_job, tmp_path):
    kinds = "raise,allocate,write_outside,network,malformed,runaway,behave"
    c = launch(run_short_job, tmp_path, kinds, "hostile")
    assert c["env/errors_RuntimeError"] >= 3  # raised
    assert c["env/errors_MemoryError"] >= 3  # allocated past env.sandbox.memory_mb
    assert c["env/errors_PermissionError"] >= 6  # wrote outside its directory; connected
    assert c["env/failures_bad_observation"] >= 3  # malformed
    assert c["env/budget_turns"] >= 3  # the runaways
    assert c["env/failed"] >= 15  # the five failing kinds, three times each at least
    assert c.get("env/worker_deaths", 0) == 0 and c.get("env/workers_killed", 0) == 0


@pytest.mark.slow
def test_hung_and_dying_environments_are_killed_and_replaced(run_short_job, tmp_path):
    # One step's groups at a time: later episodes open after the kills, on replacement workers.
    c = launch(run_short_job, tmp_path, "hang,die,behave", "hang", "staleness.max_staleness=0")
    assert c["env/failures_timeout"] >= 1 and c["env/workers_killed"] >= 1
    assert c["env/worker_deaths"] >= 1 and c["env/failures_worker_lost"] >= 1
    assert c["env/workers_started"] > 2  # replacements took the killed workers' place
    assert c["env/failed"] >= EPISODES // 2  # each hang, and what shared its worker


def test_a_worker_dead_before_its_reader_knows_fails_calls_and_closes_quietly(tmp_path):
    """The generator's event loop (uvloop) refuses writes to a dead worker's closed pipe: closing
    an episode there is quiet, a step is `worker_lost`, and the worker is counted once."""
    env = EnvConfig(kind="tests.support.env_envs:digits", workers=1, step_timeout_s=30)
    host = ProcessPoolHost(env, EnvironmentContext(), run_dir=str(tmp_path), name="g")

    async def main() -> EnvFailure:
        try:
            first, _ = await host.open(EpisodeStart(prompt="p", answer="1"))
            second, _ = await host.open(EpisodeStart(prompt="p", answer="1"))
            (worker,) = host.workers.values()
            worker.reader.cancel()  # the reader has not seen the exit yet
            os.killpg(worker.proc.pid, 9)
            await worker.proc.wait()
            await host.close_episode(first)
            with pytest.raises(EnvFailure) as failure:
                await host.step(second, Action(ids=[1], text="1", finish_reason="stop", turn=0))
            return failure.value
        finally:
            await host.aclose()

    failure = uvloop.run(main())
    assert failure.kind == "worker_lost"
    assert host.counts["worker_deaths"] == 1 and host.workers == {}
