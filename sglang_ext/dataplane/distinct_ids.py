"""DistinctIds: whether an array of ids in ``[0, size)`` holds an id twice, in O(len), no sort.

Every position writes its index into a scratch array sized to the ids' range; a repeated id keeps
only its last writer, so an earlier position reads back another index. Two gathers and a compare,
where a sort-based check sorts (``sorted_ids.has_repeats``: the general one, for ids of any range).
Used by the want counts (a request's pages, nearly always distinct) and the block allocator's
free (a step's thousands of staging pages given back).
"""

from __future__ import annotations

import numpy as np


class DistinctIds:
    """A repeat check for ids in ``[0, size)`` with its own scratch (module docstring)."""

    def __init__(self, size: int) -> None:
        self.scratch = np.zeros(size, dtype=np.int64)
        """``[size]``: contents meaningless between calls (a caller may use it as scratch too)."""
        self._index = np.arange(0, dtype=np.int64)
        """``0, 1, ...``: the positions (grown by doubling)."""

    def distinct(self, ids: np.ndarray) -> bool:
        """True when the in-range ``ids`` hold no id twice."""
        n = int(ids.size)
        if self._index.size < n:
            self._index = np.arange(max(n, 2 * self._index.size), dtype=np.int64)
        index = self._index[:n]
        self.scratch[ids] = index
        return not bool((self.scratch[ids] != index).any())  # not np.array_equal: its wrapper costs as much
