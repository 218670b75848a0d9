"""Protobuf <-> domain translation for the kvplane.v1 API, with validation.

Every ``*_from_proto`` validates what it reads and raises :class:`api.InvalidArgument` whose
message starts with the offending field's path (``report.running[3].context_tokens: -1 is out of
range (allowed >= 1)``), so the service answers INVALID_ARGUMENT naming the field and the range.
Batches go through :meth:`Batch.from_dict`, so the Plan RPC validates exactly like `kvplane plan`.
"""

from __future__ import annotations

import math
from typing import Any

from controlplane import api
from controlplane.model import Batch, Hardware, ModelSpec, Plan, Profile, SchemaError, shown
from controlplane.policy import SCHEDULERS
from kvplane.v1 import controlplane_pb2 as pb

MAX_ID_CHARS = api.MAX_ID_CHARS
"""Longest accepted worker or request id."""
MAX_ENTRIES = 65_536
"""Most entries accepted in any repeated field (requests, running, queued, finished)."""
_INT64_MAX = (1 << 63) - 1


def _invalid(path: str, message: str) -> api.InvalidArgument:
    return api.InvalidArgument(f"{path}: {message}")


def _schema(exc: SchemaError, prefix: str = "") -> api.InvalidArgument:
    field = f"{prefix}.{exc.field}" if prefix and exc.field else (exc.field or prefix)
    message = str(exc)
    if message.startswith(f"{exc.field}: "):
        message = message[len(exc.field) + 2 :]
    return _invalid(field, message)


def _check_id(value: str, path: str) -> str:
    if not value:
        raise _invalid(path, "must be a non-empty string")
    if len(value) > MAX_ID_CHARS:
        raise _invalid(path, f"has {len(value)} characters (allowed [1, {MAX_ID_CHARS}])")
    return value


def _check_len(items: Any, path: str, limit: int = MAX_ENTRIES) -> None:
    if len(items) > limit:
        raise _invalid(path, f"has {len(items)} entries (allowed at most {limit})")


MAX_STEP = 2**62
"""Largest report step accepted: decisions add their window and expiry to it (``apply_at_step``,
``expiry_step``), which must stay int64 on the wire."""


def _check_int(value: int, path: str, lo: int, hi: int = _INT64_MAX) -> int:
    if not lo <= value <= hi:
        bound = f">= {lo}" if hi == _INT64_MAX else f"[{lo}, {hi}]"
        raise _invalid(path, f"{value} is out of range (allowed {bound})")
    return int(value)


def _check_num(value: float, path: str, lo: float, *, open_lo: bool = False) -> float:
    if not math.isfinite(value):
        raise _invalid(path, f"{value} is not finite")
    if value <= lo if open_lo else value < lo:
        raise _invalid(path, f"{value} is out of range (allowed {'>' if open_lo else '>='} {lo})")
    return float(value)


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


# ---------------------------------------------------------------- placement model


def model_to_proto(model: ModelSpec) -> pb.ModelSpec:
    return pb.ModelSpec(
        layers=model.layers, block_size=model.block_size, block_bytes=model.block_bytes
    )


def hardware_to_proto(hw: Hardware) -> pb.Hardware:
    return pb.Hardware(gpu_kv_budget_blocks=hw.gpu_kv_budget_blocks, h2d_gbps=hw.h2d_gbps)


def _profile_dict(msg: pb.Profile) -> dict[str, Any]:
    values = list(msg.layer_compute_ms)
    # One entry = the JSON "number" form (same value for every layer).
    out: dict[str, Any] = {"layer_compute_ms": values[0] if len(values) == 1 else values}
    rms = list(msg.recompute_ms_per_token)  # none: absent (no recompute offered)
    if rms:
        out["recompute_ms_per_token"] = rms[0] if len(rms) == 1 else rms
    if msg.fetch_launch_ms:
        out["fetch_launch_ms"] = msg.fetch_launch_ms
    return out


def profile_to_proto(profile: Profile) -> pb.Profile:
    return pb.Profile(
        layer_compute_ms=profile.layer_compute_ms,
        recompute_ms_per_token=profile.recompute_ms_per_token or (),
        fetch_launch_ms=profile.fetch_launch_ms,
    )


