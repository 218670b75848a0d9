"""``SchedulerHooks``: SGLang's scheduler wired to the kvplane control plane (issue 5, control path).

Registered by :mod:`sglang_ext.plugin` in scheduler processes when ``--enable-layered-kv`` is on
(:func:`register`). One :class:`SchedulerHooks` per scheduler (TP rank), stored as
``scheduler._kvplane``:

* AFTER ``Scheduler.__init__``: validate (``--disable-overlap-schedule`` is required: with the
  overlap loop ``run_batch`` only launches a step and its result is processed one iteration later,
  so there is no clean boundary to install a plan at; no pipeline parallelism), then on TP rank 0
  build the :class:`~sglang_ext.control_client.ControlClient` (embedded or ``grpc://``) with a
  :class:`~controlplane.api.WorkerInfo` read off the model config and the KV pool.
* AROUND ``Scheduler.get_next_batch_to_run`` (the step boundary): rank 0 turns the decisions it
  holds into a :class:`~sglang_ext.tp_sync.StepInstall`, broadcast to every rank
  (:class:`~sglang_ext.tp_sync.TpSync`); each rank pauses / resumes requests keeping their KV
  (:class:`~sglang_ext.pause.PauseManager`) and, after SGLang has allocated this step's KV,
  installs the placements on the layered pool (:class:`~sglang_ext.tp_sync.PlacementInstaller`;
  skipped when the layered pool is not active). Local rule: the running batch is never left
  empty while requests are parked (they are all resumed) -- so paused KV never idles a server.
* AROUND ``Scheduler.run_batch``: start the step clock.
* AFTER ``Scheduler.process_batch_result``: step time (launch to processed result, so it includes
  the device sync), finished requests released from the pool, and on rank 0 the
  :class:`~controlplane.api.StepReport` (running incl. paused, queued, finished,
  ``observed_step_ms`` of decode steps, ``free_gpu_blocks``); the decisions it returns are
  applied at the next boundary. Steady decode steps are coalesced, up to
  ``--kv-report-interval`` per report (:meth:`SchedulerHooks._coalesce`): any change is reported
  the step it happens. One JSON line per step goes to ``$KVPLANE_STATS_FILE`` if set
  (:mod:`sglang_ext.settings`).
* AROUND ``Scheduler.abort_request``: a paused request being aborted is resumed first, so SGLang's
  own abort path finishes it and frees its KV.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import socket
import threading
import time
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

import structlog

from controlplane.api import Decision, QueuedRequest, RequestState, StepReport, WorkerInfo
from sglang_ext import compat, overhead, settings
from sglang_ext.admission import GATED_SCHEDULERS, AdmissionGate, request_slo
from sglang_ext.args import LayeredKVArgs
from sglang_ext.control_client import ControlClient, build_control_plane, process_fallback_counter
from sglang_ext.layer_timing import LayerTimer
from sglang_ext.pause import PauseManager
from sglang_ext.tp_sync import PlacementInstaller, StepInstall, TpSync
from sglang_ext.worker_info import build_worker_info

log = structlog.get_logger(__name__)

CONNECT_WAIT_S = 2.0
"""How long start-up waits for a remote control plane before running on the local heuristic."""


_QUIET_BOUNDARY: dict[str, Any] = {
    "admitted_now": [],
    "paused_now": [],
    "resumed_now": [],
    "decision": None,
}
"""What a boundary that installs nothing did (copied per step: the stats line extends it)."""


class StepStatsWriter:
    """Appends one JSON object per line to a file (flushed per line)."""

    def __init__(self, path: str | Path) -> None:
        self._file = Path(path).open("a", buffering=1)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _stats_dict(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    if is_dataclass(stats) and not isinstance(stats, type):
        # flat fields read directly: ``asdict`` deep-copies, which costs more than the rest of
        # the per-step stats line
        values = ((f.name, getattr(stats, f.name)) for f in dataclasses.fields(stats))
        return {k: v for k, v in values if isinstance(v, int | float | bool | str)}
    return None


class SchedulerHooks:
    """The kvplane state of one SGLang scheduler (one TP rank)."""

    def __init__(self, scheduler: Any, args: LayeredKVArgs, env: settings.KvplaneEnv | None = None) -> None:
        if getattr(scheduler, "enable_overlap", False):
            raise RuntimeError(
                "kvplane: --enable-layered-kv requires --disable-overlap-schedule (plans are "
                "installed at step boundaries, which the overlap loop does not have)"
            )
        if int(getattr(getattr(scheduler, "server_args", None), "pp_size", 1) or 1) > 1:
            raise RuntimeError("kvplane: --enable-layered-kv does not support --pp-size > 1")
        self.scheduler = scheduler
        self.args = args
        self.env = env if env is not None else settings.KvplaneEnv(layered_kv_args=args)
        self.layers = int(scheduler.model_config.num_hidden_layers)
        self.page_size = int(getattr(scheduler, "page_size", 1) or 1)
        self.pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        self.installer = PlacementInstaller(self.pool, self.layers)
        tree_hooks = getattr(getattr(scheduler, "tree_cache", None), "residency_hooks", None)
        self.pauser = PauseManager(hooks=tree_hooks, pages_of=self.pages_of)
        self.tp = TpSync.for_scheduler(scheduler)
        self.step = 0
        self._t0 = time.monotonic()
        self._pending: list[Decision] = []
        self._deferred_pause: dict[str, int] = {}
        self._step_started: float | None = None
        self._first_seen_ms: dict[str, float] = {}
        self._boundary: dict[str, Any] = {}
        # report coalescing (rank 0, see _coalesce)
        self._decode_ms = 0.0
        self._decode_steps = 0
        self._layer_ms: tuple[float, ...] | None = None
        self._sent_step = 0
        self._sent_rids: tuple[str, ...] = ()
        self._expiry_step = 0
        self.reports = 0
        """Reports sent to the control plane."""
        self.client: ControlClient | None = None
        self.stats: StepStatsWriter | None = None
        self.admission = AdmissionGate(enabled=args.kv_scheduler in GATED_SCHEDULERS)
        self.timer: LayerTimer | None = None
        backend = getattr(getattr(getattr(scheduler, "tp_worker", None), "model_runner", None), "attn_backend", None)
        if self.tp.is_source and hasattr(backend, "layer_timer"):
            self.timer = backend.layer_timer = LayerTimer(self.layers, getattr(self.pool, "device", "cpu"))
        if self.tp.is_source:
            self.worker = self._worker_info()
            self.client = ControlClient(
                build_control_plane(args),
                self.worker,
                fallbacks=process_fallback_counter(),
                connect_wait_s=CONNECT_WAIT_S if args.kv_control_plane != "embedded" else 0.0,
            )
            atexit.register(self.client.close)
            if self.env.stats_file is not None:
                self.stats = StepStatsWriter(self.env.stats_file)
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
        worker_id = self.env.worker_id or f"sglang-{socket.gethostname()}-{port}"
        return build_worker_info(
            worker_id=worker_id,
            layers=self.layers,
            block_size=self.page_size,
            block_bytes=block_bytes,
            gpu_kv_budget_blocks=self._budget_blocks(),
            args=self.args,
            tp_size=self.tp.world_size,
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
        row = self.scheduler.req_to_token_pool.req_to_token[idx, :length]
        pages = (row // self.page_size).tolist()
        return tuple(dict.fromkeys(int(p) for p in pages))

    # ---- step boundary --------------------------------------------------------------------
    def _compose(self, running_batch: Any) -> StepInstall:
        """Rank 0: the decisions received since the last boundary -> one install."""
        if self.client is not None:
            self._received(self.client.poll())
        decisions = self._pending
        self._pending = []
        pause: dict[str, None] = dict.fromkeys(self._deferred_pause)
        resume: dict[str, None] = {}
        admit: dict[str, None] = {}
        prefill_layers: dict[str, int] = {}
        placements = None
        reasons: list[str] = []
        for d in decisions:
            admit.update(dict.fromkeys(d.admit))
            prefill_layers.update(d.min_gpu_layers)
            for rid in d.pause:
                resume.pop(rid, None)
                pause[rid] = None
                self._deferred_pause.setdefault(rid, self.step)
            for rid in d.resume:
                pause.pop(rid, None)
                self._deferred_pause.pop(rid, None)
                resume[rid] = None
            placements = dict(d.plan.placements)
            reasons.append(d.reason)
        return StepInstall(
            step=self.step + 1,
            pause=tuple(pause),
            resume=tuple(r for r in resume if r in self.pauser),
            placements=placements,
            fallback=bool(self.client is not None and self.client.in_fallback),
            reason=",".join(r for r in reasons if r),
            admit=tuple(admit),
            prefill_layers=prefill_layers or None,
        )

    def boundary(self, running_batch: Any, last_batch: Any) -> Any:
        """Apply this step's install before SGLang builds the batch; returns the running batch."""
        if self._quiet_boundary():
            self._boundary = dict(_QUIET_BOUNDARY, fallback=self.admission.open)
            return running_batch
        install = self.tp.share(self._compose(running_batch) if self.tp.is_source else None)
        self.installer.apply(install)
        self.admission.admit(install.admit)
        self.admission.open = install.fallback
        paused = self.pauser.pause(running_batch, install.pause, self.step + 1)
        for rid in paused:
            self._deferred_pause.pop(rid, None)
        running_batch, resumed = self.pauser.resume(running_batch, install.resume)
        refill = last_batch is not None and not last_batch.is_empty() and last_batch.forward_mode.is_extend()
        if len(self.pauser) and not refill and all(req.finished() for req in running_batch.reqs):
            # idle (finished requests are filtered next): resume everyone rather than idle
            running_batch, more = self.pauser.resume_all(running_batch)
            resumed += more
        # A deferred pause waits for its request to join the running batch (it may still be
        # prefilling); it is dropped once the request is gone.
        if self._deferred_pause:
            alive = {r.rid for r in running_batch.reqs}
            if refill:
                alive |= {r.rid for r in last_batch.reqs}
            for rid in list(self._deferred_pause):
                if rid not in alive and rid not in self.pauser:
                    del self._deferred_pause[rid]
        self._boundary = {
            "admitted_now": list(install.admit),
            "paused_now": paused,
            "resumed_now": resumed,
            "decision": install.reason or None,
            "fallback": install.fallback,
        }
        return running_batch

    def _quiet_boundary(self) -> bool:
        """Single rank, nothing to install: no decision received, nobody paused or waiting to
        be, the fallback state unchanged. Then the full boundary would change nothing."""
        if self.tp.world_size != 1 or self._pending or self._deferred_pause or len(self.pauser):
            return False
        if self.client is None:
            return False
        self._received(self.client.poll())
        return not self._pending and self.client.in_fallback == self.admission.open

    def after_schedule(self, plan: Any) -> None:
        """SGLang allocated this step's KV: install the residency wants (layered pool only)."""
        if not self.installer.layered and self.stats is None:
            return
        live: dict[str, Any] = {}
        running, to_run = getattr(plan, "running_batch", None), getattr(plan, "batch_to_run", None)
        for batch in (running, None if to_run is running else to_run):
            if batch is None:
                continue
            for req in batch.reqs:
                if not req.finished():
                    live.setdefault(req.rid, req)
        parked = {p.req.rid: p.req for p in self.pauser.parked()}
        if self.installer.unchanged(live, parked):
            self._boundary["install_delta"] = None  # steady state: nothing to install
            return
        running = {rid: self.pages_of(req) for rid, req in live.items()}
        paused = {rid: self.pages_of(req) for rid, req in parked.items()}
        try:
            delta = self.installer.install(running, paused)
        except Exception:  # a failed install keeps the previous residency; never fail the step
            log.exception("residency_install_failed", step=self.step + 1)
            delta = None
        self._boundary["install_delta"] = _stats_dict(delta)

    # ---- step end ---------------------------------------------------------------------------
    def start_step(self, batch: Any) -> None:
        self._step_started = time.perf_counter()
        if self.timer is not None:
            mode = getattr(batch, "forward_mode", None)
            self.timer.begin(bool(mode is not None and mode.is_decode()))

    def forward_done(self) -> None:
        if self.timer is not None:
            self.timer.end()

    def end_step(self, batch: Any) -> None:
        step_ms = None
        if self._step_started is not None:
            step_ms = (time.perf_counter() - self._step_started) * 1e3
        self._step_started = None
        self.step += 1
        is_decode = bool(batch.forward_mode.is_decode())
        finished = tuple(dict.fromkeys(r.rid for r in batch.reqs if r.finished()))
        for rid in finished:
            try:
                self.installer.release(rid)
            except Exception:
                log.exception("residency_release_failed", rid=rid)
        if not self.tp.is_source:
            return
        if is_decode and step_ms is not None:
            self._decode_ms += step_ms
            self._decode_steps += 1
        if self.timer is not None:
            layer_ms = self.timer.take()
            if layer_ms is not None:
                self._layer_ms = layer_ms
        send = not self._coalesce(batch, finished, is_decode)
        if not send and self.stats is None:
            return
        observed = self._decode_ms / self._decode_steps if self._decode_steps else None
        report = self._report(batch, finished, observed)
        if self._layer_ms is not None:
            report = dataclasses.replace(report, layer_compute_ms=self._layer_ms)
        if send:
            assert self.client is not None
            self._received(self.client.report(report))
            self._decode_ms, self._decode_steps, self._layer_ms = 0.0, 0, None
            self._sent_step, self._sent_rids = self.step, self._rids(batch)
            self.reports += 1
        if self.stats is not None:
            self._write_stats(report, step_ms, is_decode, reported=send)

    def _received(self, decisions: list[Decision]) -> None:
        """Decisions from the control plane: installed at the next boundary; the newest one's
        expiry bounds report coalescing."""
        if decisions:
            self._expiry_step = decisions[-1].expiry_step
            self._pending.extend(decisions)

    @staticmethod
    def _rids(batch: Any) -> tuple[str, ...]:
        return tuple(r.rid for r in batch.reqs)

    def _coalesce(self, batch: Any, finished: tuple[str, ...], is_decode: bool) -> bool:
        """Whether this step's report may wait for the next one (``--kv-report-interval``).

        Only a steady decode step waits: the same requests as the last report, nothing finished,
        queued or paused, the installed plan not expired, the control plane reachable, fewer
        than ``interval`` steps since the last report. Everything the controller acts on
        (OrbitFlow §3.4's batch-change and expiry triggers, admissions, pause state, outages)
        is therefore reported the step it happens; a steady stretch reaches it as one report
        with the mean decode step time (the profile-mismatch trigger sees it at most
        ``interval - 1`` steps late) and each request's tokens generated since.
        """
        s = self.scheduler
        return (
            is_decode
            and not finished
            and self.step - self._sent_step < self.args.kv_report_interval
            and self.step < self._expiry_step
            and not s.waiting_queue
            and not len(self.pauser)
            and not self._deferred_pause
            and not self._pending
            and self.client is not None
            and not self.client.in_fallback
            and self._rids(batch) == self._sent_rids
        )

    def _now_ms(self) -> float:
        return (time.monotonic() - self._t0) * 1e3

    def _report(self, batch: Any, finished: tuple[str, ...], step_ms: float | None) -> StepReport:
        s = self.scheduler
        chunked = getattr(s, "chunked_req", None)
        seen: dict[str, RequestState] = {}
        live = [*getattr(s.running_batch, "reqs", ()), *batch.reqs]
        for req in live:
            if req.rid in seen or req.finished() or req is chunked or req.rid in self.pauser:
                continue
            seen[req.rid] = self._state(req, paused=False)
        for parked in self.pauser.parked():
            seen[parked.req.rid] = self._state(parked.req, paused=True)
        now = self._now_ms()
        queued = []
        if s.waiting_queue or self._first_seen_ms:
            waiting = {r.rid for r in s.waiting_queue}
            self._first_seen_ms = {k: v for k, v in self._first_seen_ms.items() if k in waiting}
        for req in s.waiting_queue:
            arrival = self._first_seen_ms.setdefault(req.rid, now)
            queued.append(
                QueuedRequest(id=req.rid, prompt_tokens=max(1, len(req.origin_input_ids)), arrival_ms=arrival)
            )
        return StepReport(
            step=self.step,
            now_ms=now,
            running=tuple(seen.values()),
            queued=tuple(queued),
            observed_step_ms=step_ms,
            finished=finished,
            free_gpu_blocks=self._free_blocks(),
        )

    def _state(self, req: Any, *, paused: bool) -> RequestState:
        gpu = None
        if self.installer.layered:
            gpu = self.installer.gpu_layer_count(req.rid) if not paused else 0
        max_new = getattr(req.sampling_params, "max_new_tokens", None)
        out = len(req.output_ids)
        return RequestState(
            id=req.rid,
            context_tokens=max(1, len(req.origin_input_ids) + out),
            generated_tokens=out,
            paused=paused,
            gpu_layers=gpu,
            max_new_tokens=int(max_new) if max_new else None,
            slo_tbt_ms=request_slo(req),
        )

    def _free_blocks(self) -> int | None:
        if self.installer.layered and hasattr(self.pool, "free_device_pages"):
            return int(self.pool.free_device_pages())
        try:
            free_pages = int(self.scheduler.token_to_kv_pool_allocator.available_size()) // self.page_size
        except Exception:
            return None
        return free_pages * self.layers

    def _write_stats(self, report: StepReport, step_ms: float | None, is_decode: bool, *, reported: bool) -> None:
        assert self.stats is not None
        stats = self._pool_stats()
        pool = _stats_dict(stats)
        record: dict[str, Any] = {
            "step": self.step,
            "time_s": round(time.time(), 6),
            "mode": "decode" if is_decode else "extend",
            "step_ms": None if step_ms is None else round(step_ms, 3),
            "reported": reported,
            "running": [r.id for r in report.running if not r.paused],
            "slo_tbt_ms": {r.id: r.slo_tbt_ms for r in report.running if r.slo_tbt_ms is not None},
            "held_total": self.admission.held_total,
            "local_admits": self.admission.local_admits,
            "paused": [r.id for r in report.running if r.paused],
            "queued": len(report.queued),
            "finished": list(report.finished),
            "gpu_layers": {
                rid: sum(w.gpu_layers) for rid, w in self.installer.last_wants.items() if not w.paused
            },
            "layers": self.layers,
            "layer_compute_ms": None if report.layer_compute_ms is None else [round(x, 4) for x in report.layer_compute_ms],
            "layered_pool": self.installer.layered,
            "fallback": bool(self.client is not None and self.client.in_fallback),
            "fallback_steps": 0 if self.client is None else self.client.fallback_steps,
            "free_gpu_blocks": report.free_gpu_blocks,
            "pool": pool,
            **{k: v for k, v in self._boundary.items() if k != "fallback"},
        }
        for key in ("device_pages_used", "device_pages_total", "host_fraction"):
            record[key] = None if pool is None else pool.get(key)
        try:
            self.stats.write(record)
        except Exception:
            log.warning("stats_write_failed", exc_info=True)
        self._boundary = {}


