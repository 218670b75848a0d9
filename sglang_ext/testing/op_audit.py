"""OpAudit: records the aten ops kvplane runs inside each layer, and flags host synchronisations.

GPU discipline, enforced on CPU: inside a layer kvplane may issue only stream waits, table-row
views and kernel launches. An op that makes the host wait for a CUDA stream is a bug there even
when this CPU host cannot feel it:

- ``_local_scalar_dense`` (``item()``, ``int()``/``bool()``/``float()`` of a tensor),
- ``nonzero`` / ``masked_select`` / ``unique`` family (output size depends on device data),
- ``repeat_interleave`` without ``output_size``,
- a copy into a host tensor that is not pinned from another device (pageable D2H),
- a host read of a tensor (``tolist``, ``numpy``, ``cpu``, ``item``, ``__array__``): on a CPU host
  these never reach the dispatcher as a device-to-host copy, so while the audit is entered they
  are flagged by name inside a scope (kvplane's per-layer code keeps its host data in NumPy and
  never reads a tensor back).

Use: ``with OpAudit() as audit:`` then ``with audit.scope(layer): ...`` around kvplane's calls
of that layer; ``audit.ops[layer]`` lists the op names seen, ``audit.violations`` the flagged
ones. ``audit_core(core, audit)`` wraps a :class:`LayeredKVCore`'s per-layer calls.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset({
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.nonzero_static.default",
    "aten.masked_select.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.is_nonzero.default",
})
"""Ops whose result the host must wait for (their output size or value lives on the device)."""


def _pageable_d2h(func: Any, args: tuple, kwargs: dict) -> bool:
    name = str(func)
    if name.startswith("aten.copy_"):
        dst, src = args[0], args[1]
        return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                and src.device.type != "cpu" and dst.device.type == "cpu" and not dst.is_pinned())
    if name.startswith("aten._to_copy"):
        src = args[0]
        device = kwargs.get("device")
        to_cpu = device is not None and torch.device(device).type == "cpu"
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and to_cpu and not kwargs.get("pin_memory")
    return False


def data_dependent(name: str, args: tuple, kwargs: dict) -> bool:
    """An op whose output size the device decides, read back by the host on CUDA:
    ``repeat_interleave`` without ``output_size``, and indexing (``x[mask]``, ``x[mask] = v``) by
    a bool or uint8 mask, which runs ``nonzero`` inside the op (below where a dispatch mode sees
    it)."""
    if name.startswith("aten.repeat_interleave"):
        return kwargs.get("output_size") is None
    if name.startswith(("aten.index.", "aten.index_put", "aten._index_put_impl_")) and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())
    return False


HOST_READS = ("tolist", "numpy", "cpu", "item", "__array__")
"""``torch.Tensor`` methods that read a tensor back to the host (flagged by name in a scope)."""


@contextmanager
def hooked_host_reads(on_read: Callable[[str], None]) -> Iterator[None]:
    """Inside the block each :data:`HOST_READS` method of ``torch.Tensor`` calls ``on_read(name)``
    before it reads (which may record or raise); the real methods come back on exit."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def hooked(name: str, real: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            on_read(name)
            return real(tensor, *args, **kwargs)

        return read

    for name, real in saved.items():
        setattr(torch.Tensor, name, hooked(name, real))
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


class OpAudit(TorchDispatchMode):
    """Per-scope op names and sync violations (see module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[Any, list[str]] = defaultdict(list)
        self.violations: list[tuple[Any, str]] = []
        self._scope: Any = None
        self._hooks: Any = None
        self._depth = 0

    def __enter__(self) -> OpAudit:
        entered = super().__enter__()
        self._depth += 1
        if self._depth == 1:  # the host reads of the module docstring, restored at the outer exit
            self._hooks = hooked_host_reads(self._reading)
            self._hooks.__enter__()
        return entered

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._hooks.__exit__(None, None, None)
                self._hooks = None

    def _reading(self, name: str) -> None:
        if self._scope is not None:
            self.violations.append((self._scope, f"Tensor.{name}"))

    @contextmanager
    def scope(self, label: Any) -> Iterator[None]:
        """Record the ops run inside the block under ``label`` (scopes do not nest)."""
        outer, self._scope = self._scope, label
        try:
            yield
        finally:
            self._scope = outer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._scope is not None:
            name = str(func)
            self.ops[self._scope].append(name)
            if name in SYNC_OPS or _pageable_d2h(func, args, kwargs) or data_dependent(name, args, kwargs):
                self.violations.append((self._scope, name))
        return func(*args, **kwargs)


def audit_core(core: Any, audit: OpAudit) -> None:
    """Wrap a :class:`~sglang_ext.dataplane.layered_kv_core.LayeredKVCore` instance's per-layer
    calls (``enter_layer``, ``write``, ``token_rows``, ``exit_layer``) in ``audit.scope(layer)``."""
    for name in ("enter_layer", "write", "token_rows", "exit_layer"):
        original = getattr(core, name)

        def wrapped(layer: int, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with audit.scope(layer):
                return _original(layer, *args, **kwargs)

        setattr(core, name, wrapped)
