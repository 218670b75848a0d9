"""kvplane's own time in a scheduler process, against the scheduler loop it runs in.

End-to-end tokens/s of two server launches on a small shared host differ by up to 25% from one
launch to the next, more than the few percent kvplane adds with nothing offloaded. This meter
measures kvplane's share inside one process instead, so launch effects cancel: the wall time
spent in kvplane's scheduler hooks (step boundary, post-schedule install, the step's timing
brackets, step end), in the radix cache's allocation hooks and in the layered attention (per-step
preparation, per-layer calls, the layers' KV writes), against the wall time of the steps themselves.

Opt-in: with ``$KVPLANE_OVERHEAD_FILE`` set (and the flag on), the process's
:class:`~sglang_ext.context.PluginContext` holds an :class:`OverheadMeter`, which the scheduler
hooks fill and TP rank 0 rewrites to that JSON file every :data:`WRITE_EVERY` steps and when the
scheduler goes idle after steps (the scheduler is usually killed, not exited: a reader that waits
for the server to finish its work reads every step, not the steps up to the last multiple of
:data:`WRITE_EVERY`). Without it the meter is None and the hooks pay one attribute read.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from sglang_ext import settings

OVERHEAD_FILE_ENV = settings.OVERHEAD_FILE_ENV
WRITE_EVERY = 64
"""Steps between two writes of the file."""


class OverheadMeter:
    """Accumulates kvplane seconds and step seconds; not thread-safe (the scheduler thread)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.kvplane_s: dict[str, float] = {}
        self.idle_s = 0.0
        """kvplane time in scheduler iterations that ran no step (kept apart: no step waited on it)."""
        self.counts: dict[str, int] = {}
        """Events per name (:meth:`count`)."""
        self.calls: dict[str, int] = {}
        """Measurements added per part (:meth:`add`): e.g. ``kv_write`` once per layer and forward."""
        self.steps = 0
        self.step_s = 0.0
        self._last_end: float | None = None
        self._written = 0
        """Steps the file holds."""

    def add(self, part: str, seconds: float) -> None:
        self.kvplane_s[part] = self.kvplane_s.get(part, 0.0) + seconds
        self.calls[part] = self.calls.get(part, 0) + 1

    def count(self, name: str) -> None:
        """Count one event (e.g. which preparation path a step took)."""
        self.counts[name] = self.counts.get(name, 0) + 1

    def idle(self, kvplane_seconds: float = 0.0) -> None:
        """The scheduler found nothing to run: the time until the next step is not step time, and
        the ``kvplane_seconds`` this iteration spent (its boundary) delayed no step either."""
        self._last_end = None
        self.idle_s += kvplane_seconds
        if self.steps != self._written:  # the first idle iteration after steps: the file holds them all
            self.write()

    def step_done(self) -> None:
        """End of a scheduler step: the time since the previous step's end is step time (unless
        the scheduler idled in between, :meth:`idle`)."""
        now = time.perf_counter()
        if self._last_end is not None:
            self.steps += 1
            self.step_s += now - self._last_end
        self._last_end = now
        if self.steps and self.steps % WRITE_EVERY == 0 and self.steps != self._written:
            self.write()

    def summary(self) -> dict[str, object]:
        total = sum(self.kvplane_s.values())
        return {
            "steps": self.steps,
            "step_s": round(self.step_s, 6),
            "kvplane_s": round(total, 6),
            "parts_s": {k: round(v, 6) for k, v in sorted(self.kvplane_s.items())},
            "idle_kvplane_s": round(self.idle_s, 6),
            "counts": dict(sorted(self.counts.items())),
            "calls": dict(sorted(self.calls.items())),
            "kvplane_ms_per_step": round(1e3 * total / self.steps, 4) if self.steps else None,
            "share_pct": round(100.0 * total / (self.step_s - total), 3) if self.step_s > total else None,
        }

    def write(self) -> None:
        self._written = self.steps
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.summary()))
        tmp.replace(self.path)


def share_of(summary: dict[str, object]) -> float | None:
    """``share_pct`` of a written summary: kvplane time / (step time - kvplane time), in %."""
    value = summary.get("share_pct")
    return float(value) if isinstance(value, int | float) else None
