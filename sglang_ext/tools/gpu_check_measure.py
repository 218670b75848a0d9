"""CoreCheck: `kvplane gpu-check`'s measurements on the served core, with the real planner.

One :class:`~sglang_ext.tools.gpu_check_batch.CheckBatch` runs, in order:

1. all-resident decode steps (per layer ``enter_layer`` / ``write`` / paged decode attention /
   a stand-in layer body -- QKV, output projection and a gated MLP of the model's sizes --
   / ``exit_layer``; an idle step skips the two calls but the last exit, as served): the step
   time, per-layer compute = step / L;
2. the engine's copies (:class:`TransferCheck`): batched H2D vs one contiguous pinned copy,
   duplex vs one direction, and the link bandwidth the placement model takes;
3. a plan from ``controlplane.planner.Planner`` for a :class:`controlplane.model.Batch` built as
   the controller builds it (context one step ahead, the measured profile and bandwidth, a
   device budget that leaves ``offload_share`` of the batch's KV out plus one staging layer per
   request, a loose SLO so nothing is paused), installed with ``update_residency(planned=True)``;
4. placed decode steps: the step time, the stall vs ``controlplane.model.step_time_ms`` at the link
   bandwidth the placed steps' own copies measured (the timing events, as the served controller
   samples it; the transfer check's bandwidth where none was measured);
5. kvplane's thread CPU time per step (``prepare_step`` + the per-layer calls), resident and placed
   (graded with the hidden placement's of 8, :mod:`.gpu_check_host_note`),
   and the same steps' stall as the data plane's timing events observe it (one step closed after
   each step's sync, :mod:`.gpu_check_event_timing`);
   then one step of each kind laid out on the compute stream (:class:`StepTimelineProbe`: waits,
   compute, host issue time, when the transfers finished), which says where the placed step's
   time goes when the events' stall and the wall clock's disagree;
6. host syncs inside layers over two placed steps (:class:`SyncProbe`);
7. one placed step in which every available attention backend runs at every layer, compared
   with ``dense_attention`` in float32 over the regenerated K/V;
8. a placement the model hides entirely (a few percent of the KV out: the copies fit under the
   layers before them), its step vs the all-resident one, across copy-program caps
   (:class:`~sglang_ext.tools.gpu_check_overlap.OverlapCheck`): the overlap itself, measured, and
   kvplane's host time on it;
9. recompute steps (eLLM, :class:`~sglang_ext.tools.gpu_check_recompute.RecomputeCheck`): step
   time vs the placement model with recompute, attention over the recomputed prefixes;
10. all-resident steps whose layers are captured once as a CUDA graph and replayed step after step
    (:class:`~sglang_ext.tools.gpu_check_graph.GraphProbe`): replay vs eager, attention after the
    replayed steps, step time eager vs replayed; then staged ones, their fetches and write-back in
    the graph (:class:`~sglang_ext.tools.gpu_check_staged_graph.StagedGraphProbe`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from typing import Any

import torch

from controlplane.model import (
    Batch,
    Hardware,
    ModelSpec,
    PlanPolicy,
    Profile,
    RequestSpec,
)
from controlplane.planner import Planner
from sglang_ext.args import DEFAULT_TIMING_INTERVAL
from sglang_ext.dataplane import dense_attention
from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.tools.gpu_check_attention import BACKENDS, DecodeBackends
from sglang_ext.tools.gpu_check_batch import CheckBatch
from sglang_ext.tools.gpu_check_config import TIMELINE_STEPS, GpuCheckConfig
from sglang_ext.tools.gpu_check_event_timing import event_timing_figures
from sglang_ext.tools.gpu_check_host_note import cpu_share, cpu_split
from sglang_ext.tools.gpu_check_placed import SYNC_STEPS, PlacedPhase
from sglang_ext.tools.gpu_check_probes import CpuTimeProbe, SyncProbe
from sglang_ext.tools.gpu_check_report import Figure, guarded_phase, kernels_figure
from sglang_ext.tools.gpu_check_transfer import TransferCheck, TransferResult
from sglang_ext.tools.host_profile_probe import HostProfileProbe
from sglang_ext.tools.step_timeline_probe import StepTimelineProbe

LOOSE_SLO_MS = 60_000.0
"""The requests' TBT SLO: loose, so the planner minimises the step and pauses nobody."""
BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-5
"""bf16 tolerance (``torch.testing``'s defaults) on the output's scale: the attention's max abs
error must stay within ``BF16_ATOL + BF16_RTOL * max|reference|`` (any dtype)."""
STALL_REL_ERR = 0.10
STALL_FLOOR_SHARE = 0.05
"""The stall error's denominator is the model's stall, at least this share of the resident step
(a placement whose copies the model hides entirely predicts a stall near zero)."""
H2D_VS_CONTIGUOUS, DUPLEX_VS_ONE, CPU_SHARE = 0.85, 1.5, 0.05
PROFILE_STEPS = 3
"""Steps of each kind profiled by function (:class:`HostProfileProbe`)."""
Q_SCALE = 2.0
"""Queries are N(0, Q_SCALE^2): a peakier softmax, so a wrong page moves the output visibly."""


