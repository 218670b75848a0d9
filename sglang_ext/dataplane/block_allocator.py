"""BlockAllocator: a free list of block ids with double-use and double-free detection."""

from __future__ import annotations

import numpy as np

from sglang_ext.dataplane.distinct_ids import DistinctIds
from sglang_ext.dataplane.sorted_ids import ascending


class BlockAllocator:
    """Hands out ids in ``[0, capacity)``; ``alloc`` is all-or-nothing."""

    def __init__(self, capacity: int, name: str) -> None:
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        # A stack popped from the end: low ids first, which keeps small tests readable; NumPy, so
        # a step's thousands of staging pages go and come back in a few array operations.
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._top = capacity
        self._in_use = np.zeros(capacity, dtype=bool)
        self._ids = DistinctIds(capacity)
        """:meth:`free`'s repeat check (O(n), no sort)."""
        self._held = 0
        """The top ``_held`` entries of the free stack are the ids last freed with ``hold`` (a
        step's staging pages, in their order): :meth:`alloc` takes from under them while it can,
        so the next step's :meth:`retake` finds them whole."""
        self._lent: np.ndarray | None = None
        """The last :meth:`renew`'s ids (read-only): distinct and in range by construction, so a
        :meth:`free` with ``hold`` of this very array checks only that each is still in use."""

    @property
    def free_count(self) -> int:
        """Blocks available to ``alloc``."""
        return self._top

    @property
    def used_count(self) -> int:
        """Blocks currently handed out."""
        return self.capacity - self._top

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` distinct free ids (int64, most recently freed first -- from under a held run
        while enough lie there), or None (and nothing taken) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} blocks")
        if n > self._top:
            return None
        top, held = self._top, self._held
        if held and n <= top - held:  # from under the held run, which moves down whole
            lo = top - held
            ids = self._free[lo - n: lo][::-1].copy()
            self._free[lo - n: top - n] = self._free[lo: top]  # overlapping: NumPy copies through a buffer
        else:  # the held run's last ids go first: a prefix of it stays for retake
            ids = self._free[top - n: top][::-1].copy()
            self._held = max(0, held - n)
        self._top -= n
        self._in_use[ids] = True
        return ids

    def retake(self, ids: np.ndarray) -> int:
        """Take again the leading ids of ``ids`` (int64) that are still free where :meth:`free`
        put them: ``ids`` were freed in this order (held, or nothing freed on top since) and the
        allocations since popped at most the last of them. Returns how many, a prefix of ``ids``
        (0: nothing taken); ends any hold. A step's staging pages reused by the next step:
        O(len), no search of the free list in the usual case."""
        n, top = int(ids.size), self._top
        if not n or not top:
            return 0
        if ids[-1] == self._free[top - 1]:  # nothing allocated since they went back: all of them
            m = n
        else:
            hit = np.flatnonzero(ids == self._free[top - 1])
            m = int(hit[0]) + 1 if hit.size else 0
        self._held = 0  # consumed, or not what was held: either way no longer kept apart
        if not m or m > top or not (self._free[top - m: top] == ids[:m]).all():  # both m long
            return 0
        self._top -= m
        self._in_use[ids[:m]] = True
        return m

    def renew(self, ids: np.ndarray, extra: int) -> tuple[int, np.ndarray | None]:
        """A step's staging again: :meth:`retake` of ``ids`` (int64, as freed with ``hold``), then
        as many new ids as that left out plus ``extra``. Returns ``(kept, joined)``: the kept
        prefix of ``ids`` then the new ids ascending, one read-only array that a :meth:`free`
        with ``hold`` trusts (distinct and in range: the kept ids were the top of the free
        stack, the new ones came from under them). ``(kept, None)``, nothing taken (the kept
        ids held again), when too few are free."""
        m = self.retake(ids)
        more = self.alloc(int(ids.size) - m + extra)
        if more is None:
            if m:
                self.free(ids[:m], hold=True)
            return m, None
        joined = np.empty(m + more.size, dtype=np.int64)
        joined[:m] = ids[:m]
        joined[m:] = ascending(more)
        joined.flags.writeable = False
        self._lent = joined
        return m, joined

    def free(self, ids, *, hold: bool = False) -> None:  # noqa: ANN001 - a sequence of ints or an int array
        """Return ids; raises ValueError (freeing nothing) on an unknown or already free id.
        ``hold``: a step's staging pages the next step will :meth:`retake` -- kept on top of the
        free stack, in this order, while allocations can be served from under them (ids freed
        later without ``hold`` go under them too); a later ``hold`` replaces them. The last
        :meth:`renew`'s array freed with ``hold`` is checked only for ids no longer in use."""
        trusted = hold and self._lent is not None and ids is self._lent
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not arr.size:
            return
        if trusted:  # distinct and in range by construction (renew): in use is all there is to check
            if not self._in_use[arr].all():
                self._refuse(arr)
            self._lent = None
        # one reduction for the range (a negative id is huge as unsigned); repeats without a sort
        elif int(arr.view(np.uint64).max()) >= self.capacity or not self._in_use[arr].all() or (
                arr.size > 1 and not self._ids.distinct(arr)):
            self._refuse(arr)
        self._in_use[arr] = False
        top, n = self._top, int(arr.size)
        if self._held and not hold:  # under the held run, which moves up whole
            lo = top - self._held
            self._free[lo + n: top + n] = self._free[lo: top]
            self._free[lo: lo + n] = arr
        else:
            self._free[top: top + n] = arr
            if hold:
                self._held = n
        self._top = top + n

    def _refuse(self, arr: np.ndarray) -> None:
        """Raise for the first offending id of ``arr`` (in order)."""
        seen: set[int] = set()
        for i in arr.tolist():
            if not 0 <= i < self.capacity:
                raise ValueError(f"{self.name}: block id {i} out of range [0, {self.capacity})")
            if not self._in_use[i] or i in seen:
                raise ValueError(f"{self.name}: double free of block {i}")
            seen.add(i)
        raise AssertionError("unreachable: a refused free names an id")  # pragma: no cover

    def used_ids(self) -> set[int]:
        """The set of ids handed out (for invariant checks)."""
        return set(np.flatnonzero(self._in_use).tolist())

