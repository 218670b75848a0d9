"""IdentityPages: the device page ids of an identity layout, with double-use and double-free detection."""

from __future__ import annotations

import numpy as np
import torch

from sglang_ext.dataplane.sorted_ids import has_repeats


class IdentityPages:
    """Device page ids of an *identity* layout: layer-page ``(l, p)`` may only use id ``l * P + p``.

    Used when the device budget holds every layer of every page (nothing must ever be offloaded):
    then each layer's pages form one contiguous slice of the device pool, which attention reads in
    place with SGLang's own slot indices. Same counting and double-use checks as
    :class:`BlockAllocator`, vectorised; ``take`` replaces ``alloc``.
    """

    def __init__(self, capacity: int, name: str) -> None:
        if capacity < 0:
            raise ValueError(f"{name}: capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._in_use = torch.zeros(capacity, dtype=torch.bool)
        self._in_use_np = self._in_use.numpy()  # same memory; for take_distinct
        self._used = 0

    @property
    def free_count(self) -> int:
        return self.capacity - self._used

    @property
    def used_count(self) -> int:
        return self._used

    def _ids(self, ids) -> torch.Tensor:  # noqa: ANN001
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.capacity):
            raise ValueError(f"{self.name}: block id out of range [0, {self.capacity})")
        return ids

    def take(self, ids, *, unique: bool = False):  # noqa: ANN001, ANN201 - torch.Tensor in, out
        """Mark these ids used; raises ValueError (nothing taken) if one is in use or repeated
        (``unique=True``: the caller guarantees distinct ids, the repeat check is skipped)."""
        ids = self._ids(ids)
        if bool(self._in_use[ids].any()):
            raise ValueError(f"{self.name}: block id already in use")
        if not unique and torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"{self.name}: block id repeated")
        self._in_use[ids] = True
        self._used += int(ids.numel())
        return ids

    def take_distinct(self, ids: np.ndarray) -> None:
        """:meth:`take` for the per-step fast path: ``ids`` is an int64 NumPy array of distinct
        ids in range (the caller's guarantee); still raises ValueError (nothing taken) if one is
        in use."""
        if self._in_use_np[ids].any():
            raise ValueError(f"{self.name}: block id already in use")
        self._in_use_np[ids] = True
        self._used += int(ids.size)

    def retake(self, ids: np.ndarray) -> int:
        """None: the identity layout stages nothing that a later step takes again."""
        return 0

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free ids (any; for short-lived staging returned before the next boundary) or None."""
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} blocks")
        if n > self.free_count:
            return None
        ids = (~self._in_use).nonzero().squeeze(1)[:n]
        self.take(ids)
        return ids.tolist()

    def free(self, ids, *, hold: bool = False) -> None:  # noqa: ANN001
        """Return ids; raises ValueError (freeing nothing) on an unknown or already free id
        (``hold``: :meth:`BlockAllocator.free`'s; nothing here is taken again in order). NumPy
        on the shared memory: torch's bool ``index_put_`` costs ~2 us per id on CPU."""
        flat = np.asarray(ids.numpy() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.capacity):
            raise ValueError(f"{self.name}: block id out of range [0, {self.capacity})")
        if not self._in_use_np[flat].all() or has_repeats(flat):
            raise ValueError(f"{self.name}: double free")
        self._in_use_np[flat] = False
        self._used -= int(flat.size)

    def used_ids(self) -> set[int]:
        return set(self._in_use.nonzero().squeeze(1).tolist())