# ----- SGLang hooks --------------------------------------------------------------------------


def _hooks_of(scheduler: Any) -> SchedulerHooks | None:
    return getattr(scheduler, "_kvplane", None)


def _after_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    env = settings.KvplaneEnv.from_environ()
    if env.layered_kv_args.enable_layered_kv:
        scheduler._kvplane = SchedulerHooks(scheduler, env.layered_kv_args, env)
    return None


def _around_next_batch(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    hooks = _hooks_of(scheduler)
    if hooks is None:
        return original(scheduler, *args, **kwargs)
    meter = overhead.METER
    t0 = time.perf_counter()
    call = dict(zip(compat.SCHEDULER_GET_NEXT_BATCH_TO_RUN.args, args, strict=False))
    call.update(kwargs)
    running = call.get("running_batch", scheduler.running_batch)
    running = hooks.boundary(running, call.get("last_batch", scheduler.last_batch))
    scheduler.running_batch = running
    call["running_batch"] = running
    held = hooks.admission.hold_back(scheduler, running, hooks.pauser)
    t1 = time.perf_counter()
    try:
        plan = original(scheduler, **call)
    finally:
        hooks.admission.restore(scheduler, held)
    t2 = time.perf_counter()
    hooks.after_schedule(plan)
    if meter is not None:
        meter.add("boundary", t1 - t0)
        meter.add("after_schedule", time.perf_counter() - t2)
        if getattr(plan, "batch_to_run", plan) is None:
            meter.idle()
    return plan


def _around_run_batch(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    hooks = _hooks_of(scheduler)
    if hooks is None:
        return original(scheduler, *args, **kwargs)
    hooks.start_step(args[0] if args else kwargs.get(compat.SCHEDULER_RUN_BATCH.args[0]))
    result = original(scheduler, *args, **kwargs)
    hooks.forward_done()
    return result


def _after_process_result(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    hooks = _hooks_of(scheduler)
    if hooks is not None:
        t0 = time.perf_counter()
        try:
            hooks.end_step(batch)
        except Exception:  # telemetry must never kill the scheduler
            log.exception("kvplane_end_step_failed", step=hooks.step)
        meter = overhead.METER
        if meter is not None and hooks.tp.is_source:
            meter.add("end_step", time.perf_counter() - t0)
            meter.step_done()
    return None


def _around_abort(original: Any, scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
    hooks = _hooks_of(scheduler)
    if hooks is not None and len(hooks.pauser):
        rid = getattr(recv_req, "rid", "") or ""
        every = bool(getattr(recv_req, "abort_all", False))
        scheduler.running_batch, resumed = hooks.pauser.resume_matching(
            scheduler.running_batch, lambda req: every or req.rid.startswith(rid)
        )
        if resumed:
            log.info("paused_requests_aborted", rids=resumed)
    return original(scheduler, recv_req, *args, **kwargs)


def register(hook_registry: Any, hook_type: Any) -> None:
    """Install the scheduler hooks (called by the plugin when the flag is on)."""
    hook_registry.register(compat.SCHEDULER_INIT.path, _after_init, hook_type.AFTER)
    hook_registry.register(compat.SCHEDULER_GET_NEXT_BATCH_TO_RUN.path, _around_next_batch, hook_type.AROUND)
    hook_registry.register(compat.SCHEDULER_RUN_BATCH.path, _around_run_batch, hook_type.AROUND)
    hook_registry.register(compat.SCHEDULER_PROCESS_BATCH_RESULT.path, _after_process_result, hook_type.AFTER)
    hook_registry.register(compat.SCHEDULER_ABORT_REQUEST.path, _around_abort, hook_type.AROUND)
