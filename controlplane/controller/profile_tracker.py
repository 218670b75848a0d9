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

**Recompute** (issue 16, ``docs/recompute.md``): the worker's profile may carry
``recompute_ms_per_token`` (from its ``--kv-profile`` file, measured by ``kvplane profile``).
The placement that ran may recompute (per request ``(u, k)``); predictions then include the
recompute's compute, a layer sample has the predicted recompute part taken out (the layer timer
measures the layer with its recompute rows), and the homogeneity above holds with the recompute
cost scaled like the compute. After every update ``recompute_ms_per_token`` is scaled by the
ratio of the new to the old summed layer compute: the recomputed tokens run through the same
layers on the same device, so a slowdown the profile learns applies to them too.

**Fetch launches** (``Profile.fetch_launch_ms``, :mod:`controlplane.model.timeline`): the host
cost of one fetch launch, what a fetch the model hides still adds to the step (on a GPU an eager
forward's host issues each launch before the next layer's kernels: ``kvplane gpu-check``'s
overlap figure was +28-40% of the step on an H200 at 16 launches, with the model's stall at 0).

* It is a time constant of the timeline like the compute, so the homogeneous update of a
  placement that fetched scales it by ``s`` too (one that fetched nothing launched nothing: no
  evidence, as for the bandwidth).
* When the worker sampled both the layers' compute and the bandwidth of a *steady* step (the
  placement of the step before ran again: a new one also moved pages) whose placement fetched,
  the gap the samples leave is the launches': the target is the launch cost at which the
  timeline reproduces the observed step (bisection; 0 when the samples alone reach it).
* A bandwidth sample moves the link only when the placement that ran transferred.

**Bounds.** A step or layer time above :data:`MAX_TELEMETRY_MS`, a bandwidth sample outside
:data:`GBPS_RANGE`, or a step of no time is broken telemetry: no evidence, the profile stays. The
EWMA targets are held within the same bounds (the bandwidth's only where it is evidence: a hello's
outside them stays until a transfer says otherwise), so the profile stays finite whatever the
scale; a recompute cost that the compute's ratio cannot scale (from a profile of ~0 ms) is kept.

