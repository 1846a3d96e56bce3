"""The workers one launcher started: start them through the spawner, retire one, stop them all.

Place in the data flow: the launcher (`scheduler/service.py`) decides when (a run starts, a
generator is found dead or hung by `children.health`, the run ends); this module does it, through
the `Spawner` and its `WorkerHandle`s (`scheduler/spawner.py`), and records each start as a
`spawn` record (the tests and tools that look for a worker's pid read it there).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from asyncrl.messages import WorkerArgs
from asyncrl.scheduler.children import Child, stop_all
from asyncrl.scheduler.records import Records
from asyncrl.scheduler.spawner import Spawner

# How long workers told to shut down get before they are terminated.
STOP_GRACE_S = 10.0
# The module each role runs (`python -m`); a launcher's `role_modules` replaces any of them.
# "teacher": the OPD teacher every generator shares (opd.placement = "service", `TEACHER_PEER`).
DEFAULT_ROLE_MODULES = {
    "learner": "asyncrl.learner.service",
    "generator": "asyncrl.generators.service",
    "teacher": "asyncrl.generators.teacher_service",
}
TEACHER_PEER = "opd-teacher"
# Roles told to stop only once every other worker has gone: generators finishing their last
# samples still ask the shared teacher for scores.
STOPPED_LAST = frozenset({"teacher"})


class Workers:
    def __init__(self, spawner: Spawner, role_modules: Mapping[str, str] | None, records: Records) -> None:
        unknown = sorted(set(role_modules or {}) - set(DEFAULT_ROLE_MODULES))
        if unknown:
            raise ValueError(
                f"role_modules: unknown role {unknown}; roles: {', '.join(DEFAULT_ROLE_MODULES)}"
            )
        self.spawner = spawner
        self.role_modules = {**DEFAULT_ROLE_MODULES, **(role_modules or {})}
        self.records = records
        self.children: dict[str, Child] = {}  # peer id -> a worker not (yet) retired
        self.retired: list[Child] = []  # generator workers that died and were replaced

    def spawn(self, peer_id: str, role: str, *, ctrl_address: str, args: WorkerArgs) -> Child:
        """Start the module of `role` as the worker `peer_id`."""
        handle = self.spawner.start(peer_id, self.role_modules[role], ctrl_address=ctrl_address, args=args)
        child = Child(peer_id, role, handle)
        self.children[peer_id] = child
        if getattr(handle, "remote", False):  # scheduler/remote.py: a worker on another host serves it
            self.records.event(f"{peer_id} waits for a worker to join: asyncrl worker --join {ctrl_address}")
        else:
            self.records.event(f"started {peer_id} (pid {handle.pid})")
        self.records.write("spawn", {"peer_id": peer_id, "role": role, "pid": handle.pid})
        return child

    async def retire(self, child: Child) -> None:
        """Forget `child` at once (its messages are stale from now on), then kill it (a no-op once
        it has exited: hung, or stuck after Fatal) and wait until it is gone."""
        del self.children[child.peer_id]
        child.stopping = True
        self.retired.append(child)
        child.handle.kill()
        await child.handle.wait()

    async def stop(self, shutdown: Callable[[Child], Awaitable[object]]) -> None:
        """`shutdown` every running worker (send it Shutdown), then terminate, then kill; the
        roles in `STOPPED_LAST` once the others have gone."""
        for child in self.children.values():
            child.stopping = True  # supervision leaves them all alone from here on
        for last in (False, True):
            group = [c for c in self.children.values() if (c.role in STOPPED_LAST) == last]
            for child in group:
                if child.handle.exit_code() is None:
                    await shutdown(child)
                    if getattr(child.handle, "remote", False):
                        child.handle.terminate()  # on another host: told to stop, nothing here to wait for
            await stop_all(group, grace_s=STOP_GRACE_S)