@contextmanager
def _no_scope(kind: str, layer: int, part: str = "") -> Iterator[None]:
    yield


class CoreCheck:
    """The served-core half of the check (module docstring)."""

    def __init__(self, config: GpuCheckConfig, device: str, attention: str = "auto", identity: bool = False) -> None:
        self.config, self.device = config, device
        self.batch = CheckBatch(config, device, identity)
        self.backends = DecodeBackends(device, config.q_heads, self.batch.batch_pages, attention,
                                       (config.page_size, config.kv_heads, config.head_dim, config.torch_dtype))
        gen = torch.Generator(device="cpu").manual_seed(config.seed + 1)
        dt, c = config.torch_dtype, config
        rand = lambda *shape, s=0.02: (torch.randn(shape, generator=gen) * s).to(device, dt)  # noqa: E731
        self.q = rand(c.requests, c.q_heads, c.head_dim, s=Q_SCALE)
        self.x = rand(c.requests, c.hidden, s=1.0)
        self.w_qkv = rand(c.hidden, (c.q_heads + 2 * c.kv_heads) * c.head_dim)
        self.w_o = rand(c.q_heads * c.head_dim, c.hidden)
        self.w_gate_up = rand(c.hidden, 2 * c.intermediate)
        self.w_down = rand(c.intermediate, c.hidden)
        self.details: dict[str, Any] = {}
        self.done: list[Figure] = []
        """Figures of the phases :meth:`run` finished so far (overlap, recompute, graph probe)."""
        self.base: Callable[[], list[Figure]] | None = None
        """Builds the base measurements' figures while :meth:`run` runs the phases after them (a
        check stopped there, ``--deadline-s``, reports them: ``gpu_check``)."""
        self.stall_ms: list[float] = []
        """Stall observations (ms) of the last :meth:`kvplane_cpu_ms` steps (the timing events')."""
        self.prepare_cpu_ms = 0.0
        """Median of the last :meth:`kvplane_cpu_ms` steps' boundary share (``prepare_step``)."""
        self.dma_error: str | None = "not probed (CUDA only)"
        """Why the copy engines (``--kv-copy-engine dma``) are not measured; None on CUDA until the
        engine refuses them (its probes: ``CudaTransferEngine.set_copy_engine``)."""
        self.cpu_mean_ms = 0.0
        """Mean of the last :meth:`kvplane_cpu_ms` steps (the timed steps' share included)."""
        self.parts_cpu_ms: dict[str, float] = {}
        """Medians of the last :meth:`kvplane_cpu_ms` steps' per-layer calls, summed over layers:
        ``enter`` (``enter_layer``: fetch launches, event waits), ``write``, ``exit``."""

    # ----- one decode step --------------------------------------------------------------

    def step(self, scope: Callable[[str, int], Any] = _no_scope,
             capture: Callable[[int, Any, torch.Tensor], None] | None = None, backend: str | None = None) -> None:
        """One decode step of the batch; ``scope`` wraps each kvplane / attention call."""
        self.layers(self.batch.begin_decode(), scope, capture, backend=backend)

    def layers(self, loc: torch.Tensor, scope: Callable[[str, int], Any] = _no_scope,
               capture: Callable[[int, Any, torch.Tensor], None] | None = None, *,
               backend: str | None = None, plan: bool = True, end_step: bool = True,
               graph: GraphStepBuffers | None = None,
               padded: tuple[torch.Tensor, ...] | None = None) -> list[torch.Tensor]:
        """The layers of the step whose boundary gave ``loc``; each layer's attention output.
        ``backend``: the attention's (default: the primary); ``plan``: FlashInfer's plan inside
        layer 0, as SGLang's decode plans; ``end_step``: the last layer's ``exit_layer`` (which
        ends the step) -- without it the same layers may run again, writing the same token.
        ``graph``: the tables read from these buffers (loaded with the step's), and the buffers'
        ``enter`` / ``exit`` (a staged step's captured fetches and write-back) for the core's: what
        :class:`~sglang_ext.tools.gpu_check_graph.GraphProbe` captures; ``padded``: that
        probe's inputs ``(x, q, k, v)`` padded to the buffers' rows."""
        b, core, last = self.batch, self.batch.core, self.config.layers - 1
        x, q, k1, v1 = padded or (self.x, self.q, b.k1, b.v1)
        idle = core.layers_idle  # as the served adapter: an idle step's layers skip enter / exit (but the last)
        outs = []
        for layer in range(self.config.layers):
            x @ self.w_qkv
            if graph is not None:  # enter / exit: the graph's staged fetches and write-back (if any)
                graph.enter(layer)
                graph.write(core.store, layer, k1, v1)
                view = graph.layer_view(core.store, layer, tuple(b.rids))
            else:
                with scope("kvplane", layer, "enter"):  # the layer's entry (the timeline's mark), called or not
                    if not idle:
                        core.enter_layer(layer)
                with scope("kvplane", layer, "write"):
                    core.write(layer, loc, b.k1, b.v1)
                view = b.layer_view(layer)
            with scope("attention", layer):
                if layer == 0 and plan:  # as SGLang's layered FlashInfer decode plans: inside layer 0, host CSR
                    self.backends.plan_step(core.tables.plan_view(view))
                out = self.backends.run(backend or self.backends.primary, q, view)
            if graph is not None:
                graph.exit(layer)
            if capture is not None:
                capture(layer, view, out)
            gate_up = out.reshape(out.shape[0], -1) @ self.w_o @ self.w_gate_up
            i = self.config.intermediate
            (torch.nn.functional.silu(gate_up[:, :i]) * gate_up[:, i:]) @ self.w_down
            outs.append(out)
            if graph is None and (layer < last or end_step) and (not idle or layer == last):
                with scope("kvplane", layer, "exit"):
                    core.exit_layer(layer)
        return outs

    def kvplane_cpu_ms(self) -> float:
        """Median thread CPU ms per step spent in kvplane (``prepare_step`` + per-layer calls), at
        the served timing interval (``--kv-timing-interval``'s default: most steps record no timing
        event; their mean, with the timed steps' share, goes to ``self.cpu_mean_ms``). Before
        them, as many steps timed every step give their stall observations (ms, ``self.stall_ms``:
        the events' figures need every step observed)."""
        samples, prepare, parts = [], [], []
        core = self.batch.core
        clock = core.store.engine.clock
        served = getattr(clock, "interval", None)  # the CUDA engine's EventClock; None: wall clock
        sync(self.device)
        core.close_transfer_step()  # the stall of earlier steps is not these steps'
        self.stall_ms = []
        if served is not None:
            clock.set_interval(1)
        try:
            for _ in range(self.config.repeat):
                self.step()
                sync(self.device)
                self.stall_ms += [s * 1e3 for s in core.close_transfer_step()]
            if served is not None:
                clock.set_interval(DEFAULT_TIMING_INTERVAL)
                core.close_transfer_step()  # the first step below is decided, not timed by default
            for _ in range(self.config.repeat):
                probe = CpuTimeProbe()
                self.step(probe.scope)
                sync(self.device)
                samples.append((probe.kvplane_s + self.batch.prepare_cpu_s) * 1e3)
                prepare.append(self.batch.prepare_cpu_s * 1e3)
                parts.append(probe.parts_s)
                core.close_transfer_step()
        finally:
            if served is not None:
                clock.set_interval(served)
        self.cpu_mean_ms = statistics.fmean(samples)
        self.prepare_cpu_ms = statistics.median(prepare)
        self.parts_cpu_ms = {k: statistics.median(p[k] * 1e3 for p in parts) for k in ("enter", "write", "exit")}
        return statistics.median(samples)

    def host_profile(self) -> list[dict[str, object]]:
        """The top functions by own host time inside kvplane's scopes over ``PROFILE_STEPS`` steps."""
        probe = HostProfileProbe()
        self.batch.boundary_scope = probe.boundary
        try:
            for _ in range(PROFILE_STEPS):
                self.step(probe.scope)
                probe.steps += 1
        finally:
            self.batch.boundary_scope = nullcontext
        sync(self.device)
        return probe.top()

    def timeline(self) -> dict[str, Any]:
        """The last of ``TIMELINE_STEPS`` steps laid out on the compute stream (:class:`StepTimelineProbe`)."""
        engine = self.batch.core.store.engine
        streams = [s for s in (getattr(engine, "h2d_stream", None), getattr(engine, "d2h_stream", None)) if s is not None]
        probe = StepTimelineProbe(self.device)
        for _ in range(TIMELINE_STEPS):
            sync(self.device)
            probe.begin()
            self.step(probe.scope)
            probe.end(streams)
            sync(self.device)
        return probe.result()

    # ----- the plan ---------------------------------------------------------------------

    def plan(self, comp_ms: list[float], bw_blocks_per_ms: float, share: float | None = None,
             key: str = "plan", staging_on_top: bool = True) -> list[tuple[int, ...]]:
        """Placements from the real planner for the batch as it is now (module docstring, 3),
        leaving ``share`` of the KV out (default: the config's ``offload_share``), plus one
        staging layer per request on top of the budget unless ``staging_on_top`` is False (then
        the staging comes out of it too); recorded in ``details[key]``."""
        c, b = self.config, self.batch
        share = c.offload_share if share is None else share
        window = c.repeat * 3 + 12  # the placed phase's steps (3 x repeat + 10): the plan stays valid over them
        block_bytes = c.layer_page_bytes
        requests = tuple(RequestSpec(id=rid, context_tokens=b.lens[i] + 1, slo_tbt_ms=LOOSE_SLO_MS)
                         for i, rid in enumerate(b.rids))
        blocks = b.blocks(1 + window)
        budget = math.ceil((1.0 - share) * sum(blocks) * c.layers) + (sum(blocks) if staging_on_top else 0)
        batch = Batch(
            model=ModelSpec(layers=c.layers, block_size=c.page_size, block_bytes=block_bytes),
            hardware=Hardware(gpu_kv_budget_blocks=budget, h2d_gbps=bw_blocks_per_ms * block_bytes / 1e6),
            profile=Profile(tuple(comp_ms)),
            requests=requests,
            policy=PlanPolicy(window_min=1, window_max=window),
        )
        plan = Planner().plan(batch)
        rows = [plan.placements.get(rid) for rid in b.rids]
        self.details[key] = {
            **plan.to_dict(), "placements": None, "budget_blocks": budget, "h2d_gbps": batch.hardware.h2d_gbps,
            "offloaded_layers_per_request": [None if r is None else r.count(0) for r in rows],
        }
        if plan.paused or not plan.feasible or any(r is None for r in rows):
            raise RuntimeError(f"the planner paused {plan.paused} or found no feasible plan (feasible="
                               f"{plan.feasible}); budget {budget} blocks of {sum(blocks) * c.layers}")
        return [tuple(r) for r in rows]  # type: ignore[arg-type]

    # ----- attention accuracy -----------------------------------------------------------

    def attention_errors(self) -> dict[str, dict[str, float]]:
        """One placed step: every backend at every layer vs the dense float32 reference."""
        outs: dict[str, list[torch.Tensor]] = {name: [] for name in self.backends.available}

        def capture(layer: int, view: Any, primary_out: torch.Tensor) -> None:
            for name in self.backends.available:
                out = primary_out if name == self.backends.primary else self.backends.run(name, self.q, view)
                outs[name].append(out.float().clone())

        self.step(capture=capture)
        sync(self.device)
        return self.dense_errors(outs)

    def dense_errors(self, outs: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, float]]:
        """Each named output (per layer, the batch's rows) of the step that just ran vs
        ``dense_attention`` over the batch's regenerated K/V (computed once for all of them)."""
        q = self.q.float()
        acc = {name: [0.0, 0.0, 0.0, 0.0] for name in outs}  # max abs, sum sq err, sum sq ref, max |ref|
        for layer in range(self.config.layers):
            for i in range(len(self.batch.rids)):
                ref = dense_attention(q[i : i + 1], *self.batch.reference_kv(i, layer))[0]
                for name, per_layer in outs.items():
                    diff, a = (per_layer[layer][i].float() - ref).nan_to_num(nan=math.inf), acc[name]
                    a[0] = max(a[0], float(diff.abs().max()))
                    a[1] += float((diff * diff).sum())
                    a[2] += float((ref * ref).sum())
                    a[3] = max(a[3], float(ref.abs().max()))
        return {name: {"max_abs_err": mx, "rel_l2_err": math.sqrt(se / sr) if sr > 0 else math.inf,
                       "ref_max_abs": rmax, "tolerance": BF16_ATOL + BF16_RTOL * rmax}
                for name, (mx, se, sr, rmax) in acc.items()}

    # ----- everything -------------------------------------------------------------------

    def run(self) -> list[Figure]:
        c, b, device = self.config, self.batch, self.device
        cuda = device.startswith("cuda")
        L = c.layers
        resident_ms = time_ms(self.step, device, c.repeat)
        advanced_before = b.core.advanced_decode_steps + b.core.opened_advances
        resident_cpu_ms = self.kvplane_cpu_ms()
        resident_cpu_mean_ms = self.cpu_mean_ms
        resident_advanced = b.core.advanced_decode_steps + b.core.opened_advances - advanced_before
        resident_prepare_ms, resident_parts_ms = self.prepare_cpu_ms, self.parts_cpu_ms
        resident_profile = self.host_profile()
        vanilla_write_ms = b.vanilla_write_cpu_ms(c.repeat)
        resident_stall_ms = self.stall_ms
        resident_timeline = self.timeline()
        comp = [resident_ms / L] * L
        resident_host_fraction = b.core.stats().host_fraction
        if cuda:  # the engine probes the copy engines (in a child process first) when asked to use them
            self.dma_error = None
        transfer = TransferCheck(b, c.repeat, self.dma_error).measure()
        self.dma_error = transfer.dma_error
        p = PlacedPhase(self).run(comp, transfer)  # the placed phase, on what serves by default
        errors = self.attention_errors()
        stats = b.core.stats()
        # the model at the link the placed steps' own copies measured (as the served controller
        # samples it), where they measured one; else at the transfer check's (its copy pattern)
        predicted_ms = p.predicted_ms if p.predicted_link_ms is None else p.predicted_link_ms
        stall_measured, stall_predicted = p.placed_ms - resident_ms, predicted_ms - sum(comp)
        stall_err = abs(stall_measured - stall_predicted) / max(stall_predicted, STALL_FLOOR_SHARE * resident_ms)
        self.details.update({
            "attention_backends": {"primary": self.backends.primary, "available": list(self.backends.available),
                                   "unavailable": self.backends.unavailable, "failed": self.backends.failed,
                                   "errors": errors},
            "resident_step_ms": resident_ms, "placed_step_ms": p.placed_ms, "layer_compute_ms": comp[0],
            "predicted_step_ms": predicted_ms, "predicted_step_ms_transfer_check": p.predicted_ms,
            "model_link_gbps": p.link_gbps, "stall_measured_ms": stall_measured,
            "stall_predicted_ms": stall_predicted, "model_blocks_per_request": p.blocks_now,
            "plan_install_offloaded_layer_pages": p.delta.offloaded_layer_pages,
            "kvplane_cpu_ms_per_step": {"resident": resident_cpu_ms, "placed": p.placed_cpu_ms,
                                        "resident_mean": resident_cpu_mean_ms, "placed_mean": p.placed_cpu_mean_ms,
                                        "resident_boundary": resident_prepare_ms,
                                        "placed_boundary": p.placed_prepare_ms,
                                        "resident_layer_calls": resident_parts_ms,
                                        "placed_layer_calls": p.placed_parts_ms,
                                        "resident_steps_advanced": resident_advanced,
                                        "resident_steps_timed": p.steps_run,
                                        "placed_steps_advanced": p.placed_advanced,
                                        "placed_launches_per_step": p.placed_launches,
                                        "vanilla_kv_write": vanilla_write_ms,
                                        "hidden": None},
            "kvplane_host_profile": {"steps": PROFILE_STEPS, "resident": resident_profile, "placed": p.placed_profile,
                                     "note": "cProfile inside the boundary and kvplane's per-layer calls only; "
                                             "top functions by own time per step (ranking, not absolute time)"},
            "transfer": transfer.to_dict(), "placed_engine": "dma" if p.on_dma else "triton",
            "step_timeline": {"resident": resident_timeline, "placed": p.placed_timeline},
            "syncs": {kind: {"count_per_step": p.probe.syncs(kind) / SYNC_STEPS,
                             "runtime": p.probe.runtime[kind], "op_audit": dict(p.probe.audited(kind)),
                             "where": p.probe.where(kind)}
                      for kind in ("kvplane", "attention")},
            "core_stats": {k: v for k, v in asdict(stats).items() if isinstance(v, int | float)},
            "resident_host_fraction": resident_host_fraction,
            "pools": {"device_layer_pages": b.core.store.pages_total, "host_bytes": b.core.config.host_bytes,
                      "batch_pages": b.batch_pages},
        })

        def base() -> list[Figure]:  # the figures of what was measured above (the phases below add theirs)
            if cuda:
                self.details["peak_device_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            events = event_timing_figures(transfer, placed_stall_ms=p.placed_stall_ms,
                                          resident_stall_ms=resident_stall_ms, steps=c.repeat, placed_ms=p.placed_ms,
                                          wall_stall_ms=stall_measured, cuda=cuda, details=self.details)
            return self._figures(errors, transfer, resident_ms, p.placed_ms, stall_err, p.probe,
                                 stats.host_fraction, cuda) + events

        self.base = base
        from sglang_ext.tools.gpu_check_graph import GraphProbe  # they import this module
        from sglang_ext.tools.gpu_check_overlap import OverlapCheck
        from sglang_ext.tools.gpu_check_recompute import RecomputeCheck
        from sglang_ext.tools.gpu_check_staged_graph import StagedGraphProbe

        self.done += guarded_phase(
            "overlap_check", "the overlap phase", "OverlapCheck.run",
            lambda: OverlapCheck(self).run(comp, transfer.bw_blocks_per_ms, resident_ms, transfer.by_programs,
                                           transfer.h2d_gbps))
        # what the overlap phase adds: the hidden placement's host time, the copy caps it swept
        self.details["kvplane_cpu_ms_per_step"]["hidden"] = self.details.get("overlap", {}).get("kvplane_cpu")
        self.details["transfer"] = transfer.to_dict()
        recompute = RecomputeCheck(self)
        self.details["recompute"] = recompute.details  # filled as it runs
        self.done += guarded_phase("recompute_check", "the recompute phase", "RecomputeCheck.run",
                                   lambda: recompute.run(comp, transfer.bw_blocks_per_ms))
        self.done += guarded_phase("graph_probe", "the CUDA-graph probe", "GraphProbe.run",
                                   GraphProbe(self, identity=True, runner=True).run)
        self.done += guarded_phase("graph_staged_probe", "the staged CUDA-graph probe", "StagedGraphProbe.run",
                                   StagedGraphProbe(self).run)  # after the overlap phase: its hidden placement
        return base() + self.done  # ``base`` stays set: a stop before the caller took these recomputes them

    def _figures(self, errors: dict[str, dict[str, float]], t: TransferResult, resident_ms: float,
                 placed_ms: float, stall_err: float, probe: SyncProbe, host_fraction: float,
                 cuda: bool) -> list[Figure]:
        cpu_note = "" if cuda else "CPU: copies are synchronous and the step is CPU compute; not meaningful"
        figs = []
        tolerance = max((e["tolerance"] for e in errors.values()), default=None)
        for name in BACKENDS:
            e = errors.get(name)
            note = self.backends.unavailable.get(name, "")
            if name in self.backends.failed:
                note = f"installed but failed: {self.backends.failed[name]}"
            if e is not None:
                note = (f"relative L2 error {e['rel_l2_err']:.2e}, max |ref| {e['ref_max_abs']:.3g}"
                        + (" (Triton interpreter)" if name == "triton" and not cuda else ""))
            figs.append(Figure.graded(
                f"attention_max_abs_err.{name}", f"layered attention vs dense reference ({name})",
                None if e is None else e["max_abs_err"], "abs", "<=", tolerance,
                f"one placed step, every layer: paged decode over tables.tab[l] vs dense_attention in fp32 "
                f"over the regenerated K/V; bf16 tolerance {BF16_ATOL:g} + {BF16_RTOL:g} x max|ref|",
                meaningful=name not in self.backends.unavailable, note=note))
        figs.append(Figure.graded("step_ms.resident", "decode step, all layers resident", resident_ms, "ms",
                                  None, None, "median wall time of a decode step (device-synchronised)",
                                  note="no target of its own: the stall figure grades the difference"))
        figs.append(Figure.graded("step_ms.placed", "decode step, planner's half-offloaded placement", placed_ms,
                                  "ms", None, None, "median wall time under the plan, same pool",
                                  note=f"host fraction of live KV {host_fraction:.2f}; no target of its own"))
        d = self.details
        figs.append(Figure.graded(
            "stall_rel_err", "measured stall vs the placement model", stall_err, "ratio", "<=", STALL_REL_ERR,
            "|(placed - resident) - (step_time_ms - sum comp)| / model stall (at least "
            f"{STALL_FLOOR_SHARE:.0%} of the resident step); comp = resident step / L, bandwidth from the placed "
            "steps' own copies (the timing events, as served), else one batched engine fetch", meaningful=cuda,
            note=cpu_note or f"measured {d['stall_measured_ms']:.3f} ms, model {d['stall_predicted_ms']:.3f} ms "
            f"(placed on {d['placed_engine']}; link {d['model_link_gbps'] or 0:.1f} GB/s from the steps' copies; "
            f"at the transfer check's bandwidth the model says {d['predicted_step_ms_transfer_check'] - resident_ms:.3f} ms)"))
        kernels_graded, kernels_note = kernels_figure(self.dma_error)
        figs.append(Figure.graded(
            "h2d_vs_contiguous", "batched block-first H2D vs one contiguous pinned copy", t.h2d_vs_contiguous,
            "ratio", ">=", H2D_VS_CONTIGUOUS, f"engine.h2d of K and V of one layer of {t.layer_pages} pages "
            f"({t.bytes / 2**20:.3g} MiB) vs copy_ of the same bytes", meaningful=cuda and kernels_graded,
            note=cpu_note or f"{kernels_note}{t.h2d_gbps:.1f} vs {t.contiguous_gbps:.1f} GB/s ({t.engine})"))
        dma = (t.by_programs or {}).get("dma")
        figs.append(Figure.graded(
            "h2d_vs_contiguous.dma", "batched block-first H2D vs one contiguous pinned copy, copy engines (dma)",
            None if dma is None else dma["h2d_gbps"] / t.contiguous_gbps, "ratio", ">=", H2D_VS_CONTIGUOUS,
            "the same H2D on the copy engines (2-D copies of strided runs, the rest batched) vs copy_ of the same "
            "bytes", meaningful=cuda and dma is not None,
            note=f"not measured: {self.dma_error}" if dma is None else
            f"{dma['h2d_gbps']:.1f} vs {t.contiguous_gbps:.1f} GB/s"))
        figs.append(Figure.graded(
            "duplex_vs_one_direction", "concurrent H2D + D2H vs one direction", t.duplex_vs_one_direction,
            "ratio", ">=", DUPLEX_VS_ONE, "an engine H2D and D2H issued together (two streams): bytes of both "
            "over their time, vs the H2D alone", meaningful=cuda and kernels_graded,
            note=cpu_note or f"{kernels_note}{t.duplex_gbps:.1f} vs {t.h2d_gbps:.1f} GB/s"))
        how = ("torch.cuda.set_sync_debug_mode('warn') inside each call" if cuda
               else "OpAudit (TorchDispatchMode) inside each call")
        figs.append(Figure.graded(
            "host_syncs_per_step.kvplane", "host syncs per step inside layers (kvplane)",
            probe.syncs("kvplane") / SYNC_STEPS, "syncs", "<=", 0.0,
            f"{how}: enter_layer / write / exit_layer over {SYNC_STEPS} placed steps"))
        figs.append(Figure.graded(
            "host_syncs_per_step.attention", f"host syncs per step inside layers (attention: {self.backends.primary})",
            probe.syncs("attention") / SYNC_STEPS, "syncs", "<=", 0.0, f"{how}: the paged decode call",
            meaningful=cuda, note="" if cuda else "the CPU dry run's attention is the torch reference, "
            "which reads lengths on the host by design"))
        share, share_of = cpu_share(d, resident_ms)
        figs.append(Figure.graded(
            "kvplane_cpu_share", "kvplane CPU time per step / all-resident step", share, "ratio",
            "<=", CPU_SHARE, "thread CPU time of prepare_step + per-layer calls (worse of the all-resident step and "
            "the hidden placement's, whose copies the model hides, on the serving engine; the transfer-bound "
            "half-offloaded step's only where the overlap phase failed; median, timing events on about 1 step in "
            f"{DEFAULT_TIMING_INTERVAL} as served) over the all-resident step's wall time", meaningful=cuda,
            note=f"{cpu_note or share_of}; {cpu_split(d)}"))
        host = d["kvplane_cpu_ms_per_step"]
        resident_cpu, vanilla_write = host["resident"], host["vanilla_kv_write"]
        figs.append(Figure.graded(
            "kvplane_cpu_share_net", "kvplane CPU time per all-resident step beyond SGLang's own KV write",
            (resident_cpu - vanilla_write) / resident_ms, "ratio", None, None,
            "(resident kvplane CPU time - the same host's two index_put per layer into flat buffers, as "
            "SGLang's MHATokenToKVPool.set_kv_buffer writes) / the all-resident step", meaningful=cuda,
            note=f"{resident_cpu:.3f} - {vanilla_write:.3f} ms of {resident_ms:.3f} ms; "
            f"{host['resident_steps_advanced']} of {host['resident_steps_timed']} timed steps advanced "
            "(no table build); informational"))
        return figs