def batch_to_proto(batch: Batch) -> pb.Batch:
    return pb.Batch(
        model=model_to_proto(batch.model),
        hardware=hardware_to_proto(batch.hardware),
        profile=profile_to_proto(batch.profile),
        requests=[
            pb.RequestSpec(
                id=r.id,
                context_tokens=r.context_tokens,
                slo_tbt_ms=r.slo_tbt_ms,
                deposit_tokens=r.deposit_tokens,
                remaining_tokens=r.remaining_tokens,
            )
            for r in batch.requests
        ],
        policy=pb.PlanPolicy(
            alpha=batch.policy.alpha,
            window_min=batch.policy.window_min,
            window_max=batch.policy.window_max,
            max_recompute_ratio=batch.policy.max_recompute_ratio,
            deposit_credit=batch.policy.deposit_credit,
        ),
    )


def batch_from_proto(msg: pb.Batch, prefix: str = "batch") -> Batch:
    """A validated :class:`Batch` (paths as in `kvplane plan`, under ``prefix``)."""
    _check_len(msg.requests, f"{prefix}.requests")
    d: dict[str, Any] = {"requests": []}
    if msg.HasField("model"):
        d["model"] = {
            "layers": msg.model.layers,
            "block_size": msg.model.block_size,
            "block_bytes": msg.model.block_bytes,
        }
    if msg.HasField("hardware"):
        d["hardware"] = {
            "gpu_kv_budget_blocks": msg.hardware.gpu_kv_budget_blocks,
            "h2d_gbps": msg.hardware.h2d_gbps,
        }
    if msg.HasField("profile"):
        d["profile"] = _profile_dict(msg.profile)
    for i, r in enumerate(msg.requests):
        _check_id(r.id, f"{prefix}.requests[{i}].id")
        d["requests"].append(
            {
                "id": r.id,
                "context_tokens": r.context_tokens,
                "slo_tbt_ms": r.slo_tbt_ms,
                "deposit_tokens": r.deposit_tokens,
                "remaining_tokens": r.remaining_tokens if r.HasField("remaining_tokens") else None,
            }
        )
    if msg.HasField("policy"):  # each field unset: the planner's default
        names = ("alpha", "window_min", "window_max", "max_recompute_ratio", "deposit_credit")
        d["policy"] = {name: getattr(msg.policy, name) for name in names if msg.policy.HasField(name)}
    try:
        return Batch.from_dict(d)
    except SchemaError as exc:
        raise _schema(exc, prefix) from exc


def plan_to_proto(plan: Plan) -> pb.Plan:
    msg = pb.Plan(
        feasible=plan.feasible,
        paused=list(plan.paused),
        predicted_step_ms=plan.predicted_step_ms,
        window_steps=plan.window_steps,
        resident_blocks=plan.resident_blocks,
        staging_blocks=plan.staging_blocks,
        solver=plan.solver,
        solve_ms=plan.solve_ms,
    )
    for rid, row in plan.placements.items():
        msg.placements[rid].on_gpu.extend(int(x) for x in row)
    if plan.expiry_step is not None:
        msg.expiry_step = plan.expiry_step
    msg.recompute_blocks.update(plan.recompute_blocks)
    msg.recompute_layers.update(plan.recompute_layers)
    msg.transient_blocks = plan.transient_blocks
    return msg


def plan_from_proto(msg: pb.Plan) -> Plan:
    return Plan(
        feasible=msg.feasible,
        paused=tuple(msg.paused),
        placements=_placements(msg),
        predicted_step_ms=msg.predicted_step_ms,
        window_steps=msg.window_steps,
        resident_blocks=msg.resident_blocks,
        staging_blocks=msg.staging_blocks,
        solver=msg.solver,
        solve_ms=msg.solve_ms,
        expiry_step=_opt(msg, "expiry_step"),
        **_plan_recompute(msg),
    )


_BINARY = frozenset((0, 1))


def _placements(msg: pb.Plan, prefix: str = "plan") -> dict[str, tuple[int, ...]]:
    """The plan's placement rows, each value 0 (host) or 1 (GPU): a worker read any other value
    through ``bool()`` (2 and -1 meant the GPU), without a word."""
    out = {}
    for rid, p in msg.placements.items():
        if not _BINARY.issuperset(p.on_gpu):
            bad = next(x for x in p.on_gpu if x not in _BINARY)
            raise _invalid(f"{prefix}.placements[{shown(rid)}].on_gpu", f"{bad} is not 0 (host) or 1 (GPU)")
        out[rid] = tuple(p.on_gpu)
    return out


