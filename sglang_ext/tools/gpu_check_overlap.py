"""OverlapCheck: `kvplane gpu-check`'s measurement of the overlap itself.

The half-offloaded placement of :class:`~sglang_ext.tools.gpu_check_measure.CoreCheck` is
transfer-bound (~213 ms of copies against a ~12 ms step at Llama-3-8B shapes), so it grades the
placement model's stall but not whether a fetch runs *beside* the layers before it: the compute
it should hide is 5% of that step. Here the planner leaves out only as much KV as the model says
the copies hide entirely (OrbitFlow §3.3.1: a fetch overlaps the layers before its own), and
the step is compared with the all-resident one:

- ``overlap.hidden_step_rel``: (hidden placement's step - all-resident step) / all-resident
  step, both timed here back to back (same contexts), at the engine's default copy launch, at most :data:`HIDDEN_REL`. A fetch that keeps the
  compute stream's kernels off the SMs until it is done (persistent copy programs on every SM)
  or a host that reaches the layers late shows here as the copies' time added to the step.
- the same step with the Triton copy launches at each of ``PROGRAM_CAPS`` programs (CUDA;
  ``CudaTransferEngine.copy_programs``), in ``details["overlap"]["step_ms_by_programs"]``: one
  direction saturates PCIe at 8-16 programs (H100 sweep, ``benchmarks/results/gpu/duplex/
  duplex-sweep-run2-*``; H200 runs 14-16), so few programs leave the SMs to the layers. Runs
  14-16 moved the default from 2 per SM to 8 (``kernels.block_copy.DEFAULT_PROGRAMS``); 256
  in the sweep stands for the old default.
- one step of it laid out on the compute stream
  (:class:`~sglang_ext.tools.step_timeline_probe.StepTimelineProbe`).
- kvplane's host time per step of the hidden placement, on the engine that serves (the copy
  engines where they run), with its split, driver time and top functions
  (``details["overlap"]["kvplane_cpu"]``): the step where host time would lengthen the step, so
  ``kvplane_cpu_share`` grades it with the all-resident step's (the half-offloaded step is
  transfer-bound).
- ``overlap.fetch_launch_ms``: what the hidden step still costs per fetch launch, as the
  controller learns it (``ProfileTracker.update`` with the layers' compute and the link sampled,
  so the gap is the launches', ``controlplane/model/timeline.py``): the figure a ``--kv-profile``
  file's ``fetch_launch_ms`` takes, so that the planner prices hiding as this machine delivers it.

The budget is the first of :data:`SHARES` whose placement the model predicts within
:data:`MODEL_STALL_SHARE` of the resident step (the last if none is).
"""

from __future__ import annotations

from typing import Any

from controlplane.controller import ProfileTracker
from controlplane.model import Profile, launch_count, step_time_ms
from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.tools.gpu_check_config import PROGRAM_CAPS
from sglang_ext.tools.gpu_check_measure import DUPLEX_VS_ONE
from sglang_ext.tools.gpu_check_placed import driver_seconds, drivers_of
from sglang_ext.tools.gpu_check_report import Figure, kernels_figure
from sglang_ext.tools.gpu_check_transfer import CopyEnginePhase
from sglang_ext.tools.step_timeline_probe import StepTimelineProbe

SHARES = (0.02, 0.015, 0.01, 0.0075, 0.005)
"""Device budgets tried, in order: the batch's KV less this share, staging included (so the
placement leaves this share out plus one staging layer per offloading request). With run 13's
H200 figures (0.37 ms a layer, 49 GB/s) the planner's placements at these budgets offload
11.2K / 9.3K / 7.7K / 6.9K / 7.1K layer-pages of the batch's 330K at a model stall of 4.6 / 1.8 /
0.29 / 0.002 / 0 ms: 0.0075 is the first the model hides (455 MB of fetches under 11.9 ms of
compute; without overlap the step would take ~9 ms more)."""
MODEL_STALL_SHARE = 0.02
"""The model's stall for a placement it hides: at most this share of the resident step."""
HIDDEN_REL = 0.10
"""Target: the hidden placement's step at most this much over the all-resident step."""


