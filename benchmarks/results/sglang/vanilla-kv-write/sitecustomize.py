"""A measurement aid, not part of kvplane: loaded by a *vanilla* SGLang server through
``PYTHONPATH``, it times SGLang's own ``MHATokenToKVPool.set_kv_buffer`` and counts the
scheduler's steps into ``$VANILLA_WRITE_FILE`` (rewritten every 64 steps), so vanilla's per-step
KV-write cost can be read against kvplane's ``kv_write`` meter part (which replaces it).

    PYTHONPATH=benchmarks/results/sglang/vanilla-kv-write:. VANILLA_WRITE_FILE=/tmp/vw.json \\
        kvplane bench sglang --model tiny --configs vanilla-no-overlap --instances 1 --out-dir /tmp/vw

Figures: ``benchmarks/results/sglang/meter-session14-amd-epyc.md``.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import time
from typing import Any

_ORIGINAL_IMPORT = builtins.__import__
_STATS = {"write_s": 0.0, "writes": 0, "steps": 0}
_PATCHED: set[str] = set()


def _timed_write(original: Any) -> Any:
    def set_kv_buffer(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            _STATS["write_s"] += time.perf_counter() - t0
            _STATS["writes"] += 1

    return set_kv_buffer


def _counted_step(original: Any) -> Any:
    def process_batch_result(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _STATS["steps"] += 1
        if _STATS["steps"] % 64 == 0:
            with open(os.environ["VANILLA_WRITE_FILE"], "w") as f:
                json.dump(_STATS, f)
        return result

    return process_batch_result


def _import(name: str, *args: Any, **kwargs: Any) -> Any:
    module = _ORIGINAL_IMPORT(name, *args, **kwargs)
    pool = sys.modules.get("sglang.srt.mem_cache.memory_pool")
    if "pool" not in _PATCHED and pool is not None and hasattr(pool, "MHATokenToKVPool"):
        _PATCHED.add("pool")
        pool.MHATokenToKVPool.set_kv_buffer = _timed_write(pool.MHATokenToKVPool.set_kv_buffer)
    sched = sys.modules.get("sglang.srt.managers.scheduler")
    if "sched" not in _PATCHED and sched is not None and hasattr(getattr(sched, "Scheduler", None), "process_batch_result"):
        _PATCHED.add("sched")
        sched.Scheduler.process_batch_result = _counted_step(sched.Scheduler.process_batch_result)
    return module


if os.environ.get("VANILLA_WRITE_FILE"):
    builtins.__import__ = _import