def _plan_recompute(msg: pb.Plan, prefix: str = "plan") -> dict[str, Any]:
    """The plan's recompute fields, checked (``docs/recompute.md``): ``u >= 1`` per request,
    ``k >= 0`` for exactly the same requests, transient blocks ``>= 0``."""
    blocks, layers = dict(msg.recompute_blocks), dict(msg.recompute_layers)
    if blocks.keys() != layers.keys():
        raise _invalid(f"{prefix}.recompute_layers", "must have the same request ids as recompute_blocks")
    for rid in blocks:
        _check_int(blocks[rid], f"{prefix}.recompute_blocks[{rid!r}]", 1)
        _check_int(layers[rid], f"{prefix}.recompute_layers[{rid!r}]", 0)
    return {
        "recompute_blocks": blocks,
        "recompute_layers": layers,
        "transient_blocks": _check_int(msg.transient_blocks, f"{prefix}.transient_blocks", 0),
    }


# ---------------------------------------------------------------- worker sessions


def worker_info_to_proto(info: api.WorkerInfo) -> pb.WorkerInfo:
    return pb.WorkerInfo(
        worker_id=info.worker_id,
        model=model_to_proto(info.model),
        hardware=hardware_to_proto(info.hardware),
        profile=profile_to_proto(info.profile),
        scheduler=info.scheduler or "",
        tp_size=info.tp_size,
    )


def worker_info_from_proto(msg: pb.WorkerInfo, prefix: str = "hello") -> api.WorkerInfo:
    _check_id(msg.worker_id, f"{prefix}.worker_id")
    for name in ("model", "hardware", "profile"):
        if not msg.HasField(name):
            raise _invalid(f"{prefix}.{name}", "is required")
    try:
        model = ModelSpec.from_dict(
            {
                "layers": msg.model.layers,
                "block_size": msg.model.block_size,
                "block_bytes": msg.model.block_bytes,
            }
        )
        hardware = Hardware.from_dict(
            {
                "gpu_kv_budget_blocks": msg.hardware.gpu_kv_budget_blocks,
                "h2d_gbps": msg.hardware.h2d_gbps,
            }
        )
        profile = Profile.from_dict(_profile_dict(msg.profile), model.layers)
        hardware.check_moves_blocks(model.block_bytes)  # as every Batch of this worker checks
    except SchemaError as exc:
        raise _schema(exc, prefix) from exc
    if msg.scheduler and msg.scheduler not in SCHEDULERS:
        raise _invalid(f"{prefix}.scheduler", f"{shown(msg.scheduler)} is not one of {SCHEDULERS}")
    return api.WorkerInfo(
        worker_id=msg.worker_id,
        model=model,
        hardware=hardware,
        profile=profile,
        scheduler=msg.scheduler or None,
        tp_size=_check_int(msg.tp_size or 1, f"{prefix}.tp_size", 1, 1024),
    )


def step_report_to_proto(report: api.StepReport) -> pb.StepReport:
    msg = pb.StepReport(
        step=report.step,
        now_ms=report.now_ms,
        layer_compute_ms=report.layer_compute_ms or (),
        finished=list(report.finished),
        pauses_dropped=list(report.pauses_dropped),
    )
    for r in report.running:
        m = msg.running.add(
            id=r.id,
            context_tokens=r.context_tokens,
            generated_tokens=r.generated_tokens,
            paused=r.paused,
        )
        for name in ("slo_tbt_ms", "gpu_layers", "max_new_tokens"):
            if (value := getattr(r, name)) is not None:
                setattr(m, name, value)
    for q in report.queued:
        mq = msg.queued.add(id=q.id, prompt_tokens=q.prompt_tokens, arrival_ms=q.arrival_ms)
        if q.slo_ttft_ms is not None:
            mq.slo_ttft_ms = q.slo_ttft_ms
    for name in ("observed_step_ms", "h2d_gbps", "free_gpu_blocks"):
        if (value := getattr(report, name)) is not None:
            setattr(msg, name, value)
    return msg