LINK_KEEP = 0.95
"""A cap is recommended only if its H2D GB/s is at least this share of the default launch's (a
transfer-bound step must not get slower for the hidden one to get faster)."""
STEP_GAIN = 0.02
"""...and only if its hidden step is at least this much faster than the default's (noise)."""


def recommend_programs(step_ms: dict[str, float], link: dict[str, dict[str, float]], h2d_gbps: float) -> str:
    """The flags to serve with, or ``default``. Among the Triton kernels' caps (``step_ms``: the
    hidden-placement step by cap, ``default`` their default's) the one fastest by at least
    :data:`STEP_GAIN` whose H2D GB/s (``link``) keeps :data:`LINK_KEEP` of the default's
    ``h2d_gbps``. Where the copy engines ran (``dma`` in both), they are the served default
    (``--kv-copy-engine dma``): the kernels are recommended only if their choice is faster than
    the copy engines' step by :data:`STEP_GAIN`, or the copy engines' link falls short of
    :data:`LINK_KEEP` of the kernels'."""
    base = step_ms.get("default")
    if base is None:
        return "default"
    ok = [cap for cap in step_ms if cap not in ("default", "dma") and cap in link
          and link[cap]["h2d_gbps"] >= LINK_KEEP * h2d_gbps and step_ms[cap] <= (1 - STEP_GAIN) * base]
    best = min(ok, key=step_ms.__getitem__) if ok else None
    kernels = "" if best is None else f"--kv-copy-programs {best}"
    if "dma" not in step_ms or "dma" not in link:  # the copy engines refused: the kernels serve
        return kernels or "default"
    slow_link = link["dma"]["h2d_gbps"] < LINK_KEEP * h2d_gbps
    if slow_link or step_ms[best or "default"] <= (1 - STEP_GAIN) * step_ms["dma"]:
        return f"--kv-copy-engine triton {kernels}".strip()
    return "default"


def _dma_costs(engine: Any) -> dict[str, float] | None:
    """The copy engines' calls so far (transfer check and overlap phase): single segments and
    batched calls with the host microseconds per segment inside the driver, strided runs (2-D
    copies) with theirs per run, why the 2-D copies were refused, the fetches planned from their
    segments and those that reused an earlier layer's plan (``FetchRunCache``); None where none ran."""
    dma, pitched = getattr(engine, "_dma", None), getattr(engine, "_pitched", None)
    plans = getattr(engine, "fetch_runs", None)
    runs = 0 if pitched is None else pitched.calls
    if dma is None or not (dma.copies or runs):
        return None
    return {"copies": dma.copies, "calls": dma.calls, "driver_version": dma.driver_version,
            "host_us_per_copy": dma.call_seconds / dma.copies * 1e6 if dma.copies else None,
            "runs": runs, "run_rows": 0 if pitched is None else pitched.rows,
            "host_us_per_run": pitched.call_seconds / runs * 1e6 if runs else None,
            "pitched_error": getattr(engine, "pitched_error", None),
            "fetches_planned": None if plans is None else plans.planned,
            "fetches_reusing_a_plan": None if plans is None else plans.reused,
            "fetches_reusing_without_the_map": None if plans is None else getattr(plans, "reused_whole", None)}


