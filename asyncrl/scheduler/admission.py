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
