"""HostSlots: a decode step's new slots on the host, handed from their allocation to the boundary.

SGLang allocates a decode step's slots (``out_cache_loc``, one per request) on the device, on the
scheduler's stream; kvplane's scheduler hook reads them back right there
(:meth:`~sglang_ext.radix_cache.LayeredRadixCache.on_alloc_decode`: each opened page is
attributed to its request). The step's boundary needs the same list
(:meth:`LayeredKVCore.prepare_decode_step`). Reading the forward's tensor again is a second host
sync a step, on the forward stream: under SGLang's overlap loop it waits for everything launched
there before it. (The hook's own read, on the schedule stream, stays the step's one sync; with the
layered backends' whole-forward WAR barrier it already waits for the forward in flight:
``docs/overlap-schedule.md``.)

So the hook publishes its list with the step it allocated for: the batch's requests and their
lengths with the new token. The forward's tensor need not be the allocation's (on the CPU server
it is another tensor object every step; the CUDA-graph runner copies the slots into its buffer),
so the step, not the tensor, is the key: a decode allocation happens once per (requests, lengths) -- lengths only grow, and a
retracted request's next steps are allocated (and published) again. The boundary takes the list
when its step is the published one, once; any other step reads the tensor back (counted: a
served steady step that reads back is a wiring fault worth seeing in the stats).

The list is shared, not copied: callers must not modify it. SGLang-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class HostSlots:
    """The last decode allocation's slots as the host read them (module docstring)."""

    def __init__(self) -> None:
        self._step: tuple[list[str], list[int]] | None = None
        self._slots: list[int] = []
        self.handoffs = 0
        """Boundaries that took the published list (no read of the device)."""
        self.readbacks = 0
        """Boundaries that read their slots back (no list published for their step)."""

    def publish(self, rids: Sequence[str], seq_lens: Sequence[int], slots: list[int]) -> None:
        """The decode step of ``rids`` (``seq_lens``: their lengths with the new token) was
        allocated ``slots`` (one a request, read by the allocation's hook just now)."""
        if not len(rids) == len(seq_lens) == len(slots):
            raise ValueError(f"host slots: {len(slots)} slots published for {len(rids)} requests "
                             f"and {len(seq_lens)} lengths")
        self._step, self._slots = (list(rids), [int(n) for n in seq_lens]), slots

    def read(self, rids: Sequence[str], seq_lens: Sequence[int] | np.ndarray, tensor: torch.Tensor) -> list[int]:
        """``tensor.tolist()`` for the decode step of ``rids`` at ``seq_lens``: the published list
        when that step is the one published (taken once), else read from ``tensor`` (on a GPU, a
        host sync)."""
        step, self._step = self._step, None
        if (step is not None and len(self._slots) == tensor.numel() and step[0] == list(rids)
                and step[1] == [int(n) for n in seq_lens]):
            self.handoffs += 1
            return self._slots
        self.readbacks += 1
        return tensor.tolist()
