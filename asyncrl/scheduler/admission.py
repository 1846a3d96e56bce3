"""Staleness-bounded admission (pure): which groups may be generated now.

Group j is trained in learner step s(j) = j // B (B = groups per step), at policy_version s(j).
It is admitted only once every generator has loaded a version >= s(j) - K (K = max staleness),
so every token in it comes from a version v >= s(j) - K and its staleness s(j) - v is at most K.
Hence at most (v_loaded + K + 1) * B groups are ever admitted, where v_loaded is the oldest
version any serving generator holds (scheduler/supervision.py: a dead generator, or a replacement
not yet on the current weights, neither counts nor gets tasks): a credit frees only when the
generators acknowledge new weights. K = 0 is strictly on-policy (sync): step s's groups wait for version s.
"""

from __future__ import annotations


def admission_limit(
    *, loaded_version: int, groups_per_step: int, max_staleness: int, total_groups: int
) -> int:
    """How many groups (counting from group 0) may have been admitted in total."""
    if loaded_version < 0 or groups_per_step <= 0 or max_staleness < 0:
        raise ValueError("loaded_version and max_staleness must be >= 0 and groups_per_step > 0")
    return min(total_groups, (loaded_version + max_staleness + 1) * groups_per_step)


def step_of(group_index: int, *, groups_per_step: int) -> int:
    return group_index // groups_per_step


class Admission:
    """Counts admitted groups against the limit; `admit(loaded_version)` yields new group indices."""

    def __init__(self, *, groups_per_step: int, max_staleness: int, total_steps: int) -> None:
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.total_groups = groups_per_step * total_steps
        self.num_admitted = 0

    def admit(self, loaded_version: int) -> range:
        limit = admission_limit(
            loaded_version=loaded_version,
            groups_per_step=self.groups_per_step,
            max_staleness=self.max_staleness,
            total_groups=self.total_groups,
        )
        new = range(self.num_admitted, max(self.num_admitted, limit))
        self.num_admitted = max(self.num_admitted, limit)
        return new

    @property
    def done(self) -> bool:
        return self.num_admitted >= self.total_groups


class CreditAdmission:
    """Pool mode (buffer.mode = "pool"): groups are not tied to a step, so admission counts
    credits instead. There are (K + 1) x B of them; admitting a group takes one, and it comes back
    only when the learner reports that the group left its buffer (trained for the last time,
    dropped or withheld: `GroupsLeft.released`, with the `version` it names) *and* every serving
    generator has loaded that version. So at most (K + 1) x B groups are ever admitted and not yet out
    of the pool, and the groups admitted on a credit returned by step s are generated at versions
    >= s + 1: handed out in admission order (fifo), none is more than K versions stale when it
    trains. Other orders can keep a group longer; the buffer's staleness bound withholds, drops or
    down-weights it then. K = 0 is generate, train, sync.
    """

    def __init__(self, *, groups_per_step: int, max_staleness: int, total_steps: int) -> None:
        if groups_per_step <= 0 or max_staleness < 0:
            raise ValueError("groups_per_step must be > 0 and max_staleness >= 0")
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.total_groups = groups_per_step * total_steps  # group hand-outs the run trains
        self.capacity = (max_staleness + 1) * groups_per_step
        self.num_admitted = 0
        self.num_returned = 0  # credits back in the pool
        self.pending: list[tuple[int, int]] = []  # (version, credits) waiting for the generators

    def release(self, count: int, *, version: int) -> None:
        """`count` groups left the learner's pool in the step that produced `version`."""
        if count:
            self.pending.append((version, count))

    def admit(self, loaded_version: int) -> range:
        """New group indices admitted now, given the oldest version a serving generator holds."""
        still = []
        for version, count in self.pending:
            if version <= loaded_version:
                self.num_returned += count
            else:
                still.append((version, count))
        self.pending = still
        limit = self.num_returned + self.capacity
        new = range(self.num_admitted, max(self.num_admitted, limit))
        self.num_admitted = max(self.num_admitted, limit)
        return new

    @property
    def outstanding(self) -> int:
        """Groups admitted and not yet returned to the pool (pending returns included)."""
        return self.num_admitted - self.num_returned
