"""An indexed min-heap with lazy deletion: the priority queue under every buffer ordering.

Pure data structure used by `asyncrl.buffer.store`. Each key (a group id) has at most one live
entry; `remove` and re-`push` only mark the old entry dead, and dead entries are skipped when they
reach the top. When dead entries outnumber live ones the heap is rebuilt, so memory stays O(live)
and every operation is O(log n) amortised.
"""

from __future__ import annotations

import heapq
from typing import Any

# Rebuild once the heap holds this many dead entries beyond twice the live ones. The constant
# keeps tiny heaps from being rebuilt on every removal.
_COMPACT_SLACK = 64


class LazyHeap:
    """Min-heap of `(priority, key)` with O(log n) push/pop and O(1) amortised remove.

    Priorities are any mutually comparable values (ints, floats, tuples). Ties are broken by push
    order, so keys themselves are never compared.
    """

    __slots__ = ("_entries", "_live", "_next_token")

    def __init__(self) -> None:
        self._entries: list[tuple[Any, int, int]] = []  # (priority, token, key)
        self._live: dict[int, int] = {}  # key -> token of its live entry
        self._next_token = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: int) -> bool:
        return key in self._live

    def push(self, key: int, priority: Any) -> None:
        """Insert `key`, replacing its previous entry if it has one."""
        token = self._next_token
        self._next_token += 1
        self._live[key] = token
        heapq.heappush(self._entries, (priority, token, key))
        self._maybe_compact()

    def remove(self, key: int) -> bool:
        """Forget `key`; returns whether it was present."""
        if self._live.pop(key, None) is None:
            return False
        self._maybe_compact()
        return True

    def peek(self) -> tuple[Any, int] | None:
        """`(priority, key)` of the smallest live entry, or None when empty."""
        entries = self._entries
        live = self._live
        while entries:
            priority, token, key = entries[0]
            if live.get(key) == token:
                return priority, key
            heapq.heappop(entries)
        return None

    def pop(self) -> tuple[Any, int] | None:
        """Remove and return `(priority, key)` of the smallest live entry, or None when empty."""
        top = self.peek()
        if top is not None:
            heapq.heappop(self._entries)
            del self._live[top[1]]
        return top

    def _maybe_compact(self) -> None:
        if len(self._entries) > 2 * len(self._live) + _COMPACT_SLACK:
            live = self._live
            self._entries = [e for e in self._entries if live.get(e[2]) == e[1]]
            heapq.heapify(self._entries)
