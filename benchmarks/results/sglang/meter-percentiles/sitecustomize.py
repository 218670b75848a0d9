"""A measurement aid, not part of kvplane: loaded by a layered SGLang server through
``PYTHONPATH``, it keeps every sample the overhead meter adds (``OverheadMeter.add``) and rewrites
``$METHOD_TIMING_FILE.<pid>`` every 5 s with each part's count, mean, p50, p90, p99 (us) and the
share of its time in its slowest 1% of calls. The mean is what the meter reports; the p50 is the
steady step's cost, the rest the rare paths (reports, arrivals, finishes). Driven by
``run.py`` next to this file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


def _summary(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    out = {}
    for part, values in samples.items():
        s = sorted(values)
        n = len(s)
        out[part] = {
            "n": n,
            "mean": sum(s) / n * 1e6,
            "p50": s[n // 2] * 1e6,
            "p90": s[int(n * 0.9)] * 1e6,
            "p99": s[int(n * 0.99)] * 1e6,
            "top1pct_share": sum(s[int(n * 0.99):]) / sum(s),
        }
    return out


def _install(path: str) -> None:
    from sglang_ext import overhead

    samples: dict[str, list[float]] = {}
    original = overhead.OverheadMeter.add

    def add(self: Any, part: str, seconds: float) -> None:
        samples.setdefault(part, []).append(seconds)
        original(self, part, seconds)

    overhead.OverheadMeter.add = add  # type: ignore[method-assign]

    def every_5s() -> None:
        while True:
            time.sleep(5.0)
            if samples:
                with open(f"{path}.{os.getpid()}", "w", encoding="utf-8") as out:
                    json.dump(_summary(samples), out)

    threading.Thread(target=every_5s, daemon=True, name="meter-percentiles").start()


_PATH = os.environ.get("METHOD_TIMING_FILE")
if _PATH:
    _install(_PATH)
