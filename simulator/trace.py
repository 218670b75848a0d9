"""Workload traces: generation from named distributions, JSONL load/save.

A trace is a JSONL file, one request per line::

    {"id": "r0", "arrival_ms": 0.0, "prompt_tokens": 812, "output_tokens": 1536,
     "slo_ttft_ms": 6000.0, "slo_tbt_ms": 40.6}

User traces in this format load with :func:`load_trace` (lines starting with ``#`` and a
``{"meta": ...}`` line are skipped). Generation is deterministic under ``TraceSpec.seed``.

Named length distributions (``WORKLOADS``):

* ``sharegpt``: ShareGPT-like chat mix. Log-normal prompt (median 150, sigma 1.0, clipped to
  [4, 2300] as LayerKV §5.1 reports 4..2.3K) and output (median 200, sigma 0.9, [4, 2048]).
* ``orbitflow-32k``: OrbitFlow long-context bins (§5.1, Fig. 7) up to 32K: prompt bins 1-4K,
  4-8K, 8-16K, 16-24K (weights .4/.3/.2/.1), log-uniform output 256..4096, total <= 32K.
* ``orbitflow-128k``: the same up to 128K (prompt bins 4-16K .. 64-120K, output 512..8192).
* ``orbitflow-stress``: ``orbitflow-32k`` with the long bins dominant (OrbitFlow Fig. 14c's
  "increased fraction of long requests").
* ``leval``: L-Eval-like long prompts, short answers (prompt 3K..16K log-uniform, output 64..512).

Arrivals: ``poisson``; ``gamma`` or ``lognormal`` gaps with coefficient of variation ``cv``.

SLOs as OrbitFlow §5.1: the base TBT SLO is the decode latency of the longest request the GPU
serves without offloading (:meth:`SimProfile.base_tbt_slo_ms`), multiplied by ``slo_scale``. The
paper gives no TTFT SLO; ours is ``slo_scale * max(1 s, 5 * prefill time of the prompt alone)``.
Both can be fixed instead (``slo_tbt_ms`` / ``slo_ttft_ms``, e.g. SuperInfer's 100 ms / 5 s).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from simulator.profile import SimProfile

WORKLOADS = ("sharegpt", "orbitflow-32k", "orbitflow-128k", "orbitflow-stress", "leval")
ARRIVALS = ("poisson", "gamma", "lognormal")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    id: str
    """Unique id."""
    arrival_ms: float
    """Arrival time, ms from the trace start."""
    prompt_tokens: int
    """Prompt length."""
    output_tokens: int
    """Tokens to generate (known to the server as max_new_tokens)."""
    slo_ttft_ms: float
    """Time-to-first-token SLO."""
    slo_tbt_ms: float
    """Time-between-tokens SLO (also the TPOT target)."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"trace.id: expected a non-empty string, got {self.id!r}")
        for name in ("prompt_tokens", "output_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"trace[{self.id}].{name}: {v!r} is out of range (allowed >= 1)")
        for name in ("arrival_ms", "slo_ttft_ms", "slo_tbt_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"trace[{self.id}].{name}: expected a finite number, got {v!r}")
            if v < 0 or (v == 0 and name != "arrival_ms"):
                raise ValueError(f"trace[{self.id}].{name}: {v} is out of range (allowed > 0)")


@dataclass(frozen=True)
class TraceSpec:
    """How to generate a trace."""

    workload: str = "orbitflow-32k"
    """One of WORKLOADS."""
    n_requests: int = 40
    """Number of requests."""
    rate_per_min: float = 1.0
    """Mean arrival rate, requests per minute."""
    arrival: str = "poisson"
    """One of ARRIVALS."""
    cv: float = 1.0
    """Coefficient of variation of inter-arrival gaps (gamma/lognormal)."""
    slo_scale: float = 1.5
    """Multiplier on the base SLOs (OrbitFlow §5.1)."""
    seed: int = 0
    """RNG seed."""
    slo_tbt_ms: float | None = None
    """Fixed TBT SLO instead of the scaled profile base."""
    slo_ttft_ms: float | None = None
    """Fixed TTFT SLO instead of the scaled default."""
    output_scale: float = 1.0
    """Multiplier on sampled output lengths (smoke runs use short outputs)."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"trace.workload: {self.workload!r} is not one of {WORKLOADS}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"trace.arrival: {self.arrival!r} is not one of {ARRIVALS}")
        if isinstance(self.n_requests, bool) or not isinstance(self.n_requests, int) or not (
            1 <= self.n_requests <= 1_000_000
        ):
            raise ValueError(f"trace.n_requests: {self.n_requests!r} is out of range [1, 1e6]")
        for name, lo, hi in (("rate_per_min", 0.0, 1e7), ("cv", 0.0, 100.0),
                             ("slo_scale", 0.0, 1000.0), ("output_scale", 0.0, 100.0)):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not (lo < v <= hi):
                raise ValueError(f"trace.{name}: {v!r} is out of range (allowed ({lo}, {hi}])")
        for name in ("slo_tbt_ms", "slo_ttft_ms"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int | float) or v <= 0):
                raise ValueError(f"trace.{name}: {v!r} is out of range (allowed > 0)")


def _log_uniform(rng: random.Random, lo: float, hi: float) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _lognormal_clipped(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(rng.lognormvariate(math.log(median), sigma)))))


def _binned(rng: random.Random, bins: list[tuple[int, int]], weights: list[float]) -> int:
    lo, hi = rng.choices(bins, weights=weights)[0]
    return _log_uniform(rng, lo, hi)


def sample_lengths(workload: str, rng: random.Random) -> tuple[int, int]:
    """(prompt_tokens, output_tokens) for one request of ``workload``."""
    if workload == "sharegpt":
        return (_lognormal_clipped(rng, 150, 1.0, 4, 2300),
                _lognormal_clipped(rng, 200, 0.9, 4, 2048))
    if workload in ("orbitflow-32k", "orbitflow-stress"):
        bins = [(1024, 4096), (4096, 8192), (8192, 16384), (16384, 24576)]
        weights = [0.4, 0.3, 0.2, 0.1] if workload == "orbitflow-32k" else [0.1, 0.2, 0.35, 0.35]
        prompt = _binned(rng, bins, weights)
        out = _log_uniform(rng, 256, 4096)
        return prompt, max(1, min(out, 32768 - prompt))
    if workload == "orbitflow-128k":
        bins = [(4096, 16384), (16384, 32768), (32768, 65536), (65536, 122880)]
        prompt = _binned(rng, bins, [0.4, 0.3, 0.2, 0.1])
        out = _log_uniform(rng, 512, 8192)
        return prompt, max(1, min(out, 131072 - prompt))
    if workload == "leval":
        return _log_uniform(rng, 3072, 16384), _log_uniform(rng, 64, 512)
    raise ValueError(f"workload {workload!r} is not one of {WORKLOADS}")


def _gaps(spec: TraceSpec, rng: random.Random) -> Iterable[float]:
    mean_ms = 60_000.0 / spec.rate_per_min
    for _ in range(spec.n_requests):
        if spec.arrival == "poisson":
            yield rng.expovariate(1.0 / mean_ms)
        elif spec.arrival == "gamma":
            shape = 1.0 / (spec.cv**2)
            yield rng.gammavariate(shape, mean_ms / shape)
        else:
            s2 = math.log1p(spec.cv**2)
            yield rng.lognormvariate(math.log(mean_ms) - s2 / 2, math.sqrt(s2))


def generate_trace(spec: TraceSpec, profile: SimProfile) -> list[TraceRequest]:
    """Requests of ``spec`` with SLOs scaled from ``profile`` (deterministic under the seed)."""
    rng = random.Random(spec.seed)
    base_tbt = spec.slo_tbt_ms if spec.slo_tbt_ms is not None else (
        spec.slo_scale * profile.base_tbt_slo_ms()
    )
    out: list[TraceRequest] = []
    t = 0.0
    for i, gap in enumerate(_gaps(spec, rng)):
        if i > 0:
            t += gap
        prompt, output = sample_lengths(spec.workload, rng)
        output = max(1, int(round(output * spec.output_scale)))
        ttft = spec.slo_ttft_ms if spec.slo_ttft_ms is not None else (
            spec.slo_scale * max(1000.0, 5.0 * profile.prefill_ms(prompt))
        )
        out.append(TraceRequest(f"r{i}", round(t, 3), prompt, output, round(ttft, 3),
                                round(base_tbt, 4)))
    return out


def save_trace(requests: Iterable[TraceRequest], path: str | Path, meta: dict | None = None) -> None:
    with open(path, "w") as f:
        if meta is not None:
            f.write(json.dumps({"meta": meta}) + "\n")
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace; errors name the line and the field."""
    out: list[TraceRequest] = []
    seen: set[str] = set()
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc})") from exc
            if not isinstance(d, dict):
                raise ValueError(f"{path}:{lineno}: expected an object")
            if "meta" in d and "id" not in d:
                continue
            missing = [k for k in ("id", "arrival_ms", "prompt_tokens", "output_tokens",
                                   "slo_ttft_ms", "slo_tbt_ms") if k not in d]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing fields {missing}")
            try:
                req = TraceRequest(str(d["id"]), float(d["arrival_ms"]), d["prompt_tokens"],
                                   d["output_tokens"], float(d["slo_ttft_ms"]),
                                   float(d["slo_tbt_ms"]))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
            if req.id in seen:
                raise ValueError(f"{path}:{lineno}: duplicate id {req.id!r}")
            seen.add(req.id)
            out.append(req)
    out.sort(key=lambda r: (r.arrival_ms, r.id))
    return out
