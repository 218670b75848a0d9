"""``StepStatsWriter``: one JSON line per scheduler step (TP rank 0, ``$KVPLANE_STATS_FILE``).

A line holds the step (mode, time, whether it was reported to the control plane), the requests
(running with their GPU layers and SLOs, paused, queued, finished), the admission gate's
counters, the control plane's state (fallback), the layered pool's residency stats (``pool``,
plus ``device_pages_used`` / ``device_pages_total`` / ``host_fraction`` at top level) and what
the step boundary did (:attr:`sglang_ext.step_boundary.StepBoundary.record`: admitted, paused,
resumed, decision, install delta). ``kvplane demo``, the benchmarks and the server tests read it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

import structlog

from controlplane.api import StepReport

log = structlog.get_logger(__name__)


def stats_dict(stats: Any) -> dict[str, Any] | None:
    """A dataclass's flat (number, bool, str) fields as a dict; None for anything else."""
    if stats is None:
        return None
    if is_dataclass(stats) and not isinstance(stats, type):
        # flat fields read directly: ``asdict`` deep-copies, which costs more than the rest of
        # the per-step stats line
        values = ((f.name, getattr(stats, f.name)) for f in dataclasses.fields(stats))
        return {k: v for k, v in values if isinstance(v, int | float | bool | str)}
    return None


class StepStatsWriter:
    """Appends one JSON object per line to a file (flushed per line)."""

    def __init__(self, path: str | Path) -> None:
        self._file = Path(path).open("a", buffering=1)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def write_step(
        self,
        *,
        step: int,
        report: StepReport,
        step_ms: float | None,
        is_decode: bool,
        reported: bool,
        layers: int,
        pool_stats: Any,
        boundary: dict[str, Any],
        admission: Any,
        installer: Any,
        client: Any,
        report_quiet: bool = False,
    ) -> None:
        """Write the line of one step (never raises: a failed write is logged). ``report_quiet``:
        the step's report waited past ``--kv-report-interval`` (the quiet cadence)."""
        pool = stats_dict(pool_stats)
        record: dict[str, Any] = {
            "step": step,
            "time_s": round(time.time(), 6),
            "mode": "decode" if is_decode else "extend",
            "step_ms": None if step_ms is None else round(step_ms, 3),
            "reported": reported,
            "report_quiet": report_quiet,
            "running": [r.id for r in report.running if not r.paused],
            "slo_tbt_ms": {r.id: r.slo_tbt_ms for r in report.running if r.slo_tbt_ms is not None},
            "held_total": admission.held_total,
            "local_admits": admission.local_admits,
            "paused": [r.id for r in report.running if r.paused],
            "queued": len(report.queued),
            "finished": list(report.finished),
            "pauses_dropped": list(report.pauses_dropped),
            "gpu_layers": {
                rid: sum(w.gpu_layers) for rid, w in installer.last_wants.items() if not w.paused
            },
            "layers": layers,
            "layer_compute_ms": None if report.layer_compute_ms is None else [round(x, 4) for x in report.layer_compute_ms],
            "h2d_gbps": report.h2d_gbps,
            "layered_pool": installer.layered,
            "fallback": bool(client is not None and client.in_fallback),
            "fallback_steps": 0 if client is None else client.fallback_steps,
            "free_gpu_blocks": report.free_gpu_blocks,
            "pool": pool,
            **{k: v for k, v in boundary.items() if k != "fallback"},
        }
        for key in ("device_pages_used", "device_pages_total", "host_fraction"):
            record[key] = None if pool is None else pool.get(key)
        try:
            self.write(record)
        except Exception:
            log.warning("stats_write_failed", exc_info=True)
