"""BlockAllocator: a free list of block ids with double-use and double-free detection."""

from __future__ import annotations


class BlockAllocator:
    """Hands out ids in ``[0, capacity)``; ``alloc`` is all-or-nothing."""

    def __init__(self, capacity: int, name: str) -> None:
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        # Pop from the end: low ids first, which keeps small tests readable.
        self._free = list(range(capacity - 1, -1, -1))
        self._in_use = bytearray(capacity)

    @property
    def free_count(self) -> int:
        """Blocks available to ``alloc``."""
        return len(self._free)

    @property
    def used_count(self) -> int:
        """Blocks currently handed out."""
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` distinct free ids, or None (and nothing taken) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._in_use[i] = 1
        return ids

    def free(self, ids: list[int] | tuple[int, ...]) -> None:
        """Return ids; raises ValueError (freeing nothing) on an unknown or already free id."""
        seen: set[int] = set()
        for i in ids:
            if not 0 <= i < self.capacity:
                raise ValueError(f"{self.name}: block id {i} out of range [0, {self.capacity})")
            if not self._in_use[i] or i in seen:
                raise ValueError(f"{self.name}: double free of block {i}")
            seen.add(i)
        for i in ids:
            self._in_use[i] = 0
            self._free.append(i)

    def used_ids(self) -> set[int]:
        """The set of ids handed out (for invariant checks)."""
        return {i for i in range(self.capacity) if self._in_use[i]}
