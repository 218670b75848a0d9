"""Step probes of `kvplane gpu-check`: what a decode step's layers cost the host.

A probe's ``scope(kind, layer)`` wraps one call inside a layer; ``kind`` is ``kvplane`` (the
core's ``enter_layer`` / ``write`` / ``exit_layer``) or ``attention`` (the paged decode kernel).

- :class:`CpuTimeProbe`: thread CPU time spent in ``kvplane`` scopes (plus the step's
  ``prepare_step``, added by the caller).
- :class:`SyncProbe`: host synchronisations inside the scopes. On CUDA the runtime counts them:
  ``torch.cuda.set_sync_debug_mode("warn")`` is on inside each scope and every "synchronizing"
  warning is one sync. On every device the :class:`~sglang_ext.testing.op_audit.OpAudit`
  (a ``TorchDispatchMode``) records the aten ops that would make the host wait for a GPU
  (``item``, ``nonzero``, ``unique``, pageable D2H, ...): the count on the CPU, a cross-check on
  CUDA.
"""

from __future__ import annotations

import functools
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from sglang_ext.testing.op_audit import OpAudit

KINDS = ("kvplane", "attention")
SITE_FRAMES = 6
"""Python frames recorded per sync site."""
SYNC_WARNING = "called a synchronizing CUDA operation"
"""What torch warns for each sync in ``warn`` mode (c10/cuda/CUDAFunctions.cpp)."""


class CpuTimeProbe:
    """Thread CPU seconds inside ``kvplane`` scopes, in total and per ``part`` (the call: a
    layer's ``enter``, ``write`` or ``exit``), so a GPU run says which call costs the host."""

    def __init__(self) -> None:
        self.kvplane_s = 0.0
        self.parts_s: Counter[str] = Counter()

    @contextmanager
    def scope(self, kind: str, layer: int, part: str = "") -> Iterator[None]:
        if kind != "kvplane":
            yield
            return
        t0 = time.thread_time()
        try:
            yield
        finally:
            dt = time.thread_time() - t0
            self.kvplane_s += dt
            self.parts_s[part] += dt


class SyncProbe:
    """Host syncs per scope kind (see module docstring); use as ``with probe: <steps>``."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.audit = OpAudit()
        self.runtime: Counter[str] = Counter()
        """Kind -> syncs the CUDA runtime reported (CUDA only)."""
        self.sites: Counter[tuple[str, str]] = Counter()
        """(kind, ``file:line`` of the Python call that synchronised) -> times (CUDA only): where
        a reported sync came from, so one GPU run says what to fix."""

    def __enter__(self) -> SyncProbe:
        self.audit.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.audit.__exit__(*exc)

    @contextmanager
    def scope(self, kind: str, layer: int, part: str = "") -> Iterator[None]:
        with self.audit.scope((kind, layer)):
            if not self.cuda:
                yield
                return
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = functools.partial(self._seen, kind)
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode(0)

    def _seen(self, kind: str, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        """A warning inside a scope (CUDA): a sync is counted with the Python frames that led to
        it, innermost last, outside this module and the standard library's warnings."""
        if SYNC_WARNING not in str(message):  # not e.g. the mode's own "prototype feature" notice
            return
        self.runtime[kind] += 1
        frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(("warnings.py", __file__))]
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1] if '/' in f.filename else f.filename}:{f.lineno}"
                            for f in reversed(frames[-SITE_FRAMES:]))
        self.sites[(kind, f"{filename}:{lineno} <- {where}")] += 1

    def where(self, kind: str) -> dict[str, int]:
        """``file:line`` -> syncs reported there inside ``kind`` scopes (CUDA only)."""
        return {site: n for (k, site), n in self.sites.items() if k == kind}

    def audited(self, kind: str) -> Counter[str]:
        """Op name -> times the OpAudit flagged it inside ``kind`` scopes."""
        return Counter(op for (k, _), op in self.audit.violations if k == kind)

    def syncs(self, kind: str) -> int:
        """The count this device trusts: the runtime's on CUDA, the OpAudit's on the CPU."""
        return self.runtime[kind] if self.cuda else sum(self.audited(kind).values())
