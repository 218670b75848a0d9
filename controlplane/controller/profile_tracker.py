"""Online per-layer compute and bandwidth profile (OrbitFlow §3.4, profile-mismatch trigger).

After each step the controller compares the observed step time with the exact timeline's
prediction for the placement that ran. When ``|observed - predicted| / predicted`` exceeds
``policy.mismatch_threshold`` the profile moves by an EWMA with weight ``a = policy.ewma_factor``
towards the observation and the planner runs again:

* ``comp[l] <- (1 - a) * comp[l] + a * sample[l]`` and ``bw <- (1 - a) * bw + a * sample_bw``
  when the worker sampled per-layer compute (``StepReport.layer_compute_ms``) or bandwidth
  (``StepReport.h2d_gbps``).
* Without samples the observation is attributed to the whole profile: the timeline is
  1-homogeneous in ``(comp, 1 / bw)`` (scaling every compute time by ``s`` and dividing the
  bandwidth by ``s`` scales the step time by exactly ``s``), so the EWMA target is the profile
  scaled by ``s = observed / predicted`` (bandwidth only where the placement transferred anything).
* With a compute sample but no bandwidth sample, and transfers in the placement, the bandwidth
  target is the one that makes the timeline reproduce the observed step (bisection; the step time
  is non-increasing in bandwidth).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from controlplane.model import Profile, step_time_ms


@dataclass(frozen=True)
class ProfileUpdate:
    """What one EWMA update did."""

    old_layer_compute_ms: tuple[float, ...]
    """Per-layer compute before the update."""
    new_layer_compute_ms: tuple[float, ...]
    """Per-layer compute after the update."""
    old_h2d_gbps: float
    """Bandwidth before the update."""
    new_h2d_gbps: float
    """Bandwidth after the update."""
    observed_step_ms: float
    """The observation that triggered the update."""
    predicted_step_ms: float
    """The prediction it was compared with."""


class ProfileTracker:
    """Current compute profile and link bandwidth of one worker. Not thread-safe."""

    def __init__(self, profile: Profile, h2d_gbps: float, block_bytes: int) -> None:
        if h2d_gbps <= 0:
            raise ValueError(f"h2d_gbps: {h2d_gbps} is out of range (allowed > 0)")
        self._comp = tuple(float(c) for c in profile.layer_compute_ms)
        self._all_gpu_ms = float(sum(self._comp))
        self._gbps = float(h2d_gbps)
        self._block_bytes = block_bytes

    @property
    def layer_compute_ms(self) -> tuple[float, ...]:
        """Per-layer compute time in ms."""
        return self._comp

    @property
    def all_gpu_step_ms(self) -> float:
        """Step time of any placement without transfers: the sum of the layers' compute (the
        timeline's no-transfer case, what :meth:`predict_step_ms` returns for it)."""
        return self._all_gpu_ms

    @property
    def h2d_gbps(self) -> float:
        """Effective host-to-device bandwidth in GB/s."""
        return self._gbps

    @property
    def profile(self) -> Profile:
        return Profile(layer_compute_ms=self._comp)

    def bw_blocks_per_ms(self, gbps: float | None = None) -> float:
        """Bandwidth in blocks per ms (issue 2 §2: ``h2d_gbps * 1e9 / 1e3 / block_bytes``)."""
        return (self._gbps if gbps is None else gbps) * 1e9 / 1e3 / self._block_bytes

    def predict_step_ms(self, placement: Sequence[Sequence[int]], blocks: Sequence[int]) -> float:
        """Exact timeline step time of ``placement`` under the current profile."""
        return step_time_ms(placement, blocks, self._comp, self.bw_blocks_per_ms())

    @staticmethod
    def mismatch(observed_step_ms: float, predicted_step_ms: float) -> float:
        """Relative error ``|observed - predicted| / predicted`` (inf when predicted is 0)."""
        if predicted_step_ms <= 0:
            return 0.0 if observed_step_ms <= 0 else float("inf")
        return abs(observed_step_ms - predicted_step_ms) / predicted_step_ms

    def update(
        self,
        *,
        ewma_factor: float,
        observed_step_ms: float,
        predicted_step_ms: float,
        placement: Sequence[Sequence[int]],
        blocks: Sequence[int],
        layer_compute_sample_ms: Sequence[float] | None = None,
        h2d_gbps_sample: float | None = None,
    ) -> ProfileUpdate:
        """Move the profile towards the observation by one EWMA step (see module docstring)."""
        a = ewma_factor
        old_comp, old_gbps = self._comp, self._gbps
        transfers = any(not x for row in placement for x in row)
        scale = observed_step_ms / predicted_step_ms if predicted_step_ms > 0 else 1.0
        if layer_compute_sample_ms is not None:
            if len(layer_compute_sample_ms) != len(old_comp):
                raise ValueError(
                    f"layer_compute_ms: has {len(layer_compute_sample_ms)} entries, "
                    f"expected {len(old_comp)}"
                )
            target_comp = tuple(float(c) for c in layer_compute_sample_ms)
        elif h2d_gbps_sample is not None and transfers:
            target_comp = old_comp  # the bandwidth sample explains the gap; fitted below
        else:
            target_comp = tuple(c * scale for c in old_comp)

        if h2d_gbps_sample is not None:
            target_gbps = float(h2d_gbps_sample)
        elif not transfers:
            target_gbps = old_gbps  # nothing crossed the link: no evidence about bandwidth
        elif layer_compute_sample_ms is not None:
            target_gbps = self._fit_gbps(target_comp, placement, blocks, observed_step_ms)
        else:
            target_gbps = old_gbps / scale if scale > 0 else old_gbps

        if h2d_gbps_sample is not None and layer_compute_sample_ms is None and transfers:
            fitted = self._fit_comp_scale(target_gbps, placement, blocks, observed_step_ms)
            target_comp = tuple(c * fitted for c in old_comp)

        self._comp = tuple((1 - a) * o + a * t for o, t in zip(old_comp, target_comp, strict=True))
        self._all_gpu_ms = float(sum(self._comp))
        if target_gbps > 0:
            self._gbps = (1 - a) * old_gbps + a * target_gbps
        return ProfileUpdate(
            old_comp, self._comp, old_gbps, self._gbps, observed_step_ms, predicted_step_ms
        )

    def _fit_gbps(
        self,
        comp: Sequence[float],
        placement: Sequence[Sequence[int]],
        blocks: Sequence[int],
        observed_step_ms: float,
    ) -> float:
        """Bandwidth at which the timeline reproduces ``observed_step_ms`` (clamped to 1e-3..1e3x)."""
        lo, hi = self._gbps * 1e-3, self._gbps * 1e3

        def t(gbps: float) -> float:
            return step_time_ms(placement, blocks, comp, self.bw_blocks_per_ms(gbps))

        if t(hi) >= observed_step_ms:
            return hi  # even a very fast link is too slow: compute explains it; keep bw high
        if t(lo) <= observed_step_ms:
            return lo
        for _ in range(40):  # geometric bisection: t is non-increasing in bandwidth
            mid = (lo * hi) ** 0.5
            if t(mid) > observed_step_ms:
                lo = mid
            else:
                hi = mid
        return (lo * hi) ** 0.5

    def _fit_comp_scale(
        self,
        gbps: float,
        placement: Sequence[Sequence[int]],
        blocks: Sequence[int],
        observed_step_ms: float,
    ) -> float:
        """Compute scale at which the timeline reproduces ``observed_step_ms`` given ``gbps``."""
        bw = self.bw_blocks_per_ms(gbps)

        def t(s: float) -> float:
            return step_time_ms(placement, blocks, [c * s for c in self._comp], bw)

        lo, hi = 1e-3, 1e3
        if t(lo) >= observed_step_ms:
            return lo
        if t(hi) <= observed_step_ms:
            return hi
        for _ in range(40):  # t is non-decreasing in the compute scale
            mid = (lo * hi) ** 0.5
            if t(mid) < observed_step_ms:
                lo = mid
            else:
                hi = mid
        return (lo * hi) ** 0.5
