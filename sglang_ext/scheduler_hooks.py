"""``SchedulerHooks``: SGLang's scheduler wired to the kvplane control plane (issue 5, control path).

Registered by :mod:`sglang_ext.plugin` in scheduler processes when ``--enable-layered-kv`` is on
(:func:`register`). One :class:`SchedulerHooks` per scheduler (TP rank), stored as
``scheduler._kvplane``, composed of one object per role:

* :class:`~sglang_ext.step_boundary.StepBoundary` -- the plan installed at step boundaries
  (pause / resume, admission, placements, residency wants), identically on every TP rank;
* :class:`~sglang_ext.step_reporter.StepReporter` -- rank 0's coalesced step reports to the
  control plane (:class:`~sglang_ext.control_client.ControlClient`), whose decisions wait in the
  :class:`~sglang_ext.decision_inbox.DecisionInbox` for the next boundary;
* :class:`~sglang_ext.step_stats_writer.StepStatsWriter` -- rank 0's JSON line per step
  (``$KVPLANE_STATS_FILE``);
* :mod:`sglang_ext.worker_info` -- the session's ``WorkerInfo`` (KV shape, budget, profile);
* :class:`~sglang_ext.request_placement.RequestPlacement` -- rank 0's records of the requests that
  asked for their placement info (``custom_params.kvplane_return_placement``);
* :class:`~sglang_ext.policy_endpoint.PolicyEndpoint` -- rank 0's live policy API
  (``--kv-policy-listen``); the admission gate of a single-rank scheduler follows its scheduler,
  and :class:`~sglang_ext.pacing_slo_publisher.PacingSloPublisher` sends a changed default TBT SLO
  to the main process's pacer (``--kv-pacing on``) at the step boundary.

Hook points:

* AFTER ``Scheduler.__init__``: validate (SGLang's overlap loop only with ``--kv-overlap-schedule
  on``, not on ROCm: there ``run_batch`` only launches a step and its result is processed one
  iteration later, ``docs/overlap-schedule.md``; no pipeline parallelism), then on TP rank 0
  build the control client (embedded or ``grpc://``) with a ``WorkerInfo`` read off the model
  config and the KV pool. AROUND it, outermost: a failed start recorded for an offline engine
  (:mod:`sglang_ext.scheduler_start_failure`).
* AROUND ``Scheduler.get_next_batch_to_run`` (the step boundary): :meth:`StepBoundary.apply`
  before SGLang builds the batch, the admission gate around it, :meth:`StepBoundary.after_schedule`
  after SGLang allocated the step's KV.
* AROUND ``Scheduler.run_batch``: start the step clock.
* AFTER ``Scheduler.process_batch_result``: step time (launch to processed result, so it includes
  the device sync), finished requests released from the pool, and on rank 0 the step report
  (:meth:`StepReporter.end_step`) and the stats line.
* AROUND ``Scheduler.abort_request``, ``pause_generation``, ``update_running_batch``,
  ``is_fully_idle``, ``get_prefill_adder_class``, ``init_load_inquirer``, ``_poll_timeout_aborts``,
  ``can_schedule_lora_req``, ``collect_inflight_reqs`` and ``get_num_allocatable_reqs``: SGLang's calls that must see parked requests (:mod:`sglang_ext.parked_lifecycle`).
* AFTER ``Scheduler._add_request_to_queue``: a request that asked for its placement info is noted.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import socket
import time
from typing import Any

import structlog
import torch

from controlplane.api import WorkerInfo
from sglang_ext import compat, parked_lifecycle, settings
from sglang_ext.admission import GATED_SCHEDULERS, AdmissionGate, live_request_ids
from sglang_ext.context import PluginContext
from sglang_ext.control_client import ControlClient, build_control_plane
from sglang_ext.decision_inbox import DecisionInbox
from sglang_ext.launch_decision import DP_ATTENTION_REFUSED, ROCM_OVERLAP_REFUSED
from sglang_ext.layer_timing import LayerTimer
from sglang_ext.pacing_slo_publisher import PacingSloPublisher
from sglang_ext.pause import PauseManager
from sglang_ext.policy_endpoint import PolicyEndpoint
from sglang_ext.recompute_requests import RecomputeRequests
from sglang_ext.request_placement import RequestPlacement
from sglang_ext.scheduler_start_failure import around_scheduler_init
from sglang_ext.step_boundary import StepBoundary
from sglang_ext.step_clock import StepClock
from sglang_ext.step_reporter import StepReporter
from sglang_ext.step_stats_writer import StepStatsWriter
from sglang_ext.tp_sync import PlacementInstaller, TpSync
from sglang_ext.worker_info import build_worker_info
from sglang_ext.worker_metrics import WorkerMetrics

log = structlog.get_logger(__name__)

CONNECT_WAIT_S = 2.0
"""How long start-up waits for a remote control plane before running on the local heuristic."""
PRUNE_EVERY = 64
"""Steps between prunes of prefill placements whose request this worker no longer holds."""


class SchedulerHooks:
    """The kvplane state of one SGLang scheduler (one TP rank), built from the process's
    :class:`~sglang_ext.context.PluginContext` (options, variables, meter, metrics registry)."""

    def __init__(self, scheduler: Any, ctx: PluginContext) -> None:
        args = ctx.layered
        if args is None or not args.enable_layered_kv:
            raise ValueError("kvplane: SchedulerHooks needs a context with --enable-layered-kv on")
        self.overlap = bool(getattr(scheduler, "enable_overlap", False))
        """SGLang's overlap loop: step k's results are processed after step k+1 is launched."""
        if self.overlap and args.kv_overlap_schedule != "on":
            raise RuntimeError(
                "kvplane: --enable-layered-kv runs SGLang's overlap scheduler only with "
                "--kv-overlap-schedule on (else pass --disable-overlap-schedule)"
            )
        if self.overlap and getattr(torch.version, "hip", None):  # a launch that bypassed the CLI check
            raise RuntimeError(f"kvplane: {ROCM_OVERLAP_REFUSED}")
        server_args = getattr(scheduler, "server_args", None)
        if int(getattr(server_args, "pp_size", 1) or 1) > 1:
            raise RuntimeError("kvplane: --enable-layered-kv does not support --pp-size > 1")
        if getattr(server_args, "enable_dp_attention", False) or int(getattr(server_args, "attn_dp_size", 1) or 1) > 1:
            raise RuntimeError(f"kvplane: {DP_ATTENTION_REFUSED}")  # a launch that bypassed the CLI check
        self.scheduler = scheduler
        self.ctx = ctx
        self.dp_size = int(getattr(server_args, "dp_size", 1) or 1)
        self.dp_rank = compat.replica_rank(self.dp_size)
        """The data-parallel replica (``--dp-size``): its own worker id and output files."""
        self.args = args
        self.env = ctx.env
        self.meter = ctx.meter
        """kvplane's own time per step (``$KVPLANE_OVERHEAD_FILE``, per replica), None when not measured."""
        if self.meter is not None and self.env.overhead_file is not None:
            self.meter.path = settings.rank_output_file(self.env.overhead_file, 0, self.dp_rank)
        self.layers = int(scheduler.model_config.num_hidden_layers)
        self.page_size = int(getattr(scheduler, "page_size", 1) or 1)
        self.pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        self.installer = PlacementInstaller(self.pool, self.layers)
        tree_hooks = getattr(getattr(scheduler, "tree_cache", None), "residency_hooks", None)
        self.pauser = PauseManager(hooks=tree_hooks, pages_of=self.pages_of, in_flight_steps=int(self.overlap))
        drainer = getattr(scheduler, "lora_drainer", None)
        if drainer is not None:  # SGLang's LoRA drainer counts the parked requests' adapters too
            drainer.update_draining_state = parked_lifecycle.drainer_seeing_parked(
                drainer.update_draining_state, self.pauser)
            log.info("kvplane_lora_drainer_counts_parked")
        self.preempt_loras: set = set()
        """LoRA adapters of parked requests resumed for a priority preemption in the current
        admission pass (:func:`sglang_ext.parked_lifecycle._preempting`)."""
        self.prefill_adders: dict[type, type] = {}
        """SGLang's prefill adder classes -> their subclass reserving parked requests' decode tokens
        (:func:`sglang_ext.parked_lifecycle.reserving_adder`)."""
        self.tp = TpSync.for_scheduler(scheduler)
        self.step = 0
        t0 = time.monotonic()
        self.clock = StepClock()
        self._ended: frozenset[str] = frozenset()
        """Requests the last processed step ended (the overlap loop's next step still carries them)."""
        self.inbox = DecisionInbox()
        self.admission = AdmissionGate(enabled=args.kv_scheduler in GATED_SCHEDULERS)
        self.client: ControlClient | None = None
        self.reporter: StepReporter | None = None
        self.stats: StepStatsWriter | None = None
        self.timer: LayerTimer | None = None
        runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
        backend = getattr(runner, "attn_backend", None)
        if self.tp.is_source and hasattr(backend, "layer_timer"):
            self.timer = backend.layer_timer = LayerTimer(self.layers, getattr(self.pool, "device", "cpu"),
                                                          eager_samples=self.overlap)
        self._forward_stream = getattr(runner, "forward_stream", None) if self.overlap else None
        """Where the overlap loop runs the forward (None: the current stream)."""
        if hasattr(backend, "layer_timer"):  # the layered attention backend times its own parts
            backend.overhead_meter = self.meter
        tree_cache = getattr(scheduler, "tree_cache", None)
        if hasattr(tree_cache, "overhead_meter"):  # so does the layered radix cache (allocation wrappers)
            tree_cache.overhead_meter = self.meter
        self.recompute = RecomputeRequests(layers=self.layers, page_size=self.page_size,
                                           installer=self.installer, backend=backend,
                                           default_ratio=args.kv_recompute_ratio,
                                           default_layers=args.kv_recompute_layers)
        self.metrics = WorkerMetrics.for_scheduler(
            scheduler, layers=self.layers, page_size=self.page_size, source=self.tp.is_source,
            registry=ctx.metrics_registry,
        )
        """kvplane's metrics on SGLang's /metrics; None without SGLang's --enable-metrics."""
        if self.metrics is not None and self.installer.layered:
            self.metrics.attach_pool(self.pool, backend)
        self.placement: RequestPlacement | None = None
        """Per-request placement info for the requests that ask (rank 0)."""
        self.policy_endpoint: PolicyEndpoint | None = None
        """The live policy API (``--kv-policy-listen``, rank 0)."""
        self.slo_publisher: PacingSloPublisher | None = None
        """Sends a live change of the default TBT SLO to the pacer (endpoint and pacing on, rank 0)."""
        if self.tp.is_source:
            self.worker = self._worker_info()
            metrics = self.metrics
            control_plane = build_control_plane(args, observer=None if metrics is None else metrics.controller_observer())
            self.policy_endpoint = PolicyEndpoint.launch(args, control_plane)
            if self.policy_endpoint is not None:  # the live policy's scheduler decides, not the worker
                self.worker = dataclasses.replace(self.worker, scheduler=None)
            self.slo_publisher = PacingSloPublisher.for_scheduler(scheduler, args, self.policy_endpoint, control_plane)
            self.client = ControlClient(
                control_plane,
                self.worker,
                fallbacks=None if metrics is None else metrics.fallbacks,
                on_decisions=None if metrics is None else metrics.decisions,
                on_outage=None if metrics is None else metrics.outage,
                connect_wait_s=CONNECT_WAIT_S if args.kv_control_plane != "embedded" else 0.0,
            )
            if metrics is not None:
                metrics.bind_control_plane(control_plane, self.client, args.kv_policy)
            atexit.register(self.client.close)
            self.placement = RequestPlacement.for_scheduler(self, control_plane)
            if self.meter is not None and hasattr(tree_cache, "meter_on_release"):
                tree_cache.meter_on_release()  # after the last on_release wrapper (placement info)
            self.reporter = StepReporter(
                scheduler=scheduler,
                client=self.client,
                inbox=self.inbox,
                pauser=self.pauser,
                installer=self.installer,
                pool=self.pool,
                layers=self.layers,
                page_size=self.page_size,
                report_interval=args.kv_report_interval,
                quiet_interval=args.report_quiet_interval,
                t0=t0,
            )
            if self.env.stats_file is not None:
                self.stats = StepStatsWriter(settings.rank_output_file(self.env.stats_file, 0, self.dp_rank))
            log.info(
                "kvplane_scheduler_ready",
                worker=self.worker.worker_id,
                control_plane=args.kv_control_plane,
                profile=args.kv_profile or "default",
                h2d_gbps=self.worker.hardware.h2d_gbps,
                layers=self.layers,
                block_size=self.page_size,
                gpu_kv_budget_blocks=self.worker.hardware.gpu_kv_budget_blocks,
                layered_pool=self.installer.layered,
                tp_size=self.tp.world_size,
                report_interval=args.kv_report_interval,
                report_quiet_interval=args.report_quiet_interval,
            )
        self.boundary = StepBoundary(
            tp=self.tp,
            installer=self.installer,
            pauser=self.pauser,
            admission=self.admission,
            inbox=self.inbox,
            client=self.client,
            pages_of=self.pages_of,
            keep_record=self.stats is not None,
            # compat.SCHEDULER_FINISHING_INFLIGHT (the overlap loop's; [] without it)
            finishing_in_flight=getattr(scheduler, "_reqs_finishing_inflight", None),
        )

    # ---- set-up -------------------------------------------------------------------------
    def _worker_info(self) -> WorkerInfo:
        pool, s = self.pool, self.scheduler
        head_num = int(getattr(pool, "head_num", 1))
        head_dim = int(getattr(pool, "head_dim", 1))
        v_head_dim = int(getattr(pool, "v_head_dim", head_dim) or head_dim)
        dtype = getattr(pool, "store_dtype", None) or getattr(pool, "dtype", None)
        elem = int(getattr(dtype, "itemsize", 2))
        block_bytes = max(1, self.page_size * head_num * (head_dim + v_head_dim) * elem)
        port = getattr(getattr(s, "server_args", None), "port", None) or os.getpid()
        worker_id = settings.replica_worker_id(self.env.worker_id or f"sglang-{socket.gethostname()}-{port}",
                                               self.dp_rank, self.dp_size)
        return build_worker_info(
            worker_id=worker_id,
            layers=self.layers,
            block_size=self.page_size,
            block_bytes=block_bytes,
            gpu_kv_budget_blocks=self._budget_blocks(),
            args=self.args,
            tp_size=self.tp.world_size,
            can_recompute=self.recompute.plannable,
        )

    def _budget_blocks(self) -> int:
        """GPU KV budget in blocks of one layer: the layered pool's device pages, else
        ``--kv-gpu-budget-tokens`` / page size, else SGLang's whole pool times the layers."""
        stats = self._pool_stats()
        for name in ("device_pages_total", "device_pages"):
            if stats is not None and isinstance(getattr(stats, name, None), int):
                return int(getattr(stats, name))
        tokens = getattr(self.args, "kv_gpu_budget_tokens", None)
        if tokens:
            return max(1, int(tokens) // self.page_size)
        allocator = self.scheduler.token_to_kv_pool_allocator
        return max(1, int(allocator.size) // self.page_size * self.layers)

    def _pool_stats(self) -> Any:
        if not self.installer.layered or not hasattr(self.pool, "residency_stats"):
            return None
        try:
            return self.pool.residency_stats()
        except Exception:
            log.warning("residency_stats_failed", exc_info=True)
            return None

    # ---- per-request views --------------------------------------------------------------
    def pages_of(self, req: Any) -> tuple[int, ...]:
        """The request's logical pages (SGLang slot // page_size), in order."""
        idx = req.kv.req_pool_idx
        if idx is None:
            return ()
        length = int(req.kv.kv_allocated_len or 0)
        if length <= 0:
            return ()
        table = self.scheduler.req_to_token_pool.req_to_token
        row = table.numpy()[idx, :length] if table.device.type == "cpu" else table[idx, :length]
        pages = (row // self.page_size if self.page_size > 1 else row).tolist()  # Python ints
        return tuple(dict.fromkeys(pages))

    # ---- step ---------------------------------------------------------------------------
    def start_step(self, batch: Any) -> None:
        self.clock.launched()
        if self.timer is not None:
            mode = getattr(batch, "forward_mode", None)
            self.timer.begin(bool(mode is not None and mode.is_decode()))

    def forward_done(self) -> None:
        if self.timer is not None:  # under the overlap loop the forward ran on the runner's stream
            self.timer.end(self._forward_stream)

    def end_step(self, batch: Any) -> None:
        """``process_batch_result`` of ``batch`` returned (under SGLang's overlap loop: the step
        launched before the last one; the clock and the layer timer pair by order)."""
        step_ms = self.clock.processed()
        layer_ms = self.timer.take() if self.timer is not None else None  # first: pairs by order
        self.step += 1
        is_decode = bool(batch.forward_mode.is_decode())
        ended = self._ended
        # under the overlap loop a request that finished in step k (EOS, a stop string) is still in
        # step k+1, launched before step k's results were processed: it ended once, not twice
        finished: tuple[str, ...] = tuple([r.rid for r in batch.reqs if r.finished() and r.rid not in ended])
        if len(finished) > 1:
            finished = tuple(dict.fromkeys(finished))
        self._ended = frozenset(finished) if finished or ended else ended
        if finished and len(self.pauser) and self.pauser.drop_finished(finished):
            # overlap loop: a request parked while its last step ran. Its row and KV are freed, so
            # admission may go on: SGLang clears a full batch's flag only when a running request
            # leaves it (scheduler audit, session 82)
            running = getattr(self.scheduler, "running_batch", None)
            if running is not None:
                running.batch_is_full = False
        for rid in finished:
            try:
                self.installer.release(rid)
            except Exception:
                log.exception("residency_release_failed", rid=rid)
        metrics = self.metrics
        if metrics is not None:
            adm = self.admission
            metrics.end_step(paused=len(self.pauser), held_total=adm.held_total, local_admits=adm.local_admits)
            if finished and self.tp.is_source:
                metrics.finished(r for r in batch.reqs if r.rid in self._ended)
        if self.reporter is None:  # not TP rank 0
            return
        report, sent = self.reporter.end_step(
            batch,
            step=self.step,
            finished=finished,
            is_decode=is_decode,
            step_ms=step_ms,
            layer_ms=layer_ms,
            build_always=self.stats is not None,
        )
        if sent and metrics is not None and report is not None:
            metrics.report_sent(report)
        if self.stats is not None and report is not None:
            self.stats.write_step(
                step=self.step,
                report=report,
                step_ms=step_ms,
                is_decode=is_decode,
                reported=sent,
                layers=self.layers,
                pool_stats=self._pool_stats(),
                boundary=self.boundary.take_record(),
                admission=self.admission,
                installer=self.installer,
                client=self.client,
                report_quiet=self.reporter.coalesced_quiet,
            )


# ----- SGLang hooks --------------------------------------------------------------------------


_NEXT_BATCH_ARGS = compat.SCHEDULER_GET_NEXT_BATCH_TO_RUN.args
"""Positional argument names of ``get_next_batch_to_run`` (read once: the hook runs every
scheduler iteration, idle ones included)."""


def _hooks_of(scheduler: Any) -> SchedulerHooks | None:
    return getattr(scheduler, "_kvplane", None)


def _after_init(ctx: PluginContext, result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    if ctx.enabled:
        scheduler._kvplane = SchedulerHooks(scheduler, ctx)
    return None


def _around_next_batch(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    hooks = _hooks_of(scheduler)
    if hooks is None:
        return original(scheduler, *args, **kwargs)
    meter = hooks.meter
    t0 = time.perf_counter()
    call = dict(zip(_NEXT_BATCH_ARGS, args, strict=False))
    call.update(kwargs)
    running = call.get("running_batch", scheduler.running_batch)
    endpoint = hooks.policy_endpoint
    if endpoint is not None and hooks.tp.world_size == 1:  # the gate follows the live scheduler
        hooks.admission.enabled = endpoint.scheduler_gated()  # (before the boundary's admits)
    last_batch = call.get("last_batch", scheduler.last_batch)
    running = hooks.boundary.apply(running, last_batch, hooks.step)
    scheduler.running_batch = running
    call["running_batch"] = running
    if hooks.slo_publisher is not None:  # the pacer follows the live default SLO
        hooks.slo_publisher.poll()
    installer = hooks.installer
    if installer.prefill_placements and hooks.step % PRUNE_EVERY == 0:  # before SGLang takes from the queue
        installer.prune_prefill(live_request_ids(scheduler, running, last_batch, hooks.pauser))
    held = hooks.admission.hold_back(scheduler, running, hooks.pauser, last_batch)
    t1 = time.perf_counter()
    try:
        plan = original(scheduler, **call)
    finally:
        hooks.admission.restore(scheduler, held)
    t2 = time.perf_counter()
    hooks.recompute.prepare(plan)
    hooks.boundary.after_schedule(plan, hooks.step)
    if hooks.placement is not None and hooks.placement.active:
        hooks.placement.installed()
    if hooks.metrics is not None:
        hooks.metrics.boundary(hooks.boundary.record)
    if meter is not None:
        t3 = time.perf_counter()
        if getattr(plan, "batch_to_run", plan) is None:  # no step: nothing waited on this
            meter.idle((t1 - t0) + (t3 - t2))
        else:
            meter.add("boundary", t1 - t0)
            meter.add("after_schedule", t3 - t2)
    return plan


def _around_run_batch(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    hooks = _hooks_of(scheduler)
    if hooks is None:
        return original(scheduler, *args, **kwargs)
    meter = hooks.meter
    t0 = time.perf_counter()
    hooks.start_step(args[0] if args else kwargs.get(compat.SCHEDULER_RUN_BATCH.args[0]))
    t1 = time.perf_counter()
    result = original(scheduler, *args, **kwargs)
    t2 = time.perf_counter()
    hooks.forward_done()
    if meter is not None:
        meter.add("run_batch", (t1 - t0) + (time.perf_counter() - t2))  # the step's timing brackets
    return result


def _after_process_result(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    hooks = _hooks_of(scheduler)
    if hooks is not None:
        t0 = time.perf_counter()
        try:
            hooks.end_step(batch)
        except Exception:  # telemetry must never kill the scheduler
            log.exception("kvplane_end_step_failed", step=hooks.step)
        meter = hooks.meter
        if meter is not None and hooks.tp.is_source:
            meter.add("end_step", time.perf_counter() - t0)
            meter.step_done()
    return None


def _after_add_request_to_queue(result: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    hooks = _hooks_of(scheduler)
    if hooks is not None and hooks.placement is not None:
        hooks.placement.arrived(req)
    return None


def register(hook_registry: Any, hook_type: Any, ctx: PluginContext) -> None:
    """Install the scheduler hooks (called by the plugin when the flag is on); the schedulers
    built in this process get ``ctx``."""
    hook_registry.register(compat.SCHEDULER_INIT.path, functools.partial(_after_init, ctx), hook_type.AFTER)
    hook_registry.register(compat.SCHEDULER_INIT.path, around_scheduler_init, hook_type.AROUND)  # outermost
    hook_registry.register(compat.SCHEDULER_GET_NEXT_BATCH_TO_RUN.path, _around_next_batch, hook_type.AROUND)
    hook_registry.register(compat.SCHEDULER_RUN_BATCH.path, _around_run_batch, hook_type.AROUND)
    hook_registry.register(compat.SCHEDULER_PROCESS_BATCH_RESULT.path, _after_process_result, hook_type.AFTER)
    for target, hook in ((compat.SCHEDULER_ABORT_REQUEST, parked_lifecycle.around_abort),
                         (compat.SCHEDULER_PAUSE_GENERATION, parked_lifecycle.around_pause_generation),
                         (compat.SCHEDULER_IS_FULLY_IDLE, parked_lifecycle.around_is_fully_idle),
                         (compat.SCHEDULER_PREFILL_ADDER_CLASS, parked_lifecycle.around_prefill_adder_class),
                         (compat.SCHEDULER_INIT_LOAD_INQUIRER, parked_lifecycle.around_init_load_inquirer),
                         (compat.SCHEDULER_UPDATE_RUNNING_BATCH, parked_lifecycle.around_update_running_batch),
                         (compat.SCHEDULER_POLL_TIMEOUT_ABORTS, parked_lifecycle.around_poll_timeout_aborts),
                         (compat.SCHEDULER_CAN_SCHEDULE_LORA_REQ, parked_lifecycle.around_can_schedule_lora_req),
                         (compat.SCHEDULER_COLLECT_INFLIGHT_REQS, parked_lifecycle.around_collect_inflight_reqs),
                         (compat.SCHEDULER_NUM_ALLOCATABLE_REQS, parked_lifecycle.around_num_allocatable_reqs)):
        hook_registry.register(target.path, hook, hook_type.AROUND)  # parked requests' lifecycle
    hook_registry.register(compat.SCHEDULER_ADD_REQUEST_TO_QUEUE.path, _after_add_request_to_queue, hook_type.AFTER)