def step_report_from_proto(msg: pb.StepReport, prefix: str = "report") -> api.StepReport:
    """A validated :class:`api.StepReport`; raises InvalidArgument naming the field.

    Reports arrive at every decode step of every worker, so valid ones take a fast path that
    builds no field paths; anything it rejects is re-checked by the path-naming validator.
    """
    fast = _step_report_fast(msg)
    return fast if fast is not None else _step_report_checked(msg, prefix)


def _finite_ge(x: float, lo: float) -> bool:
    return math.isfinite(x) and x >= lo


def _step_report_fast(msg: pb.StepReport) -> api.StepReport | None:
    """The report when every field is valid, else None (same rules as the checked path)."""
    if not 0 <= msg.step <= MAX_STEP or not _finite_ge(msg.now_ms, 0.0):
        return None
    running_msgs, queued_msgs, finished = msg.running, msg.queued, tuple(msg.finished)
    layer_ms, dropped = tuple(msg.layer_compute_ms), tuple(msg.pauses_dropped)
    if max(len(running_msgs), len(queued_msgs), len(finished), len(layer_ms), len(dropped)) > MAX_ENTRIES:
        return None
    running = []
    seen: set[str] = set()
    for r in running_msgs:
        rid = r.id
        if not 0 < len(rid) <= MAX_ID_CHARS or rid in seen or r.context_tokens < 1 or r.generated_tokens < 0:
            return None
        seen.add(rid)
        slo = r.slo_tbt_ms if r.HasField("slo_tbt_ms") else None
        gpu_layers = r.gpu_layers if r.HasField("gpu_layers") else None
        max_new = r.max_new_tokens if r.HasField("max_new_tokens") else None
        if (
            (slo is not None and not (math.isfinite(slo) and slo > 0))
            or (gpu_layers is not None and not 0 <= gpu_layers <= 4096)
            or (max_new is not None and max_new < 1)
        ):
            return None
        running.append(
            api.RequestState(rid, r.context_tokens, r.generated_tokens, slo, r.paused, gpu_layers, max_new)
        )
    queued = []
    seen_queued: set[str] = set()
    for q in queued_msgs:
        ttft = q.slo_ttft_ms if q.HasField("slo_ttft_ms") else None
        if q.id in seen_queued:
            return None
        seen_queued.add(q.id)
        if (
            not 0 < len(q.id) <= MAX_ID_CHARS
            or q.prompt_tokens < 1
            or not _finite_ge(q.arrival_ms, 0.0)
            or (ttft is not None and not (math.isfinite(ttft) and ttft > 0))
        ):
            return None
        queued.append(api.QueuedRequest(q.id, q.prompt_tokens, q.arrival_ms, ttft))
    if any(not 0 < len(rid) <= MAX_ID_CHARS for rid in finished + dropped):
        return None
    if any(not _finite_ge(v, 0.0) for v in layer_ms):
        return None
    observed = msg.observed_step_ms if msg.HasField("observed_step_ms") else None
    h2d = msg.h2d_gbps if msg.HasField("h2d_gbps") else None
    free = msg.free_gpu_blocks if msg.HasField("free_gpu_blocks") else None
    if (
        (observed is not None and not _finite_ge(observed, 0.0))
        or (h2d is not None and not (math.isfinite(h2d) and h2d > 0))
        or (free is not None and free < 0)
    ):
        return None
    return api.StepReport(
        step=msg.step,
        now_ms=msg.now_ms,
        running=tuple(running),
        queued=tuple(queued),
        observed_step_ms=observed,
        layer_compute_ms=layer_ms or None,
        h2d_gbps=h2d,
        finished=finished,
        free_gpu_blocks=free,
        pauses_dropped=dropped,
    )