The SGLang worker samples both on CUDA: the bandwidth is the data plane's timed H2D bytes over
their seconds (none on the CPU engine, whose synchronous copies are inside the layer samples);
a layer's time runs from its ready mark (after its wait on fetches) to the next layer's entry.
The layer times leave out the stalls but carry the host time a layer's end spends issuing
launches where the host sets the pace, so there the fit finds what the samples leave (often 0)
and a ``--kv-profile`` value (``kvplane gpu-check``'s fit) decays to it: the launches are then
counted once, in the compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from controlplane.model import Profile, link_blocks_per_ms, step_time_ms
from controlplane.model.timeline import Recompute


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
    old_fetch_launch_ms: float = 0.0
    """Launch cost before the update."""
    new_fetch_launch_ms: float = 0.0
    """Launch cost after the update."""


MAX_TELEMETRY_MS = 600_000.0
"""A step or layer time above this (ten minutes) is broken telemetry, no evidence: two reports of
1.7e308 ms (finite, so valid) inflated the profile, the next normal step's scale sent the bandwidth
to inf, and every later plan of the session failed (control-plane review, session 80)."""
GBPS_RANGE = (1e-6, 1e5)
"""Bandwidths (GB/s) the profile may hold or learn from: a byte a millisecond up to 100 TB/s."""


def _evidence(observed_step_ms: float, comp: Sequence[float] | None, gbps: float | None) -> bool:
    """A report the profile may learn from: a step time in ``(0,`` :data:`MAX_TELEMETRY_MS` ``]``,
    layer times (where sampled) within ``[0,`` :data:`MAX_TELEMETRY_MS` ``]`` and a bandwidth
    (where sampled) within :data:`GBPS_RANGE` (NaN is in none of them)."""
    return (0.0 < observed_step_ms <= MAX_TELEMETRY_MS
            and all(0.0 <= c <= MAX_TELEMETRY_MS for c in comp or ())
            and (gbps is None or GBPS_RANGE[0] <= gbps <= GBPS_RANGE[1]))


class ProfileTracker:
    """Current compute profile and link bandwidth of one worker. Not thread-safe."""

    def __init__(self, profile: Profile, h2d_gbps: float, block_bytes: int, block_size: int = 1) -> None:
        if h2d_gbps <= 0:
            raise ValueError(f"h2d_gbps: {h2d_gbps} is out of range (allowed > 0)")
        self._comp = tuple(float(c) for c in profile.layer_compute_ms)
        self._all_gpu_ms = float(sum(self._comp))
        self._gbps = float(h2d_gbps)
        self._block_bytes = block_bytes
        self._block_size = block_size
        rms = profile.recompute_ms_per_token
        self._rms = None if rms is None else tuple(float(x) for x in rms)
        self._launch = float(profile.fetch_launch_ms)

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
    def recompute_ms_per_token(self) -> tuple[float, ...] | None:
        """Per layer, ms one recomputed token adds (None: the worker cannot recompute)."""
        return self._rms

    @property
    def fetch_launch_ms(self) -> float:
        """Host cost of one fetch launch in ms (:mod:`controlplane.model.timeline`)."""
        return self._launch

    @property
    def profile(self) -> Profile:
        return Profile(layer_compute_ms=self._comp, recompute_ms_per_token=self._rms,
                       fetch_launch_ms=self._launch)

    def bw_blocks_per_ms(self, gbps: float | None = None) -> float:
        """Bandwidth in blocks per ms (issue 2 §2: :func:`~controlplane.model.link_blocks_per_ms`)."""
        return link_blocks_per_ms(self._gbps if gbps is None else gbps, self._block_bytes)

    def predict_step_ms(
        self, placement: Sequence[Sequence[int]], blocks: Sequence[int], recompute: Recompute | None = None
    ) -> float:
        """Exact timeline step time of ``placement`` (with ``recompute``, per request ``(u, k)``)
        under the current profile."""
        return self._step_ms(placement, blocks, self._comp, self._rms, self.bw_blocks_per_ms(), recompute)

    def _step_ms(
        self,
        placement: Sequence[Sequence[int]],
        blocks: Sequence[int],
        comp: Sequence[float],
        rms: Sequence[float] | None,
        bw: float,
        recompute: Recompute | None,
        launch_ms: float | None = None,
    ) -> float:
        launch = self._launch if launch_ms is None else launch_ms
        if recompute is None or rms is None:
            return step_time_ms(placement, blocks, comp, bw, launch_ms=launch)
        return step_time_ms(placement, blocks, comp, bw, recompute=recompute, recompute_ms_per_token=rms,
                            block_size=self._block_size, launch_ms=launch)

    def _without_recompute(self, sample: Sequence[float], recompute: Recompute | None) -> tuple[float, ...]:
        """A layer sample less the recompute the model puts in each layer (``>= 0``)."""
        out = [float(c) for c in sample]
        if recompute is not None and self._rms is not None:
            for u, k in recompute:
                for layer in range(k if u else 0):
                    out[layer] -= u * self._block_size * self._rms[layer]
        return tuple(max(0.0, c) for c in out)

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
        recompute: Recompute | None = None,
        steady: bool = True,
    ) -> ProfileUpdate:
        """Move the profile towards the observation by one EWMA step (see module docstring);
        ``recompute``: the ``(u, k)`` per request of the placement that ran; ``steady``: the
        placement ran the step before too (the first step of a new placement also moves pages,
        time the timeline does not model: it is no evidence of the launch cost)."""
        a = ewma_factor
        old_comp, old_gbps, old_launch = self._comp, self._gbps, self._launch
        unchanged = ProfileUpdate(old_comp, old_comp, old_gbps, old_gbps, observed_step_ms, predicted_step_ms,
                                  old_launch, old_launch)
        if not _evidence(observed_step_ms, layer_compute_sample_ms, h2d_gbps_sample):
            # a step of no time is no evidence (broken telemetry); scaling by it would zero the
            # profile, and a zero profile predicts 0 ms, from which no scale ever moves it back;
            # with a layer sample beside it, the bandwidth fit of a 0 ms step took its 1000x
            # clamp (control-plane review, session 77). Nor is one beyond the bounds above
            return unchanged
        transfers = any(not x for row in placement for x in row) or any(
            u and k < len(old_comp) for u, k in recompute or ()
        )
        scale = observed_step_ms / predicted_step_ms if predicted_step_ms > 0 else 1.0
        if layer_compute_sample_ms is not None:
            if len(layer_compute_sample_ms) != len(old_comp):
                raise ValueError(
                    f"layer_compute_ms: has {len(layer_compute_sample_ms)} entries, "
                    f"expected {len(old_comp)}"
                )
            target_comp = self._without_recompute(layer_compute_sample_ms, recompute)
        elif h2d_gbps_sample is not None and transfers:
            target_comp = old_comp  # the bandwidth sample explains the gap; fitted below
        else:
            target_comp = tuple(c * scale for c in old_comp)

        if h2d_gbps_sample is not None and transfers:
            target_gbps = float(h2d_gbps_sample)
        elif not transfers:
            target_gbps = old_gbps  # nothing crossed the link: no evidence about bandwidth
        elif layer_compute_sample_ms is not None:
            target_gbps = self._fit_gbps(target_comp, placement, blocks, observed_step_ms, recompute)
        else:
            target_gbps = old_gbps / scale if scale > 0 else old_gbps

        if h2d_gbps_sample is not None and layer_compute_sample_ms is None and transfers:
            fitted = self._fit_comp_scale(target_gbps, placement, blocks, observed_step_ms, recompute)
            target_comp = tuple(c * fitted for c in old_comp)
        if layer_compute_sample_ms is None and not any(target_comp):
            # a profile of zeros (a hello without a measured profile) predicts 0 ms, and no scale
            # moves it: the step is spread over the layers (an upper bound where it stalled; the
            # next mismatch scales it down, a layer sample replaces it)
            target_comp = (observed_step_ms / len(old_comp),) * len(old_comp)

        if layer_compute_sample_ms is not None and h2d_gbps_sample is not None and transfers and steady:
            target_launch = self._fit_launch(target_comp, target_gbps, placement, blocks, observed_step_ms, recompute)
        elif layer_compute_sample_ms is None and h2d_gbps_sample is None and transfers:
            target_launch = old_launch * scale  # homogeneous, like the compute (exactness)
        else:
            target_launch = old_launch
        # bounded evidence can still scale far (a near-zero prediction): the targets are held
        # within the bounds, so the profile moves towards one the planner can use, never to inf
        # or NaN (a profile a hello gave beyond them, too)
        cap = MAX_TELEMETRY_MS
        launch = (1 - a) * old_launch + a * min(target_launch, cap)
        comp = tuple((1 - a) * o + a * min(t, cap) for o, t in zip(old_comp, target_comp, strict=True))
        gbps = old_gbps  # moved by evidence only: the bandwidth a link carried nothing over is kept
        if transfers and target_gbps > 0:
            gbps = (1 - a) * old_gbps + a * min(max(target_gbps, GBPS_RANGE[0]), GBPS_RANGE[1])
        if not all(math.isfinite(x) for x in (*comp, gbps, launch)):
            return unchanged
        total, rms = float(sum(comp)), self._rms
        if rms is not None and self._all_gpu_ms > 0:  # scaled with the compute (module docstring)
            scaled = tuple(x * (total / self._all_gpu_ms) for x in rms)
            # from a profile of ~0 ms the ratio says nothing (inf): the cost is kept, not lost
            rms = scaled if all(math.isfinite(x) for x in scaled) else rms
        self._launch, self._comp, self._gbps, self._all_gpu_ms, self._rms = launch, comp, gbps, total, rms
        return ProfileUpdate(
            old_comp, self._comp, old_gbps, self._gbps, observed_step_ms, predicted_step_ms, old_launch, self._launch
        )

    def _rms_with(self, comp: Sequence[float]) -> list[float] | None:
        """The recompute cost scaled to ``comp`` (the compute a fit holds fixed), as the update
        scales it after the fit."""
        if self._rms is None:
            return None
        return [x * sum(comp) / self._all_gpu_ms if self._all_gpu_ms else x for x in self._rms]

    def _fit_launch(
        self,
        comp: Sequence[float],
        gbps: float,
        placement: Sequence[Sequence[int]],
        blocks: Sequence[int],
        observed_step_ms: float,
        recompute: Recompute | None = None,
    ) -> float:
        """Launch cost at which the timeline with the sampled ``comp`` and ``gbps`` reproduces
        ``observed_step_ms`` (0 when it already does without; at most the observed step), by
        bisection: the step time grows with the launch cost except where a delayed fetch leaves
        the link to another one (``Evaluator``'s docstring), so this is a root, not always the
        smallest."""
        bw = self.bw_blocks_per_ms(gbps)
        rms = self._rms_with(comp)

        def t(launch: float) -> float:
            return self._step_ms(placement, blocks, comp, rms, bw, recompute, launch)

        return _root(t, 0.0, max(observed_step_ms, 0.0), observed_step_ms, geometric=False)

    def _fit_gbps(
        self,
        comp: Sequence[float],
        placement: Sequence[Sequence[int]],
        blocks: Sequence[int],
        observed_step_ms: float,
        recompute: Recompute | None = None,
    ) -> float:
        """Bandwidth at which the timeline reproduces ``observed_step_ms`` (clamped to 1e-3..1e3x)."""
        lo, hi = self._gbps * 1e-3, self._gbps * 1e3
        rms = self._rms_with(comp)

        def t(gbps: float) -> float:
            return self._step_ms(placement, blocks, comp, rms, self.bw_blocks_per_ms(gbps), recompute)

        # t is non-increasing in bandwidth: a root of -t; a step even a very fast link leaves too
        # slow is the compute's (the bandwidth stays high), one a very slow link cannot reach the link's
        return _root(lambda gbps: -t(gbps), lo, hi, -observed_step_ms)

    def _fit_comp_scale(
        self,
        gbps: float,
        placement: Sequence[Sequence[int]],
        blocks: Sequence[int],
        observed_step_ms: float,
        recompute: Recompute | None = None,
    ) -> float:
        """Compute scale at which the timeline reproduces ``observed_step_ms`` given ``gbps``
        (the recompute cost scaled with the compute)."""
        bw = self.bw_blocks_per_ms(gbps)
        rms = self._rms

        def t(s: float) -> float:
            return self._step_ms(placement, blocks, [c * s for c in self._comp],
                                 None if rms is None else [x * s for x in rms], bw, recompute)

        return _root(t, 1e-3, 1e3, observed_step_ms)


def _root(t: Callable[[float], float], lo: float, hi: float, target: float, *, geometric: bool = True) -> float:
    """``x`` in ``[lo, hi]`` with ``t(x) == target`` for a ``t`` non-decreasing there, by 40
    bisection steps (geometric: on ``log x``); ``lo`` when ``t(lo)`` already reaches it, ``hi``
    when ``t(hi)`` does not."""
    if t(lo) >= target:
        return lo
    if t(hi) <= target:
        return hi
    for _ in range(40):
        mid = (lo * hi) ** 0.5 if geometric else 0.5 * (lo + hi)
        if t(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5 if geometric else 0.5 * (lo + hi)
