"""DeferredDevice: a paged decode step's device tables made only if an eager forward reads them.

A step's tables have a host half (page lists, rows, CSR, fetch lists, write-back indices: NumPy)
and a device half (one upload, the page tables gathered from the map mirror, the views the layers
read). A step that a CUDA graph replays never reads the device half: the graph's buffers are
sent from the host half (:class:`~sglang_ext.dataplane.step_block.StepBlock`) and gather their
own page tables. Building it anyway cost a replayed step's boundary an upload, a gather and
~20 views (session 70's probe), host time on a GPU host for nothing.

So a boundary told that a graph may take its step (``LayeredKVCore.defer_tables``) packs the host
half and stops (:meth:`_finish` with ``defer``); the device half is made by :meth:`materialize`
-- called where a graph admission declines the step, before its eager forward -- or, as a net,
at the first read of any device attribute (:data:`DEVICE_ATTRS`, through ``__getattr__``). Made
later, it is the same: the tables of a step are read in that step, the map mirror they gather
from has not moved since they were built (a graph admission checks; an eager step's layers raise
if it moved), and the upload is of the host half packed at the boundary. The store counts both
(``deferred_tables``, ``materialized_tables``): on a steady graph-served run the second is the
declined steps only.
"""

from __future__ import annotations

from typing import Any

DEVICE_ATTRS = frozenset({"i64", "i32", "_i32_host", "tab", "rows", "kv_indptr", "kv_lens", "last_page_len",
                          "_lens_pair", "host_indptr", "_host_lens_pair", "host_last_page_len"})
"""What the device half sets (:meth:`~sglang_ext.dataplane.step_tables.StepTables._send_packed`,
``_bind_csr``, the page tables and rows)."""


class DeferredDevice:
    """The deferral of a tables object's device half (module docstring); the class using it
    provides ``_store`` and ``_materialize_now`` (the device half from the packed host half)."""

    _pending: bool = False
    _store: Any

    def _materialize_now(self) -> None:
        raise NotImplementedError

    def _finish(self, defer: bool) -> None:
        """The host half is packed: make the device half now, or (``defer``) when first read."""
        if defer:  # what a successor copied of its predecessor's device half is not this step's
            for name in DEVICE_ATTRS.intersection(self.__dict__):
                del self.__dict__[name]
            self._pending = True
            self._store.deferred_tables += 1
        else:
            self._materialize_now()

    @property
    def pending(self) -> bool:
        """The device half is not made yet."""
        return self._pending

    def materialize(self) -> None:
        """Make the device half if it is pending (a step a graph declined, before its forward)."""
        if self._pending:
            self._materialize_now()  # raised: still pending (a later read retries)
            self._pending = False
            self._store.materialized_tables += 1

    def __getattr__(self, name: str) -> Any:
        if name in DEVICE_ATTRS and self.__dict__.get("_pending"):
            self.materialize()
            return self.__dict__[name]
        rest = getattr(super(), "__getattr__", None)  # the host half's own lazy parts (StepTables)
        if rest is not None:
            return rest(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