def _step_report_checked(msg: pb.StepReport, prefix: str) -> api.StepReport:
    """The slow, path-naming validation (raises InvalidArgument on the first bad field)."""
    _check_int(msg.step, f"{prefix}.step", 0, MAX_STEP)
    _check_num(msg.now_ms, f"{prefix}.now_ms", 0.0)
    for name, items in (
        ("running", msg.running),
        ("queued", msg.queued),
        ("finished", msg.finished),
        ("layer_compute_ms", msg.layer_compute_ms),
        ("pauses_dropped", msg.pauses_dropped),
    ):
        _check_len(items, f"{prefix}.{name}")
    running = []
    seen: set[str] = set()
    for i, r in enumerate(msg.running):
        p = f"{prefix}.running[{i}]"
        _check_id(r.id, f"{p}.id")
        if r.id in seen:
            raise _invalid(f"{p}.id", f"duplicate id {shown(r.id)}")
        seen.add(r.id)
        slo = _opt(r, "slo_tbt_ms")
        gpu_layers = _opt(r, "gpu_layers")
        max_new = _opt(r, "max_new_tokens")
        running.append(
            api.RequestState(
                id=r.id,
                context_tokens=_check_int(r.context_tokens, f"{p}.context_tokens", 1),
                generated_tokens=_check_int(r.generated_tokens, f"{p}.generated_tokens", 0),
                slo_tbt_ms=None if slo is None else _check_num(slo, f"{p}.slo_tbt_ms", 0.0, open_lo=True),
                paused=r.paused,
                gpu_layers=None if gpu_layers is None else _check_int(gpu_layers, f"{p}.gpu_layers", 0, 4096),
                max_new_tokens=None if max_new is None else _check_int(max_new, f"{p}.max_new_tokens", 1),
            )
        )
    queued = []
    seen_queued: set[str] = set()
    for i, q in enumerate(msg.queued):
        p = f"{prefix}.queued[{i}]"
        _check_id(q.id, f"{p}.id")
        if q.id in seen_queued:
            raise _invalid(f"{p}.id", f"duplicate id {shown(q.id)}")
        seen_queued.add(q.id)
        ttft = _opt(q, "slo_ttft_ms")
        queued.append(
            api.QueuedRequest(
                id=q.id,
                prompt_tokens=_check_int(q.prompt_tokens, f"{p}.prompt_tokens", 1),
                arrival_ms=_check_num(q.arrival_ms, f"{p}.arrival_ms", 0.0),
                slo_ttft_ms=None if ttft is None else _check_num(ttft, f"{p}.slo_ttft_ms", 0.0, open_lo=True),
            )
        )
    for name in ("finished", "pauses_dropped"):
        for i, rid in enumerate(getattr(msg, name)):
            _check_id(rid, f"{prefix}.{name}[{i}]")
    observed = _opt(msg, "observed_step_ms")
    h2d = _opt(msg, "h2d_gbps")
    free = _opt(msg, "free_gpu_blocks")
    layer_ms = tuple(
        _check_num(v, f"{prefix}.layer_compute_ms[{i}]", 0.0)
        for i, v in enumerate(msg.layer_compute_ms)
    )
    return api.StepReport(
        step=msg.step,
        now_ms=msg.now_ms,
        running=tuple(running),
        queued=tuple(queued),
        observed_step_ms=None if observed is None else _check_num(observed, f"{prefix}.observed_step_ms", 0.0),
        layer_compute_ms=layer_ms or None,
        h2d_gbps=None if h2d is None else _check_num(h2d, f"{prefix}.h2d_gbps", 0.0, open_lo=True),
        finished=tuple(msg.finished),
        free_gpu_blocks=None if free is None else _check_int(free, f"{prefix}.free_gpu_blocks", 0),
        pauses_dropped=tuple(msg.pauses_dropped),
    )


def decision_to_proto(d: api.Decision) -> pb.Decision:
    return pb.Decision(
        plan=plan_to_proto(d.plan),
        apply_at_step=d.apply_at_step,
        expiry_step=d.expiry_step,
        pause=list(d.pause),
        resume=list(d.resume),
        admit=list(d.admit),
        min_gpu_layers=dict(d.min_gpu_layers),
        reason=d.reason,
        policy_version=d.policy_version,
    )


def decision_from_proto(msg: pb.Decision) -> api.Decision:
    return api.Decision(
        plan=plan_from_proto(msg.plan),
        apply_at_step=msg.apply_at_step,
        expiry_step=msg.expiry_step,
        pause=tuple(msg.pause),
        resume=tuple(msg.resume),
        admit=tuple(msg.admit),
        min_gpu_layers=dict(msg.min_gpu_layers),
        reason=msg.reason,
        policy_version=msg.policy_version,
    )
