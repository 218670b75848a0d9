"""HostProfileProbe: where kvplane's host time goes inside a decode step, by function.

`kvplane gpu-check` reports kvplane's host time per step split by call (the boundary, and each
layer's ``enter`` / ``write`` / ``exit``). On a GPU host that time is mostly Python and launch
overhead, which this CPU-only project cannot measure where it matters. This probe runs
:mod:`cProfile` only inside kvplane's scopes -- the step boundary (``prepare_step`` /
``prepare_decode_step``) and the per-layer calls, never the attention or the model's matmuls --
and keeps the functions with the most own time, per step. A GPU run's JSON then says which
function (a torch op, a Triton launch, NumPy, kvplane's Python) to attack next. cProfile adds
about a microsecond per call: the ranking is the point, not the absolute figures (those are
:class:`~sglang_ext.tools.gpu_check_probes.CpuTimeProbe`'s).
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TOP = 25
"""Functions kept per profile (by own time)."""
_ROOT = str(Path(__file__).resolve().parents[2]) + "/"
"""The repository root: a profiled file under it is named relative to it."""


class HostProfileProbe:
    """cProfile inside kvplane scopes (module docstring); ``scope`` fits ``CoreCheck.step`` and
    ``boundary`` fits ``CheckBatch.boundary_scope``."""

    def __init__(self) -> None:
        self.profile = cProfile.Profile()
        self.steps = 0
        """Steps profiled (the caller counts them: figures are per step)."""

    @contextmanager
    def scope(self, kind: str, layer: int, part: str = "") -> Iterator[None]:
        if kind != "kvplane":
            yield
            return
        with self.boundary():
            yield

    @contextmanager
    def boundary(self) -> Iterator[None]:
        self.profile.enable()
        try:
            yield
        finally:
            self.profile.disable()

    def top(self, n: int = TOP) -> list[dict[str, object]]:
        """The ``n`` functions with the most own time: name, calls, own and cumulative ms, per step."""
        steps = max(1, self.steps)
        stats = pstats.Stats(self.profile).stats  # type: ignore[attr-defined]
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
        return [{"function": _name(func), "calls_per_step": round(nc / steps, 2),
                 "own_ms_per_step": round(tt * 1e3 / steps, 4), "cum_ms_per_step": round(ct * 1e3 / steps, 4)}
                for func, (_cc, nc, tt, ct, _callers) in rows]


def _name(func: tuple[str, int, str]) -> str:
    """``path:line(function)``, the path relative to the repository or site-packages."""
    filename, line, name = func
    filename = filename.removeprefix(_ROOT)
    if "site-packages/" in filename:
        filename = filename.split("site-packages/", 1)[1]
    return f"{filename}:{line}({name})" if line else name
