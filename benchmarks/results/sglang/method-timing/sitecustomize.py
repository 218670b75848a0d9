"""A measurement aid, not part of kvplane: loaded by a layered SGLang server through
``PYTHONPATH``, it wraps the methods named in ``$METHOD_TIMING_TARGETS`` (comma list of
``module:Class.method`` or ``module:function``) with wall-clock accumulators and rewrites
``$METHOD_TIMING_FILE.<pid>`` (JSON ``{target: [calls, seconds]}``) every 5 s and at exit.

Each wrapper adds about 1 us per call. Driven by ``time_methods.py`` next to this file, which
prints the figures per call and per scheduler step against the overhead meter's parts.

With ``$METER_PERCENTILES_FILE`` set it also keeps every sample the overhead meter adds
(``OverheadMeter.add``) and rewrites ``$METER_PERCENTILES_FILE.<pid>`` every 5 s with each part's
count, mean, p50, p90, p99 (us) and the share of its time in its slowest 1% of calls: the mean is
what the meter reports, the p50 the steady step's cost, the rest the rare paths.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import threading
import time
from typing import Any

_STATS: dict[str, list[float]] = {}
_PROFILE: Any = None
"""A ``cProfile.Profile`` enabled only inside the targets (``$METHOD_PROFILE=1``), dumped beside
the timings as ``$METHOD_TIMING_FILE.<pid>.prof`` (outermost target calls only)."""


def _wrap(owner: Any, name: str, key: str) -> None:
    original = getattr(owner, name)
    record = _STATS.setdefault(key, [0, 0.0])

    def timed(*args: Any, **kwargs: Any) -> Any:
        outer = _PROFILE is not None and not _DEPTH[0]
        if outer:
            _PROFILE.enable()
        _DEPTH[0] += 1
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            record[0] += 1
            record[1] += time.perf_counter() - t0
            _DEPTH[0] -= 1
            if outer:
                _PROFILE.disable()

    timed.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, timed)


_DEPTH = [0]


def _dump(path: str) -> None:
    with open(f"{path}.{os.getpid()}", "w", encoding="utf-8") as out:
        json.dump({k: v for k, v in _STATS.items() if v[0]}, out)
    if _PROFILE is not None and any(v[0] for v in _STATS.values()):
        _PROFILE.dump_stats(f"{path}.{os.getpid()}.prof")


def _install(path: str, targets: list[str]) -> None:
    for target in targets:
        module, _, attr = target.partition(":")
        try:
            owner: Any = importlib.import_module(module)
            *parents, name = attr.split(".")
            for part in parents:
                owner = getattr(owner, part)
            _wrap(owner, name, target)
        except Exception as exc:  # a wrong target is reported in the file, never fatal
            _STATS[f"error:{target}:{exc!r}"] = [1, 0.0]

    def every_5s() -> None:
        while True:
            time.sleep(5.0)
            _dump(path)

    threading.Thread(target=every_5s, daemon=True, name="method-timing").start()
    atexit.register(_dump, path)


def _percentiles(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
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


def _install_percentiles(path: str) -> None:
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
                    json.dump(_percentiles(samples), out)

    threading.Thread(target=every_5s, daemon=True, name="meter-percentiles").start()


_PERCENTILES = os.environ.get("METER_PERCENTILES_FILE")
if _PERCENTILES:
    _install_percentiles(_PERCENTILES)

_PATH = os.environ.get("METHOD_TIMING_FILE")
_TARGETS = [t for t in os.environ.get("METHOD_TIMING_TARGETS", "").split(",") if t]
if _PATH and _TARGETS:
    if os.environ.get("METHOD_PROFILE") == "1":
        import cProfile

        _PROFILE = cProfile.Profile()
    _install(_PATH, _TARGETS)
