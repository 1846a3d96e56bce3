"""Pool mode (`buffer.mode = "pool"`): each learner step takes `groups_per_step` whole groups
from a freshness-scored `Buffer` (asyncrl/buffer/store.py) instead of the groups admitted for it.

Place in the data flow: the learner service (`service.py`) `add`s every validated trajectory;
`run_step` takes groups in the configured order (fifo, freshest, windowed) as they become
ready and trains them as they come (a complete group streams through the trainer's
known-advantage path), or all at once when the objective cannot stream. The buffer enforces the
bounds at every version: a group past `staleness.max_staleness` or under `buffer.freshness_floor`
is withheld, dropped or handed out down-weighted (`buffer.action`), and counted. A group may be
trained up to `buffer.max_replays` more times, never twice in one step.

What the learner tells the launcher: per step (`step_report`, in StepDone) the groups trained
for the first time and replayed; in GroupsLeft messages (`take_left`) the groups that left the
admission window, which the launcher turns back into admission credits once every generator
holds the version sent with them (`scheduler/admission.py`, CreditAdmission):
  * a group trained for the first time in step s, at the step's end, with version s + 1 (its
    replays, if any, reuse data already generated and hold no credit; they stay within the
    staleness bound, so at most (max_staleness + 1) x groups_per_step of them wait at once);
  * a group withheld or dropped before any use, as soon as it happens, with the learner's
    version then (the step may be waiting for the group that replaces it), and which of those
    were dropped, by reason (the ledger records them as evicted).
So at most (max_staleness + 1) x groups_per_step groups are ever admitted and not yet trained or
set aside. The buffer moves to version s + 1 when step s ends, so its bounds apply before StepDone.

Freshness of an item: 2^(-s / freshness_half_life), s = its staleness when it arrived
(`freshness_from_staleness`); replays multiply it by `replay_decay`.

Dynamic sampling (DAPO) with `learner.drop_degenerate_groups`: a group whose rewards all came out
equal (no learning signal) leaves as it completes, evicted as "degenerate"; its credit goes back
in a GroupsLeft, the launcher admits another prompt, and every step still trains groups_per_step
informative groups, within the staleness bound. At most `learner.max_degenerate_per_step` x
groups_per_step groups may leave so during one step; past that the run stops with the reason
(a task the model always or never solves, where over-sampling cannot fill a batch).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from asyncrl.buffer.store import Buffer, BufferItem, GroupBatch, freshness_from_staleness
from asyncrl.learner.loop import StepLoop
from asyncrl.learner.step import TrainSample
from asyncrl.learner.trainer import StepResult, Trainer

if TYPE_CHECKING:
    from asyncrl.config import Config


class PoolLoop(StepLoop):
    # Each step is published and reported before the next one starts: `run_step` has no
    # `before_update` gate, and the groups a step releases go out right after its StepDone.
    overlap_close = False

    def __init__(self, trainer: Trainer, config: Config) -> None:
        super().__init__(trainer, lambda step: 0)
        b = config.buffer
        self.groups_per_step = config.learner.groups_per_step
        self.group_size = config.learner.samples_per_group
        self.half_life = b.freshness_half_life
        self.buffer: Buffer[TrainSample] = Buffer(
            order=b.order,
            window=b.window,
            max_staleness=config.effective_max_staleness,
            freshness_floor=b.freshness_floor,
            action=b.action,
            downweight=b.downweight,
            max_replays=b.max_replays,
            replay_decay=b.replay_decay,
            max_items=b.max_items or 2 * config.admission_window_items,
            record_events=True,
        )
        self.used: set[int] = set()  # groups handed out at least once
        self.set_aside: set[int] = set()  # withheld or dropped before any use (credit back once)
        self._released_at_end: list[int] = []  # first used this step
        self.taken_groups: list[GroupBatch[TrainSample]] = []
        self.replays_dropped = 0  # groups dropped with replays left (trained at least once)
        self.drop_degenerate = config.learner.drop_degenerate_groups
        self.max_degenerate = config.learner.max_degenerate_per_step * self.groups_per_step
        self._rewards: dict[int, list] = {}  # group -> rewards so far (dynamic sampling)
        # GDPO: a group is degenerate when every reward is constant in it, not its weighted sum.
        self.per_reward = config.learner.advantage == "gdpo"
        self.num_degenerate = 0  # groups dropped as degenerate, in all
        self.degenerate_this_step = 0
        self._report = _empty_report()
        self.resumed_groups: set[int] = set()  # groups a resume put back (`restore`)
        self._left: dict = {"released": [], "evicted": {}}

    # ------------------------------------------------------------------ data in
    def add(self, step: int, sample: TrainSample, *, reuse: int = 0, freshness: float | None = None) -> None:
        """Loop thread: a validated, deduplicated trajectory (admitted at version `step`)."""
        if sample.group_id in self.resumed_groups:
            # A group the checkpoint held only in part: the launcher re-admitted it at the resume
            # version, and its missing members come with that step. The group keeps the step of
            # its first admission (the buffer refuses a group whose members disagree).
            first = self.buffer.pending_step(sample.group_id)
            step = step if first is None else first
        oldest = int(sample.token_versions.min())
        if freshness is None:
            freshness = freshness_from_staleness(
                self.buffer.learner_version - oldest, half_life=self.half_life
            )
        item = BufferItem(
            traj_id=sample.traj_id,
            group_id=sample.group_id,
            num_samples=self.group_size,
            step=step,
            min_version=oldest,
            freshness=freshness,
            num_tokens=len(sample.completion_ids),
            payload=sample,
        )
        if reuse:
            self.used.add(sample.group_id)  # trained before a resume: holds no credit
        elif self.drop_degenerate and self._completes_degenerate(sample):
            self.buffer.discard_pending(sample.group_id, reason="degenerate")
            self._note_events()
            return
        self.buffer.put(item, reuse=reuse)
        self._note_events()
        self.arrived.set()

    def _completes_degenerate(self, sample: TrainSample) -> bool:
        """Whether `sample` completes a group whose rewards are all equal (then it is counted)."""
        rewards = self._rewards.setdefault(sample.group_id, [])
        rewards.append(tuple(sample.reward_parts) if self.per_reward else sample.reward)
        if len(rewards) < self.group_size:
            return False
        del self._rewards[sample.group_id]
        if any(r != rewards[0] for r in rewards):
            return False
        self.num_degenerate += 1
        self.degenerate_this_step += 1
        if self.degenerate_this_step > self.max_degenerate:
            raise RuntimeError(
                f"dynamic sampling dropped {self.degenerate_this_step} groups with equal rewards in one "
                f"step (learner.max_degenerate_per_step = {self.max_degenerate // self.groups_per_step} x "
                f"groups_per_step): almost every prompt is always or never solved; use an easier or "
                "harder task, more samples_per_group, or learner.drop_degenerate_groups = false"
            )
        return True

    def accepts(self, step: int, version: int) -> bool:
        return True  # any admitted group may be trained later: the buffer's bounds decide

    def resume(self, version: int, held: list[tuple[int, TrainSample, dict]]) -> None:
        self.buffer.update_version(version)
        self.restore(held)

    def restore(self, held: list[tuple[int, TrainSample, dict]]) -> None:
        """Resume: put a checkpoint's `held` back, reuse counts and freshness included."""
        self.resumed_groups = {sample.group_id for _, sample, _ in held}
        for step, sample, extra in held:
            self.add(step, sample, reuse=int(extra.get("reuse", 0)), freshness=extra.get("freshness"))

    def held(self, after_step: int) -> list[tuple[int, TrainSample, dict]]:
        """Loop thread: what a checkpoint must keep: the buffer as the next version will see it,
        plus, when step `after_step + 1` is unfinished, the groups it took (as they were)."""
        unfinished = self.taken_step > after_step
        taken = {gb.group_id for gb in self.taken_groups} if unfinished else set()
        out = []
        if unfinished:
            for gb in self.taken_groups:
                out.extend(_held(i, gb.reuse) for i in gb.items)
        out.extend(_held(i, reuse) for i, reuse in self.buffer.contents() if i.group_id not in taken)
        return out

    def depth(self) -> tuple[int, int]:
        stats = self.buffer.stats()
        return stats.size, stats.num_groups_ready + stats.num_groups_withheld

    # ------------------------------------------------------------------ a step
    async def run_step(self, step: int) -> StepResult | None:
        trainer = self.trainer
        trainer.begin_step(step)
        self.buffer.update_version(step)
        self._note_events()
        self.taken_step, self.taken, self.taken_groups = step, [], []
        self.degenerate_this_step = 0
        whole = bool(trainer.fallback)
        while not self.stopping:
            need = self.groups_per_step - len(self.taken_groups)
            if need:
                for gb in self.buffer.sample(need, defer_replays=True):
                    self._take(gb, offer=not whole)
                self._note_events()
                if len(self.taken_groups) == self.groups_per_step:
                    self.last_arrival[step] = time.perf_counter()
            done = len(self.taken_groups) == self.groups_per_step
            if whole:
                if done:
                    await self._busy(trainer.batch_backward, self.taken)
                    break
            else:
                if trainer.has_work() and await self._busy(trainer.work):
                    continue
                if done:
                    break
            await self._wait_for_data()
        if self.stopping:
            return None
        result = await self._busy(trainer.finish_step)
        # On the loop thread, like every other buffer operation (`add` runs here too).
        self.buffer.update_version(step + 1)  # the learner's new version: re-check the bounds
        self._note_events()
        self._left["released"].extend(self._released_at_end)
        self._released_at_end = []
        return result

    def _take(self, gb: GroupBatch[TrainSample], *, offer: bool) -> None:
        self.taken_groups.append(gb)
        (self._report["groups_replayed"] if gb.reuse else self._report["groups_trained"]).append(gb.group_id)
        if gb.group_id not in self.used and gb.group_id not in self.set_aside:
            self._released_at_end.append(gb.group_id)
        self.used.add(gb.group_id)
        for item in gb.items:
            sample = item.payload if gb.weight == 1.0 else dataclasses.replace(item.payload, weight=gb.weight)
            self.taken.append(sample)
            if offer:
                self.trainer.offer(sample)

    def _note_events(self) -> None:
        for kind, gid, reason in self.buffer.drain_events():
            if gid in self.used:
                if kind == "evicted":
                    self.replays_dropped += 1  # trained already: its replays are forgone, not lost
                continue
            if kind == "evicted":
                self._left["evicted"].setdefault(reason, []).append(gid)
            if kind in ("evicted", "withheld") and gid not in self.set_aside:
                self.set_aside.add(gid)
                self._left["released"].append(gid)

    def step_report(self) -> dict:
        """StepDone's pool fields for the step just finished."""
        report, self._report = self._report, _empty_report()
        return report

    def take_left(self) -> dict | None:
        """GroupsLeft's fields for what left the pool since the last call, or None."""
        if not self._left["released"] and not self._left["evicted"]:
            return None
        left, self._left = self._left, {"released": [], "evicted": {}}
        return left

    def metrics(self) -> dict[str, float]:
        s = self.buffer.stats()
        out = {
            "buffer/withheld": float(s.withheld),
            "buffer/replays": float(s.replays),
            "buffer/replays_dropped": float(self.replays_dropped),
            "buffer/released": float(s.num_released),
            "buffer/degenerate_groups": float(self.num_degenerate),
        }
        for reason, n in s.evicted_by_reason.items():
            out[f"buffer/evicted_{reason}"] = float(n)
        for reason, n in s.downweighted_by_reason.items():
            out[f"buffer/downweighted_{reason}"] = float(n)
        return out


def _empty_report() -> dict:
    return {"groups_trained": [], "groups_replayed": []}


def _held(item: BufferItem[TrainSample], reuse: int) -> tuple[int, TrainSample, dict]:
    return item.step, item.payload, {"reuse": reuse, "freshness": item.freshness}