class OverlapCheck:
    """The overlap phase of :class:`~sglang_ext.tools.gpu_check_measure.CoreCheck` (module docstring)."""

    def __init__(self, check: Any) -> None:
        self.check = check
        self.details: dict[str, Any] = {}

    def _choose(self, comp_ms: list[float], bw: float, resident_ms: float) -> tuple[float, list, float]:
        """(share, rows, the model's stall ms) of the placement to measure."""
        ch = self.check
        for share in SHARES:
            rows = ch.plan(comp_ms, bw, share=share, key="overlap_plan", staging_on_top=False)
            stall = step_time_ms(rows, ch.batch.blocks(1), comp_ms, bw) - sum(comp_ms)
            if stall <= MODEL_STALL_SHARE * resident_ms:
                break
        return share, rows, stall

    def run(self, comp_ms: list[float], bw_blocks_per_ms: float, resident_ms: float,
            link_by_programs: dict[str, dict[str, float]] | None = None, h2d_gbps: float = 0.0) -> list[Figure]:
        """``comp_ms``: the layers' compute from the first all-resident step (``resident_ms``, no
        longer read: kept for the probes' calls); the all-resident step is timed again here, at
        the same contexts, and the placement is chosen with ``comp_ms`` scaled to it (the share's
        bound is that step too): the figure compares the placement's step with it. ``link_by_programs``:
        the transfer check's GB/s at the same caps (``h2d_gbps``: at the default), quoted in the
        note and weighed by :func:`recommend_programs`."""
        ch, b, c = self.check, self.check.batch, self.check.config
        cuda = ch.device.startswith("cuda")
        engine = b.core.store.engine
        placed_dma = self._placed_on_copy_engines(engine)
        # the all-resident step again, at these contexts (the first was timed ~100 steps ago), and
        # the placement chosen with the layers' compute scaled to it: an eager step's time moves
        # with the host (gpu-check run 18 on an H200: 18.3 ms first, 12.5 ms here), and a plan made
        # for the slower step left 2.2 ms fetch waits at two layers once the copies left the SMs
        b.place([(1,) * c.layers for _ in b.rids])
        engine.quiesce()
        sync(ch.device)
        resident_ms = time_ms(ch.step, ch.device, c.repeat)
        scaled = [x * resident_ms / sum(comp_ms) for x in comp_ms] if sum(comp_ms) > 0 else list(comp_ms)
        share, rows, model_stall = self._choose(scaled, bw_blocks_per_ms, resident_ms)
        b.place(rows)
        offloaded = sum(r.count(0) * n for r, n in zip(rows, b.blocks(0), strict=True))
        engine.quiesce()
        sync(ch.device)
        capped = hasattr(engine, "copy_programs")
        before = engine.copy_programs if capped else None
        by_programs: dict[str, float] = {}
        try:
            for cap in PROGRAM_CAPS if capped else (None,):
                if capped:
                    engine.copy_programs = cap
                by_programs["default" if cap is None else str(cap)] = time_ms(ch.step, ch.device, c.repeat)
        finally:
            if capped:
                engine.copy_programs = before
        hidden_ms = by_programs["default"]
        timeline = ch.timeline()
        dma_error, dma_timeline, host, dma_driver = ch.dma_error, None, None, None
        if dma_error is None:
            with CopyEnginePhase("the hidden placement on the copy engines", b) as dma:
                if dma.on:
                    by_programs["dma"] = time_ms(ch.step, ch.device, c.repeat)
                    dma_timeline = ch.timeline()
                    dma_driver = _dma_costs(engine)  # before the host-time steps (timed, profiled) add theirs
                    host = self._host_time("dma", resident_ms)
            dma_error = ch.dma_error = dma.error
            if dma_error is not None:
                by_programs.pop("dma", None)
                host = None
        if host is None:  # no copy engines here: the kernels serve
            host = self._host_time(str(getattr(engine, "impl", "cpu")), resident_ms)
        rel = (hidden_ms - resident_ms) / resident_ms
        launch_ms = self._launch_cost(rows, scaled, bw_blocks_per_ms, hidden_ms)
        launches, blocks = launch_count(rows), b.blocks(1)
        model_ms = (step_time_ms(rows, blocks, scaled, bw_blocks_per_ms),
                    step_time_ms(rows, blocks, scaled, bw_blocks_per_ms, launch_ms=launch_ms))
        self.details = {
            "share": share, "offloaded_layer_pages": offloaded,
            "offloaded_layers_per_request": [r.count(0) for r in rows], "model_stall_ms": model_stall,
            "rows": [list(r) for r in rows],
            "resident_step_ms": resident_ms, "step_ms": hidden_ms, "step_ms_by_programs": by_programs,
            "fastest_programs": min(by_programs, key=by_programs.__getitem__), "timeline": timeline,
            "recommended_programs": recommend_programs(by_programs, link_by_programs or {}, h2d_gbps),
            "dma_error": dma_error, "dma_timeline": dma_timeline,
            "dma_driver": dma_driver if dma_driver is not None else _dma_costs(engine),
            "placed_on_copy_engines": placed_dma, "launches": launches, "fetch_launch_ms": launch_ms,
            "model_step_ms": {"without_launches": model_ms[0], "with_fitted_launches": model_ms[1]},
            "kvplane_cpu": host,
        }
        ch.details["overlap"] = self.details
        sweep = ", ".join(f"{k} {v:.2f}" for k, v in by_programs.items())
        if link_by_programs:
            sweep += "; H2D / duplex GB/s by cap: " + ", ".join(
                f"{k} {v['h2d_gbps']:.1f} / {v['duplex_gbps']:.1f}" for k, v in link_by_programs.items())
        if capped:
            sweep += f"; recommended: {self.details['recommended_programs']}"
        note = (f"budget {1 - share:.2%} of the KV ({offloaded} layer-pages offloaded), model stall "
                f"{model_stall:.3f} ms; step {hidden_ms:.2f} vs {resident_ms:.2f} ms all-resident; "
                f"by copy programs (ms): {sweep}; {StepTimelineProbe.summary(timeline)}")
        return [Figure.graded(
            "overlap.hidden_step_rel", "overlap: a placement the model hides, step vs all-resident", rel, "ratio",
            "<=", HIDDEN_REL, "the planner leaves out the largest KV share whose copies the model hides "
            f"(stall <= {MODEL_STALL_SHARE:.0%} of the resident step); (its step - all-resident step) / "
            "all-resident step, at the engine's default copy launch", meaningful=cuda and kernels_figure(dma_error)[0],
            note=("CPU: copies are synchronous, nothing overlaps; not meaningful. " if not cuda
                  else kernels_figure(dma_error)[1]) + note),
            Figure.graded(
                "overlap.fetch_launch_ms", "overlap: what the hidden step costs per fetch launch (the model's launch_ms)",
                launch_ms, "ms", None, None, "the controller's fit (ProfileTracker.update, a=1, the layers' compute "
                "scaled to the all-resident step and the link's bandwidth as samples): the launch cost at which the "
                "placement model reproduces the hidden step; a --kv-profile file's fetch_launch_ms",
                meaningful=cuda, note=f"{launches} launches a step; hidden step {hidden_ms:.2f} ms, the model "
                f"{model_ms[0]:.2f} ms without launch cost, {model_ms[1]:.2f} ms with the fitted one"),
            *self._dma_figures(resident_ms, link_by_programs or {}, cuda)]

    def _host_time(self, engine: str, resident_ms: float) -> dict[str, Any]:
        """kvplane's host time per step of the hidden placement on the engine that serves
        (``engine``, the name it is reported by; ``resident_ms``: this phase's all-resident step,
        the share's base): :meth:`CoreCheck.kvplane_cpu_ms` over it, with
        its split, the time inside the copy engines' driver calls and cProfile's top functions
        (:meth:`CoreCheck.host_profile`). This step is not
        transfer-bound (the model hides its copies), so its host time is overhead wherever the
        step is host-bound: with the all-resident step's, what ``kvplane_cpu_share`` grades."""
        ch = self.check
        drivers = drivers_of(ch.batch.core.store.engine)
        before = driver_seconds(drivers)
        ms = ch.kvplane_cpu_ms()
        driver_ms = (driver_seconds(drivers) - before) * 1e3 / (2 * ch.config.repeat)
        host = {"ms": ms, "mean_ms": ch.cpu_mean_ms, "boundary": ch.prepare_cpu_ms, "layer_calls": dict(ch.parts_cpu_ms),
                "engine": engine, "driver_ms": driver_ms, "profile": ch.host_profile(), "resident_step_ms": resident_ms}
        ch.details.setdefault("overlap", {})["kvplane_cpu"] = host  # kept should the phase fail after it
        return host

    def _launch_cost(self, rows: list, comp_ms: list[float], bw: float, hidden_ms: float) -> float:
        """The fitted ``fetch_launch_ms`` of the hidden placement: the controller's update with
        both samples (``comp_ms``, the bandwidth the check measured) attributes the rest of the
        observed step to the launches."""
        block_bytes = self.check.config.layer_page_bytes
        gbps = bw * block_bytes / 1e6
        tracker = ProfileTracker(Profile(tuple(comp_ms)), gbps, block_bytes)
        blocks = self.check.batch.blocks(1)
        tracker.update(ewma_factor=1.0, observed_step_ms=hidden_ms, predicted_step_ms=tracker.predict_step_ms(rows, blocks),
                       placement=rows, blocks=blocks, layer_compute_sample_ms=tuple(comp_ms), h2d_gbps_sample=gbps)
        return tracker.fetch_launch_ms

    def _placed_on_copy_engines(self, engine: Any) -> dict[str, Any] | None:
        """The check's half-offloaded placement (installed on entry: transfer-bound, ~10^4
        segments a fetch at Llama-3-8B shapes) stepped with the copy engines: its step time and
        one step's timeline (the host's issue time shows the driver's cost per copy entry at
        that size); None where they do not run."""
        ch = self.check
        if ch.dma_error is not None:
            return None
        placed = None
        with CopyEnginePhase("the half-offloaded placement on the copy engines", ch.batch) as dma:
            if dma.on:
                engine.quiesce()
                sync(ch.device)
                placed = {"step_ms": time_ms(ch.step, ch.device, ch.config.repeat), "timeline": ch.timeline()}
        ch.dma_error = dma.error
        return placed if dma.error is None else None

    def _dma_figures(self, resident_ms: float, link: dict[str, dict[str, float]], cuda: bool) -> list[Figure]:
        """The copy engines (``--kv-copy-engine dma``): the hidden placement's step and the duplex
        ratio with them; N/A with the reason where they did not run."""
        d = self.details
        step, error, timeline = d["step_ms_by_programs"].get("dma"), d["dma_error"], d["dma_timeline"]
        why = f"not measured: {error}" if error is not None or step is None else ""
        rel = None if step is None else (step - resident_ms) / resident_ms
        note = why
        if step is not None:
            note = f"step {step:.2f} vs {resident_ms:.2f} ms; {StepTimelineProbe.summary(timeline)}"
            driver, placed = d["dma_driver"], d["placed_on_copy_engines"]
            if driver is not None:
                note += f"; driver {driver['driver_version']}"
                if driver["runs"]:
                    note += (f", {driver['runs']} strided runs (2-D copies) of {driver['run_rows']} segments at "
                             f"{driver['host_us_per_run']:.2f} us of host time each")
                elif driver["pitched_error"]:
                    note += f", no 2-D copies ({driver['pitched_error']})"
                if driver["copies"]:
                    note += (f", {driver['copies']} single segments at {driver['host_us_per_copy']:.2f} us each in "
                             f"{driver['calls']} batched calls")
                if driver["fetches_planned"] is not None:
                    note += (f", fetches planned {driver['fetches_planned']}, reusing a layer's plan "
                             f"{driver['fetches_reusing_a_plan']}")
            if placed is not None:
                note += (f"; the half-offloaded placement on the copy engines: {placed['step_ms']:.2f} ms, "
                         f"{StepTimelineProbe.summary(placed['timeline'])}")
        figs = [Figure.graded(
            "overlap.hidden_step_rel.dma", "overlap with the copy engines (dma): hidden placement vs all-resident",
            rel, "ratio", "<=", HIDDEN_REL, "the same placement and all-resident step, the copies on the DMA "
            "copy engines (one cuMemcpyBatchAsync per launch, no SM taken)", meaningful=cuda and step is not None,
            note=note)]
        dma = link.get("dma")
        figs.append(Figure.graded(
            "duplex_vs_one_direction.dma", "concurrent H2D + D2H vs one direction, copy engines (dma)",
            None if dma is None else dma["duplex_gbps"] / dma["h2d_gbps"], "ratio", ">=", DUPLEX_VS_ONE,
            "the transfer check's H2D and D2H issued together on the copy engines: bytes of both over their "
            "time, vs the H2D alone", meaningful=cuda and dma is not None,
            note=why if dma is None else f"{dma['duplex_gbps']:.1f} vs {dma['h2d_gbps']:.1f} GB/s" + (
                "" if "h2d_interleaved_gbps" not in dma else
                f"; H2D of the same pages in a long decode's order: {dma['h2d_interleaved_gbps']:.1f} GB/s, "
                f"{dma['interleaved_runs_per_launch']:.0f} 2-D copies a launch at a "
                f"{dma['interleaved_pitch_mib']:.0f} MiB pitch")))
        return figs
