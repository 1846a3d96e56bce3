"""Stateful property tests: the buffer and the ledger against small reference models.

Each model is a direct, O(n)-scan restatement of the documented semantics; hypothesis drives
random operation sequences and the invariants compare the structure with its model after every
step: size and token accounting, hand-out order and contents, eviction/withhold/release counts by
reason, and "every item put is exactly one of {in buffer, handed out, evicted}". For the ledger:
no transition out of a terminal state (illegal events raise and change nothing), lost/pending and
duplicate counts as defined, and byte-exact checkpoint round-trips.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from asyncrl.buffer.ledger import Arrival, Ledger
from asyncrl.buffer.store import (
    BOUND_REASONS,
    EVICTION_REASONS,
    MIN_FRESHNESS,
    Buffer,
    BufferFull,
    BufferItem,
)

SETTINGS = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

FRESHNESS = st.sampled_from([0.1, 0.25, 0.5, 0.75, 1.0])  # few values, so ties happen

# ================================================================================ buffer model


class _MGroup:
    def __init__(self, num_samples, step):
        self.num_samples, self.step = num_samples, step
        self.members = []  # [traj_id, num_tokens, freshness, min_version]
        self.where, self.reuse, self.seq = "pending", 0, -1

    @property
    def tokens(self):
        return sum(m[1] for m in self.members)

    @property
    def freshness(self):
        return min(m[2] for m in self.members)

    @property
    def min_version(self):
        return min(m[3] for m in self.members)


class BufferMachine(RuleBasedStateMachine):
    @initialize(
        order=st.sampled_from(["fifo", "freshest", "windowed"]),
        action=st.sampled_from(["withhold", "downweight", "drop"]),
        max_staleness=st.none() | st.integers(0, 3),
        floor=st.sampled_from([0.0, 0.2, 0.5]),
        window=st.integers(0, 2),
        max_replays=st.integers(0, 2),
        decay=st.sampled_from([1.0, 0.5, 0.9]),
        max_items=st.none() | st.integers(3, 20),
        max_tokens=st.none() | st.integers(40, 200),
    )
    def setup(self, order, action, max_staleness, floor, window, max_replays, decay, max_items, max_tokens):
        self.cfg = dict(order=order, action=action, max_replays=max_replays, replay_decay=decay)
        self.bounds = dict(max_staleness=max_staleness, freshness_floor=floor, window=window)
        self.cap = (max_items, max_tokens)
        self.buf = Buffer(
            **self.cfg, **self.bounds, max_items=max_items, max_tokens=max_tokens, downweight=0.5
        )
        self.version = 0
        self.groups: dict[int, _MGroup] = {}
        self.fate: dict[int, str] = {}  # traj_id -> "in" | "out" | "evicted"
        self.evicted = dict.fromkeys(EVICTION_REASONS, 0)
        self.downweighted = dict.fromkeys(BOUND_REASONS, 0)
        self.replays = self.handed_out = self.released = self.num_put = 0
        self.next_traj = self.next_group = self.next_seq = 0

    # ---------------------------------------------------------------- model semantics

    def violation(self, g):
        b = self.bounds
        if b["max_staleness"] is not None and self.version - g.min_version > b["max_staleness"]:
            return "staleness"
        if g.freshness < b["freshness_floor"]:
            return "freshness"
        if self.cfg["order"] == "windowed" and g.step < self.version - b["window"]:
            return "window"
        return None

    def drop(self, gid, reason):
        g = self.groups.pop(gid)
        self.evicted[reason] += len(g.members)
        for m in g.members:
            assert self.fate[m[0]] == "in"
            self.fate[m[0]] = "evicted"

    def place(self, gid):
        g = self.groups[gid]
        reason = None if self.cfg["action"] == "downweight" else self.violation(g)
        if reason is None:
            g.where = "ready"
        elif self.cfg["action"] == "drop":
            self.drop(gid, reason)
        else:
            g.where = "withheld"

    def enforce(self):
        if self.cfg["action"] == "downweight":
            return
        for gid in [gid for gid, g in self.groups.items() if g.where == "ready" and self.violation(g)]:
            self.place(gid)
        for g in self.groups.values():
            if g.where == "withheld" and self.violation(g) is None:
                g.where = "ready"
                self.released += len(g.members)

    def policy_key(self, g):
        if self.cfg["order"] == "fifo":
            return g.seq
        if self.cfg["order"] == "freshest":
            return (-g.freshness, g.seq)
        return (g.step, g.seq)

    def held(self, where=None):
        return [g for g in self.groups.values() if where is None or g.where == where]

    def fits(self, tokens, *, reclaimable):
        items = sum(len(g.members) for g in self.held()) + 1
        toks = sum(g.tokens for g in self.held()) + tokens
        if reclaimable:
            items -= sum(len(g.members) for g in self.held("withheld"))
            toks -= sum(g.tokens for g in self.held("withheld"))
        max_items, max_tokens = self.cap
        return (max_items is None or items <= max_items) and (max_tokens is None or toks <= max_tokens)

    # ---------------------------------------------------------------- rules

    @rule(
        new_group=st.booleans(),
        pick=st.integers(0, 1000),
        num_samples=st.integers(1, 3),
        step_offset=st.integers(-2, 2),
        lag=st.integers(0, 3),
        freshness=FRESHNESS,
        tokens=st.integers(0, 40),
    )
    def put(self, new_group, pick, num_samples, step_offset, lag, freshness, tokens):
        self.put_one(new_group, pick, num_samples, step_offset, lag, freshness, tokens)

    def put_one(self, new_group, pick, num_samples, step_offset, lag, freshness, tokens) -> bool:
        """Put one item into a new or a pending group; returns False when the buffer was full."""
        pending = sorted(gid for gid, g in self.groups.items() if g.where == "pending")
        if pending and not new_group:
            gid = pending[pick % len(pending)] if pick else pending[-1]
            num_samples, step = self.groups[gid].num_samples, self.groups[gid].step
        else:
            gid, step = self.next_group, self.version + step_offset
        traj = self.next_traj
        it = BufferItem(
            traj_id=traj,
            group_id=gid,
            num_samples=num_samples,
            step=step,
            min_version=self.version - lag,
            freshness=freshness,
            num_tokens=tokens,
            payload=("p", traj),
        )
        if not self.fits(tokens, reclaimable=True):
            before = self.buf.stats()
            with pytest.raises(BufferFull):
                self.buf.put(it)
            assert self.buf.stats() == before
            return False
        if not self.fits(tokens, reclaimable=False):
            # Which withheld groups go first is the buffer's documented choice (oldest withheld);
            # the model takes that order from it and checks that exactly enough are reclaimed.
            for old in list(self.buf._withheld_order):
                if self.fits(tokens, reclaimable=False):
                    break
                assert self.groups[old].where == "withheld"
                self.drop(old, "reclaimed")
        completed = self.buf.put(it)
        self.next_traj += 1
        self.num_put += 1
        self.fate[traj] = "in"
        if gid == self.next_group:
            self.next_group += 1
            self.groups[gid] = _MGroup(num_samples, step)
        g = self.groups[gid]
        g.members.append([traj, tokens, freshness, self.version - lag])
        assert completed == (len(g.members) == num_samples)
        if completed:
            g.seq = self.next_seq
            self.next_seq += 1
            self.place(gid)
        return True

    @rule(
        num_samples=st.integers(1, 3),
        step_offset=st.integers(-2, 2),
        lags=st.lists(st.integers(0, 3), min_size=3, max_size=3),
        freshness=st.lists(FRESHNESS, min_size=3, max_size=3),
        tokens=st.integers(0, 40),
    )
    def put_group(self, num_samples, step_offset, lags, freshness, tokens):
        """A whole group in a row, so that many groups reach the ready set."""
        for i in range(num_samples):
            if not self.put_one(i > 0, 0, num_samples, step_offset, lags[i], freshness[i], tokens):
                break

    @rule(num_groups=st.integers(1, 3))
    def sample(self, num_groups):
        got = self.buf.sample(num_groups)
        expected, replay = [], []
        for _ in range(num_groups):
            ready = [(self.policy_key(g), gid) for gid, g in self.groups.items() if g.where == "ready"]
            if self.cfg["order"] == "windowed":
                ready = [(k, gid) for k, gid in ready if self.groups[gid].step <= self.version]
            if not ready:
                break
            gid = min(ready)[1]
            g = self.groups[gid]
            reason = self.violation(g)
            assert reason is None or self.cfg["action"] == "downweight"
            if reason is not None:
                self.downweighted[reason] += len(g.members)
            if g.reuse > 0:
                self.replays += 1
            expected.append(
                (
                    gid,
                    tuple((m[0], m[2]) for m in g.members),
                    0.5 if reason else 1.0,
                    g.reuse,
                    self.version - g.min_version,
                    g.freshness,
                )
            )
            if g.reuse < self.cfg["max_replays"]:
                g.where = "out"
                replay.append(gid)
            else:
                del self.groups[gid]
                self.handed_out += len(g.members)
                for m in g.members:
                    assert self.fate[m[0]] == "in"
                    self.fate[m[0]] = "out"
        observed = [
            (
                b.group_id,
                tuple((i.traj_id, i.freshness) for i in b.items),
                b.weight,
                b.reuse,
                b.staleness,
                b.freshness,
            )
            for b in got
        ]
        assert observed == expected
        for b in got:
            assert all(i.group_id == b.group_id and i.payload == ("p", i.traj_id) for i in b.items)
        for gid in replay:
            g = self.groups[gid]
            if self.cfg["replay_decay"] != 1.0:
                for m in g.members:
                    m[2] = max(m[2] * self.cfg["replay_decay"], MIN_FRESHNESS)
            g.reuse += 1
            g.seq = self.next_seq
            self.next_seq += 1
            self.place(gid)

    @rule(delta=st.integers(0, 2))
    def update_version(self, delta):
        self.version += delta
        self.buf.update_version(self.version)
        self.enforce()

    @rule(
        max_staleness=st.none() | st.integers(0, 3),
        floor=st.sampled_from([0.0, 0.2, 0.5, 0.8]),
        window=st.integers(0, 2),
        which=st.sampled_from(["max_staleness", "freshness_floor", "window"]),
    )
    def set_bounds(self, max_staleness, floor, window, which):
        value = {"max_staleness": max_staleness, "freshness_floor": floor, "window": window}[which]
        self.bounds[which] = value
        self.buf.set_bounds(**{which: value})
        self.enforce()

    @rule(pick=st.integers(0, 1000))
    def discard_pending(self, pick):
        gids = sorted(self.groups) + [10**9]
        gid = gids[pick % len(gids)]
        g = self.groups.get(gid)
        expected = len(g.members) if g is not None and g.where == "pending" else 0
        assert self.buf.discard_pending(gid) == expected
        if expected:
            self.drop(gid, "abandoned")

    # ---------------------------------------------------------------- invariants

    @invariant()
    def stats_match_model(self):
        if not hasattr(self, "buf"):
            return
        s = self.buf.stats()
        withheld = self.held("withheld")
        assert s.size == len(self.buf) == sum(len(g.members) for g in self.held())
        assert s.num_tokens == sum(g.tokens for g in self.held())
        assert s.num_pending == sum(len(g.members) for g in self.held("pending"))
        assert s.num_groups_ready == len(self.held("ready"))
        assert s.num_items_ready == sum(len(g.members) for g in self.held("ready"))
        assert s.num_groups_withheld == len(withheld)
        assert s.withheld == sum(len(g.members) for g in withheld) == sum(s.withheld_by_reason.values())
        assert s.evicted_by_reason == self.evicted
        assert s.downweighted_by_reason == self.downweighted
        assert (s.replays, s.num_put, s.num_handed_out, s.num_released) == (
            self.replays,
            self.num_put,
            self.handed_out,
            self.released,
        )
        # every item put is exactly one of: in the buffer, handed out, evicted
        fates = list(self.fate.values())
        assert len(fates) == s.num_put
        assert (fates.count("in"), fates.count("out"), fates.count("evicted")) == (
            s.size,
            s.num_handed_out,
            sum(s.evicted_by_reason.values()),
        )
        # bounds hold on everything that can be sampled (unless the action is downweight)
        if self.cfg["action"] != "downweight":
            assert all(self.violation(g) is None for g in self.held("ready"))
            assert all(self.violation(g) is not None for g in withheld)


BufferMachine.TestCase.settings = SETTINGS
TestBufferMachine = BufferMachine.TestCase


# ================================================================================ ledger model

PICK = st.integers(0, 10**6)
AIM = st.integers(0, 3)  # 0: any id (often illegal); else an id for which the event is legal, if any
GENERATORS = st.sampled_from(["a", "b"])
_GENERATING = ("admitted", "in_flight", "requeued")


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.ledger = Ledger()
        self.tasks: dict[int, dict] = {}  # never deleted; "compacted" flag instead
        self.trajs: dict[int, list] = {}  # traj_id -> [task_id, index, state]; deleted on compaction
        self.dup_ids = self.dup_samples = self.overtrained = self.requeues = self.replays = 0
        self.evicted_by_reason: dict[str, int] = {}
        self.next_task = self.next_traj = 0

    # ---------------------------------------------------------------- helpers

    def choose_task(self, pick, aim, states):
        legal = sorted(t["id"] for t in self.tasks.values() if not t["compacted"] and t["state"] in states)
        return legal[pick % len(legal)] if aim and legal else pick % (self.next_task + 2)

    def choose_traj(self, pick, aim, states):
        legal = sorted(k for k, v in self.trajs.items() if v[2] in states)
        return legal[pick % len(legal)] if aim and legal else pick % (self.next_traj + 2)

    def expect_error(self, call, match):
        before = self.ledger.to_bytes()
        with pytest.raises(ValueError, match=match):
            call()
        assert self.ledger.to_bytes() == before  # an illegal event changes nothing

    def live(self, task_id, index):
        return any(
            t[0] == task_id and t[1] == index and t[2] in ("generated", "buffered")
            for t in self.trajs.values()
        )

    def closed(self, task):
        return (
            task["state"] in ("generated", "evicted")
            and len(task["resolved"]) == task["n"]
            and not any(self.live(task["id"], i) for i in range(task["n"]))
        )

    # ---------------------------------------------------------------- task rules

    @rule(pick=PICK, aim=AIM, n=st.integers(1, 3))
    def admit(self, pick, aim, n):
        task_id = self.next_task if aim else pick % (self.next_task + 1)
        if task_id in self.tasks:
            return self.expect_error(
                lambda: self.ledger.admit(task_id, group_id=task_id, num_samples=n), "already"
            )
        self.ledger.admit(task_id, group_id=task_id, num_samples=n)
        self.tasks[task_id] = dict(
            id=task_id, n=n, state="admitted", gen="", trained=0, resolved={}, seen=set(), compacted=False
        )
        self.next_task = max(self.next_task, task_id + 1)

    def task_event(self, task_id, call, allowed, target):
        task = self.tasks.get(task_id)
        if task is None or task["compacted"]:
            return self.expect_error(call, f"task {task_id}: unknown")
        if task["state"] not in allowed:
            return self.expect_error(call, f"task {task_id}: cannot go {task['state']} -> {target}")
        call()
        task["state"] = target
        return task

    @rule(pick=PICK, aim=AIM, gen=GENERATORS)
    def dispatch(self, pick, aim, gen):
        task_id = self.choose_task(pick, aim, ("admitted", "requeued"))
        call = lambda: self.ledger.dispatch(task_id, generator_id=gen)  # noqa: E731
        task = self.task_event(task_id, call, ("admitted", "requeued"), "in_flight")
        if task:
            task["gen"] = gen

    @rule(pick=PICK, aim=AIM)
    def task_done(self, pick, aim):
        task_id = self.choose_task(pick, aim, ("in_flight",))
        self.task_event(task_id, lambda: self.ledger.task_done(task_id), ("in_flight",), "generated")

    @rule(pick=PICK, aim=AIM)
    def requeue(self, pick, aim):
        task_id = self.choose_task(pick, aim, ("in_flight",))
        if self.task_event(task_id, lambda: self.ledger.requeue(task_id), ("in_flight",), "requeued"):
            self.requeues += 1

    @rule(gen=GENERATORS)
    def generator_failed(self, gen):
        expected = sorted(
            t["id"] for t in self.tasks.values() if t["state"] == "in_flight" and t["gen"] == gen
        )
        assert self.ledger.generator_failed(gen) == expected
        assert self.ledger.generator_failed(gen) == []  # exactly once per failure
        for task_id in expected:
            self.tasks[task_id]["state"] = "requeued"
        self.requeues += len(expected)

    @rule(pick=PICK, aim=AIM)
    def cancel(self, pick, aim):
        task_id = self.choose_task(pick, aim, ("admitted", "requeued"))
        call = lambda: self.ledger.cancel_task(task_id)  # noqa: E731
        task = self.task_event(task_id, call, ("admitted", "requeued"), "evicted")
        if task:
            for i in range(task["n"]):
                if i not in task["resolved"] and not self.live(task_id, i):
                    task["resolved"][i] = "evicted"

    # ---------------------------------------------------------------- trajectory rules

    @rule(pick=PICK, aim=AIM)
    def generated(self, pick, aim):
        task_id = self.choose_task(pick, aim, ("in_flight", "generated", "requeued"))
        task = self.tasks.get(task_id)
        index = (pick // 7) % 4
        if aim and task is not None:
            unseen = [i for i in range(task["n"]) if i not in task["seen"]]
            index = unseen[0] if unseen and aim > 1 else index % task["n"]
        traj_id = self.next_traj if aim else pick % (self.next_traj + 2)
        if aim == 3 and self.trajs:
            traj_id = sorted(self.trajs)[pick % len(self.trajs)]
        call = lambda: self.ledger.generated(traj_id, task_id=task_id, sample_index=index)  # noqa: E731
        if traj_id in self.trajs:
            assert call() is Arrival.DUPLICATE_ID
            self.dup_ids += 1
        elif task is not None and task["compacted"]:
            assert call() is Arrival.DUPLICATE_SAMPLE
            self.dup_samples += 1
        elif task is None:
            self.expect_error(call, "unknown")
        elif task["state"] not in ("in_flight", "generated", "requeued"):
            self.expect_error(call, f"task {task_id} is {task['state']}")
        elif index >= task["n"]:
            self.expect_error(call, "sample_index")
        else:
            verdict = call()
            assert verdict is (Arrival.DUPLICATE_SAMPLE if index in task["seen"] else Arrival.NEW)
            self.dup_samples += verdict is Arrival.DUPLICATE_SAMPLE
            task["seen"].add(index)
            self.trajs[traj_id] = [task_id, index, "generated"]
            self.next_traj = max(self.next_traj, traj_id + 1)

    def traj_event(self, traj_id, call, allowed, target):
        traj = self.trajs.get(traj_id)
        if traj is None:
            return self.expect_error(call, f"trajectory {traj_id}: unknown")
        if traj[2] not in allowed:
            return self.expect_error(call, f"trajectory {traj_id}: cannot")
        call()
        traj[2] = target
        return traj

    @rule(pick=PICK, aim=AIM)
    def buffered(self, pick, aim):
        traj_id = self.choose_traj(pick, aim, ("generated",))
        self.traj_event(traj_id, lambda: self.ledger.buffered(traj_id), ("generated",), "buffered")

    @rule(pick=PICK, aim=AIM)
    def trained(self, pick, aim):
        traj_id = self.choose_traj(pick, aim, ("buffered",))
        traj = self.traj_event(traj_id, lambda: self.ledger.trained(traj_id), ("buffered",), "trained")
        if traj:
            task = self.tasks[traj[0]]
            task["trained"] += 1
            self.overtrained += task["trained"] > task["n"]
            task["resolved"].setdefault(traj[1], "trained")

    @rule(pick=PICK, aim=AIM, reason=st.sampled_from(["staleness", "duplicate"]))
    def evicted(self, pick, aim, reason):
        traj_id = self.choose_traj(pick, aim, ("generated", "buffered"))
        call = lambda: self.ledger.evicted(traj_id, reason=reason)  # noqa: E731
        traj = self.traj_event(traj_id, call, ("generated", "buffered"), "evicted")
        if traj:
            self.evicted_by_reason[reason] = self.evicted_by_reason.get(reason, 0) + 1
            self.tasks[traj[0]]["resolved"].setdefault(traj[1], "evicted")

    @rule(pick=PICK, aim=AIM)
    def replayed(self, pick, aim):
        traj_id = self.choose_traj(pick, aim, ("trained",))
        if self.traj_event(traj_id, lambda: self.ledger.replayed(traj_id), ("trained",), "trained"):
            self.replays += 1

    # ---------------------------------------------------------------- checkpoints

    @rule()
    def compact(self):
        closed = [t for t in self.tasks.values() if not t["compacted"] and self.closed(t)]
        assert self.ledger.compact() == len(closed)
        for task in closed:
            task["compacted"] = True
        ids = {t["id"] for t in closed}
        self.trajs = {k: v for k, v in self.trajs.items() if v[0] not in ids}

    @rule()
    def round_trip(self):
        data = self.ledger.to_bytes()
        self.ledger = Ledger.from_bytes(data)
        assert self.ledger.to_bytes() == data

    # ---------------------------------------------------------------- invariants

    @invariant()
    def summary_matches_model(self):
        s = self.ledger.summary()
        pending = lost = 0
        lost_slots = []
        for task in self.tasks.values():
            for i in range(task["n"]):
                if i in task["resolved"]:
                    continue
                if self.live(task["id"], i) or task["state"] in _GENERATING:
                    pending += 1
                else:
                    lost += 1
                    lost_slots.append((task["id"], i))
        resolved = [kind for t in self.tasks.values() for kind in t["resolved"].values()]
        tasks_by_state = dict.fromkeys(["admitted", "in_flight", "requeued", "generated", "evicted"], 0)
        for t in self.tasks.values():
            tasks_by_state[t["state"]] += 1
        assert s.tasks_by_state == tasks_by_state and s.num_tasks == len(self.tasks)
        live_states = [t[2] for t in self.trajs.values()]
        for state in ("generated", "buffered"):  # terminal ones may have been compacted away
            assert s.trajectories_by_state[state] == live_states.count(state)
        assert s.num_samples_expected == sum(t["n"] for t in self.tasks.values())
        assert (s.num_samples_trained, s.num_samples_evicted) == (
            resolved.count("trained"),
            resolved.count("evicted"),
        )
        assert (s.num_samples_pending, s.num_samples_lost) == (pending, lost)
        assert s.num_samples_expected == s.num_samples_trained + s.num_samples_evicted + pending + lost
        assert self.ledger.lost() == sorted(lost_slots)
        assert (s.num_duplicate_ids, s.num_duplicate_samples, s.num_overtrained) == (
            self.dup_ids,
            self.dup_samples,
            self.overtrained,
        )
        assert s.num_duplicated == self.dup_ids + self.dup_samples + self.overtrained
        assert (s.num_requeues, s.num_replays, s.evicted_by_reason) == (
            self.requeues,
            self.replays,
            dict(sorted(self.evicted_by_reason.items())),
        )
        end = self.ledger.summary(at_end=True)
        assert (end.num_samples_pending, end.num_samples_lost) == (0, pending + lost)


LedgerMachine.TestCase.settings = SETTINGS
TestLedgerMachine = LedgerMachine.TestCase


# ================================================================================ long random runs
# Hypothesis shrinks well but favours short sequences; these seeded runs drive the same models
# through long sequences (hundreds of operations, deep buffers, many replays and releases).


def _drive(machine, steps, rng):
    for _ in range(steps):
        name, draw = rng.choice(machine.RANDOM_OPS)
        getattr(machine, name)(**draw(rng))
        for check in machine.INVARIANTS:
            getattr(machine, check)()


def _put_args(r):
    return dict(
        new_group=r.random() < 0.4,
        pick=r.randrange(1000),
        num_samples=r.randint(1, 3),
        step_offset=r.randint(-2, 2),
        lag=r.choice([0, 0, 0, 1, 2, 3]),
        freshness=r.choice([0.1, 0.25, 0.5, 0.75, 1.0]),
        tokens=r.randint(0, 40),
    )


BufferMachine.RANDOM_OPS = [
    *[("put", _put_args)] * 6,
    *[("sample", lambda r: dict(num_groups=r.randint(1, 3)))] * 3,
    ("update_version", lambda r: dict(delta=r.choice([0, 1, 1, 2]))),
    (
        "set_bounds",
        lambda r: dict(
            max_staleness=r.choice([None, 0, 1, 2, 3]),
            floor=r.choice([0.0, 0.2, 0.5, 0.8]),
            window=r.randint(0, 2),
            which=r.choice(["max_staleness", "freshness_floor", "window"]),
        ),
    ),
    ("discard_pending", lambda r: dict(pick=r.randrange(1000))),
]
BufferMachine.INVARIANTS = ["stats_match_model"]

_PA = lambda r: dict(pick=r.randrange(10**6), aim=r.choice([0, 1, 2, 2, 2, 3]))  # noqa: E731
LedgerMachine.RANDOM_OPS = [
    *[("admit", lambda r: dict(_PA(r), n=r.randint(1, 3)))] * 3,
    *[("dispatch", lambda r: dict(_PA(r), gen=r.choice("ab")))] * 3,
    *[("task_done", _PA)] * 2,
    ("requeue", _PA),
    ("generator_failed", lambda r: dict(gen=r.choice("ab"))),
    ("cancel", _PA),
    *[("generated", _PA)] * 6,
    *[("buffered", _PA)] * 4,
    *[("trained", _PA)] * 4,
    ("evicted", lambda r: dict(_PA(r), reason=r.choice(["staleness", "duplicate"]))),
    ("replayed", _PA),
    ("compact", lambda r: {}),
    ("round_trip", lambda r: {}),
]
LedgerMachine.INVARIANTS = ["summary_matches_model"]


@pytest.mark.parametrize("seed", range(24))
def test_buffer_long_random_run(seed):
    rng = random.Random(seed)
    machine = BufferMachine()
    machine.setup(
        order=["fifo", "freshest", "windowed"][seed % 3],
        action=["withhold", "downweight", "drop"][(seed // 3) % 3],
        max_staleness=rng.choice([None, 2, 3]),
        floor=rng.choice([0.0, 0.2]),
        window=rng.randint(0, 2),
        max_replays=rng.randint(0, 2),
        decay=rng.choice([1.0, 0.9, 0.5]),
        max_items=None if seed % 2 else rng.randint(10, 40),
        max_tokens=rng.choice([None, 400]),
    )
    _drive(machine, 300, rng)


@pytest.mark.parametrize("seed", range(12))
def test_ledger_long_random_run(seed):
    _drive(LedgerMachine(), 300, random.Random(seed))
