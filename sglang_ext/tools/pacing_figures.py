"""What a streaming client saw, from SGLang's bench_serving per-request details (`kvplane bench
pacing`, :mod:`sglang_ext.tools.pacing_bench`).

bench_serving (``--output-details``) records, per request, its TTFT and the inter-token latencies
(ITL: the gap between two text chunks, split evenly over the chunk's new tokens) in seconds, as the
client received them -- after kvplane's token-deposit pacing, if on. :class:`PacingFigures` turns
those lists into the figures the pacing default is chosen from:

* ITL percentiles (p50 / p90 / p99, mean, max) over every gap of every completed request, and TTFT
  p50 / p99 -- percentiles interpolate linearly between order statistics, as bench_serving's own
  (``numpy.percentile``);
* TBT-SLO attainment: the fraction of gaps ``<=`` the SLO, and the fraction of requests with at
  least :data:`REQUEST_GAP_SHARE` of their gaps within it (a request with no gap -- one output
  token -- meets it, as ``kvplane:tbt_slo_requests_total`` counts it); also the fraction of gaps
  within the SLO plus :data:`JITTER_TOLERANCE` (a paced stream's gaps sit exactly at the SLO on
  the server's clock, so the client sees about half of them a few ms over it);
* what pacing trades: the fraction of gaps under :data:`BURST_GAP_MS` (tokens released together,
  e.g. a paced stream's finish burst) and each request's longest gap (the longest stall its client
  saw; p50 and max over requests).

:func:`replay_paced` passes an unpaced stream's token arrivals through the pacing rule itself
(:class:`~controlplane.controller.token_deposit.TokenDeposit`, what the server's pacer runs): the
gaps the same client would have seen from the same generation had the stream been paced -- a
comparison that host noise between two runs cannot blur.

Pure: no SGLang, no I/O beyond parsing the text given.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.controller.token_deposit import TokenDeposit

REQUEST_GAP_SHARE = 0.9
"""A request meets the TBT SLO when at least this share of its gaps is within the SLO."""
BURST_GAP_MS = 1.0
"""Gaps shorter than this count as tokens released together (a burst)."""
JITTER_TOLERANCE = 0.05
"""``gap_attainment_tolerant`` counts gaps up to ``(1 + JITTER_TOLERANCE) x SLO``."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, linear between order statistics
    (``numpy.percentile``'s default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: {q} is out of range [0, 100]")
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _ms(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class PacingFigures:
    """Client-side streaming figures of one bench_serving run (times in ms)."""

    slo_tbt_ms: float
    """The TBT SLO the gaps are judged against."""
    requests: int
    """Completed requests (their ITL lists are the input)."""
    gaps: int
    """Inter-token gaps over all completed requests."""
    itl_p50_ms: float | None
    """Median gap."""
    itl_p90_ms: float | None
    """90th-percentile gap."""
    itl_p99_ms: float | None
    """99th-percentile gap."""
    itl_mean_ms: float | None
    """Mean gap (pacing moves no token later than the finish, so it barely moves the mean)."""
    itl_max_ms: float | None
    """Longest gap."""
    ttft_p50_ms: float | None
    """Median time to first token."""
    ttft_p99_ms: float | None
    """99th-percentile time to first token."""
    gap_attainment: float | None
    """Fraction of gaps <= the SLO."""
    gap_attainment_tolerant: float | None
    """Fraction of gaps <= the SLO x (1 + :data:`JITTER_TOLERANCE`)."""
    request_attainment: float | None
    """Fraction of requests with >= :data:`REQUEST_GAP_SHARE` of their gaps <= the SLO."""
    burst_fraction: float | None
    """Fraction of gaps < :data:`BURST_GAP_MS` (tokens released together)."""
    longest_gap_p50_ms: float | None
    """Median over requests of each request's longest gap."""
    longest_gap_max_ms: float | None
    """Largest over requests of each request's longest gap."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.slo_tbt_ms) and self.slo_tbt_ms > 0):
            raise ValueError(f"slo_tbt_ms: {self.slo_tbt_ms!r} is out of range (0, inf)")
        if self.requests < 0 or self.gaps < 0:
            raise ValueError(f"requests={self.requests}, gaps={self.gaps}: must be >= 0")

    @classmethod
    def from_lists(
        cls, itls_s: Sequence[Sequence[float]], ttfts_s: Sequence[float], slo_tbt_ms: float
    ) -> PacingFigures:
        """Figures from per-request ITL lists and TTFTs in **seconds** (bench_serving's units),
        completed requests only (pair them with :func:`completed_requests`)."""
        if len(itls_s) != len(ttfts_s):
            raise ValueError(f"itls_s has {len(itls_s)} requests, ttfts_s {len(ttfts_s)}")
        per_request = [[1e3 * float(g) for g in itl] for itl in itls_s]
        gaps = [g for req in per_request for g in req]
        ttfts = [1e3 * float(t) for t in ttfts_s]
        slo = float(slo_tbt_ms)
        met = [
            not req or sum(g <= slo for g in req) >= REQUEST_GAP_SHARE * len(req) for req in per_request
        ]
        longest = [max(req) for req in per_request if req]
        return cls(
            slo_tbt_ms=slo,
            requests=len(per_request),
            gaps=len(gaps),
            itl_p50_ms=_ms(percentile(gaps, 50)),
            itl_p90_ms=_ms(percentile(gaps, 90)),
            itl_p99_ms=_ms(percentile(gaps, 99)),
            itl_mean_ms=_ms(sum(gaps) / len(gaps)) if gaps else None,
            itl_max_ms=_ms(max(gaps)) if gaps else None,
            ttft_p50_ms=_ms(percentile(ttfts, 50), 1),
            ttft_p99_ms=_ms(percentile(ttfts, 99), 1),
            gap_attainment=round(sum(g <= slo for g in gaps) / len(gaps), 4) if gaps else None,
            gap_attainment_tolerant=(
                round(sum(g <= slo * (1 + JITTER_TOLERANCE) for g in gaps) / len(gaps), 4) if gaps else None
            ),
            request_attainment=round(sum(met) / len(met), 4) if met else None,
            burst_fraction=round(sum(g < BURST_GAP_MS for g in gaps) / len(gaps), 4) if gaps else None,
            longest_gap_p50_ms=_ms(percentile(longest, 50)),
            longest_gap_max_ms=_ms(max(longest)) if longest else None,
        )


def replay_paced(itl_s: Sequence[float], slo_tbt_ms: float) -> list[float]:
    """The gaps (s) of one stream whose tokens arrived ``itl_s`` apart (after the first), had
    they been released by the token deposit at ``slo_tbt_ms``: the first token at once, then at
    most one per SLO interval while tokens are held, the rest at the finish (the last arrival)."""
    deposit = TokenDeposit(slo_tbt_ms)
    now_ms = 0.0
    deliveries = deposit.generate(now_ms, 1)
    for gap in itl_s:
        now_ms += 1e3 * float(gap)
        deliveries += deposit.generate(now_ms, 1)
    deliveries += deposit.finish(now_ms)
    times = [d.delivered_ms for d in deliveries]
    return [(b - a) / 1e3 for a, b in zip(times, times[1:], strict=False)]


def completed_requests(record: dict[str, Any]) -> tuple[list[list[float]], list[float]]:
    """(ITL lists, TTFTs) of the completed requests of a bench_serving ``--output-details``
    record: a request counts when it has no error and a TTFT > 0 (bench_serving's failed
    requests carry an error text and TTFT 0)."""
    itls = record.get("itls")
    ttfts = record.get("ttfts")
    errors = record.get("errors") or [""] * len(itls or ())
    if not isinstance(itls, list) or not isinstance(ttfts, list) or len(itls) != len(ttfts):
        raise ValueError("bench_serving record has no per-request itls/ttfts (run it with --output-details)")
    out_itls: list[list[float]] = []
    out_ttfts: list[float] = []
    for itl, ttft, err in zip(itls, ttfts, errors, strict=False):
        if err or not isinstance(ttft, int | float) or ttft <= 0:
            continue
        out_itls.append([float(g) for g in itl])
        out_ttfts.append(float(ttft))
    return out_itls, out_ttfts


def last_record(text: str) -> dict[str, Any]:
    """The last JSON result line of a bench_serving ``--output-file`` (it appends); ValueError
    when there is none."""
    record = None
    for line in text.splitlines():
        try:
            got = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(got, dict) and "completed" in got:
            record = got
    if record is None:
        raise ValueError("bench_serving wrote no result line")
    return record
