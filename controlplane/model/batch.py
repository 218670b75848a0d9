"""Typed, validated inputs of one planning problem (the `kvplane plan --batch` schema).

Batch JSON::

    {"model": {"layers", "block_size", "block_bytes"},
     "hardware": {"gpu_kv_budget_blocks", "h2d_gbps"},
     "profile": {"layer_compute_ms": number or list,
                 "recompute_ms_per_token": number or list (optional),
                 "fetch_launch_ms" (optional)},
     "requests": [{"id", "context_tokens", "slo_tbt_ms", "deposit_tokens",
                   "remaining_tokens" (optional)}],
     "policy": {"alpha", "window_min", "window_max", "max_recompute_ratio" (optional),
                "deposit_credit" (optional, default true)}}

The two optional fields are the recompute option (issue 16, ``docs/recompute.md``): absent (or a
ratio of 0) means no recompute, exactly the schema and behaviour before it.

Every validation failure raises :class:`SchemaError` naming the field (dotted path), the value
and the allowed range; a key that is not one of these fields is refused, naming it and the known
ones (before session 86 a misspelt one was ignored and its default planned).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def link_blocks_per_ms(gbps: float, block_bytes: float) -> float:
    """A link of ``gbps`` GB/s in blocks of ``block_bytes`` per ms: ``gbps * 1e9 / 1e3 / block_bytes``
    (the placement model's ``bw_blocks_per_ms``; ``block_bytes`` 1: bytes per ms). The one place this
    conversion is written: the planner's hardware, the controller's learned link, the LayerKV
    scheduler and the simulator call it (the data plane's profile file, which imports nothing of the
    control plane, writes it once more: ``DeviceProfile.h2d_blocks_per_ms``)."""
    return gbps * 1e9 / 1e3 / block_bytes


SHOWN_CHARS = 64
"""Characters of a bad value an error message echoes (:func:`shown`)."""


def shown(value: Any, *, bare: bool = False) -> str:
    """``repr(value)`` (``bare``: ``str``, for a key in a field path) for an error message, cut to
    :data:`SHOWN_CHARS` with its full length named: a 100,000-character policy field echoed whole
    made the gRPC status exceed the metadata limit, so the client saw RESOURCE_EXHAUSTED instead of
    the field (control-plane review, session 80). An integer too long to print is named by its
    size (Python refuses to print one of over 4,300 digits)."""
    try:
        text = str(value) if bare else repr(value)
    except ValueError:
        return f"an integer of {value.bit_length()} bits"
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


class SchemaError(ValueError):
    """A batch or policy field is missing or out of range. ``field`` is the dotted path."""

    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path


def _require(obj: Mapping[str, Any], key: str, path: str) -> Any:
    if not isinstance(obj, Mapping):
        raise SchemaError(path, f"expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise SchemaError(f"{path}.{key}" if path else key, "is required")
    return obj[key]


def _only(obj: Mapping[str, Any], path: str, known: tuple[str, ...]) -> None:
    """Refuse a key that is not a field: a misspelt one (``slo_tbt_msx``) was ignored, and the
    batch planned at a default (review, session 86), where the policy files and the requests'
    ``kvplane_*`` keys refuse theirs. Not an object: :func:`_require`'s error, after."""
    if not isinstance(obj, Mapping):
        return
    for key in obj:
        if key not in known:
            raise SchemaError(f"{path}.{key}" if path else str(key),
                              f"is not a field (known: {', '.join(known)})")


def _int(value: Any, path: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise SchemaError(path, f"expected an integer, got {shown(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise SchemaError(path, f"{shown(value)} is out of range (allowed {bound})")
    return value


def _num(value: Any, path: str, lo: float, hi: float | None = None, *, open_lo: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(path, f"expected a number, got {shown(value)}")
    value = _float(value, path)
    if not math.isfinite(value):
        raise SchemaError(path, f"{value} is not finite")
    if (value <= lo if open_lo else value < lo) or (hi is not None and value > hi):
        left = "(" if open_lo else "["
        bound = f"{left}{lo}, {hi}]" if hi is not None else (f"> {lo}" if open_lo else f">= {lo}")
        raise SchemaError(path, f"{value} is out of range (allowed {bound})")
    return value


def _float(value: int | float, path: str) -> float:
    """``float(value)``; an integer past a double's range is refused (OverflowError before)."""
    try:
        return float(value)
    except OverflowError:
        raise SchemaError(path, f"{shown(value)} is out of range (past a double's)") from None


def _flag(value: Any, path: str) -> bool:
    """A JSON boolean."""
    if not isinstance(value, bool):
        raise SchemaError(path, f"expected true or false, got {shown(value)}")
    return value


def _ratio(value: Any, path: str) -> float:
    """A number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(path, f"expected a number, got {shown(value)}")
    value = _float(value, path)
    if not 0.0 <= value < 1.0:  # NaN fails too
        raise SchemaError(path, f"{value} is out of range (allowed [0.0, 1.0))")
    return value


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the served model's KV cache."""

    layers: int
    """Number of transformer layers L."""
    block_size: int
    """Tokens per KV block (page)."""
    block_bytes: int
    """Bytes of one block of one layer (K and V together)."""

    def __post_init__(self) -> None:
        _int(self.layers, "model.layers", 1, 4096)
        _int(self.block_size, "model.block_size", 1, 1 << 20)
        _int(self.block_bytes, "model.block_bytes", 1)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str = "model") -> ModelSpec:
        _only(d, path, ("layers", "block_size", "block_bytes"))
        return cls(
            layers=_int(_require(d, "layers", path), f"{path}.layers", 1, 4096),
            block_size=_int(_require(d, "block_size", path), f"{path}.block_size", 1, 1 << 20),
            block_bytes=_int(_require(d, "block_bytes", path), f"{path}.block_bytes", 1),
        )


@dataclass(frozen=True)
class Hardware:
    """GPU KV capacity and host-to-device link."""

    gpu_kv_budget_blocks: int
    """Blocks (of one layer each) the GPU may hold for KV: resident plus staging."""
    h2d_gbps: float
    """Host-to-device bandwidth in GB/s (1e9 bytes per second)."""

    def __post_init__(self) -> None:
        _int(self.gpu_kv_budget_blocks, "hardware.gpu_kv_budget_blocks", 0)
        _num(self.h2d_gbps, "hardware.h2d_gbps", 0.0, open_lo=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str = "hardware") -> Hardware:
        _only(d, path, ("gpu_kv_budget_blocks", "h2d_gbps"))
        return cls(
            gpu_kv_budget_blocks=_int(
                _require(d, "gpu_kv_budget_blocks", path), f"{path}.gpu_kv_budget_blocks", 0
            ),
            h2d_gbps=_num(_require(d, "h2d_gbps", path), f"{path}.h2d_gbps", 0.0, open_lo=True),
        )

    def blocks_per_ms(self, block_bytes: int) -> float:
        """Link bandwidth in blocks of ``block_bytes`` per ms (:func:`link_blocks_per_ms`)."""
        return link_blocks_per_ms(self.h2d_gbps, block_bytes)

    def check_moves_blocks(self, block_bytes: int) -> None:
        """Raise unless the link moves blocks of ``block_bytes`` at a positive rate: each field in
        range, their ratio may still underflow to 0 blocks/ms, which the planner divides by."""
        if not self.blocks_per_ms(block_bytes) > 0:
            raise SchemaError(
                "hardware.h2d_gbps",
                f"{self.h2d_gbps} GB/s moves no block of model.block_bytes = {block_bytes} in a "
                "millisecond (the link rounds to 0 blocks/ms)",
            )


def _per_layer(raw: Any, p: str, layers: int) -> tuple[float, ...]:
    """A number (every layer) or a list of ``layers`` numbers, each >= 0."""
    if isinstance(raw, list | tuple):
        if len(raw) != layers:
            raise SchemaError(p, f"has {len(raw)} entries, expected model.layers = {layers}")
        return tuple(_num(v, f"{p}[{i}]", 0.0) for i, v in enumerate(raw))
    return (_num(raw, p, 0.0),) * layers


@dataclass(frozen=True)
class Profile:
    """Measured per-layer compute time of one decode step."""

    layer_compute_ms: tuple[float, ...]
    """Compute time of each layer in ms (length L)."""
    recompute_ms_per_token: tuple[float, ...] | None = None
    """Per layer, ms one recomputed prefix token adds to the layer's compute (eLLM §4.2.1 Eq. 2,
    linear in the tokens; ``docs/recompute.md``). None: the planner never offers recompute."""
    fetch_launch_ms: float = 0.0
    """Host cost of one fetch launch in ms: the next layer starts this much later per launch
    (:mod:`controlplane.model.timeline`), >= 0; 0 when the host runs ahead of the GPU."""

    def __post_init__(self) -> None:
        _num(self.fetch_launch_ms, "profile.fetch_launch_ms", 0.0)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], layers: int, path: str = "profile") -> Profile:
        values = _per_layer(_require(d, "layer_compute_ms", path), f"{path}.layer_compute_ms", layers)
        _only(d, path, ("layer_compute_ms", "recompute_ms_per_token", "fetch_launch_ms"))
        raw = d.get("recompute_ms_per_token")
        recompute = (
            None
            if raw is None
            else _per_layer(raw, f"{path}.recompute_ms_per_token", layers)
        )
        raw_launch = d.get("fetch_launch_ms")  # absent or null: 0, as in a profile file
        launch = 0.0 if raw_launch is None else _num(raw_launch, f"{path}.fetch_launch_ms", 0.0)
        return cls(layer_compute_ms=values, recompute_ms_per_token=recompute, fetch_launch_ms=launch)


@dataclass(frozen=True)
class RequestSpec:
    """One decoding request as the planner sees it."""

    id: str
    """Request id (unique within the batch)."""
    context_tokens: int
    """Tokens in context, including the token being decoded."""
    slo_tbt_ms: float
    """Time-between-tokens SLO in ms."""
    deposit_tokens: int = 0
    """Tokens generated but not yet delivered (OrbitFlow §3.2 token deposit)."""
    remaining_tokens: int | None = None
    """Tokens it still decodes after this one (``max_new_tokens`` less those generated), when
    known: its KV grows by at most this many, however long the decode window. None: unknown,
    it may grow over the whole window."""

    def blocks(self, block_size: int, extra_tokens: int = 0) -> int:
        """Blocks per layer after ``extra_tokens`` more tokens (at most :attr:`remaining_tokens`):
        ceil((context_tokens + extra) / block_size). The planner's ``b_r`` over a window of
        ``extra_tokens`` steps (OrbitFlow §3.3.1): a request that finishes inside the window
        stops growing there."""
        if self.remaining_tokens is not None and extra_tokens > self.remaining_tokens:
            extra_tokens = self.remaining_tokens
        return -(-(self.context_tokens + extra_tokens) // block_size)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str) -> RequestSpec:
        rid = _require(d, "id", path)
        _only(d, path, ("id", "context_tokens", "slo_tbt_ms", "deposit_tokens", "remaining_tokens"))
        if not isinstance(rid, str | int) or isinstance(rid, bool) or str(rid) == "":
            raise SchemaError(f"{path}.id", f"expected a non-empty string, got {shown(rid)}")
        return cls(
            id=str(rid),
            context_tokens=_int(_require(d, "context_tokens", path), f"{path}.context_tokens", 1),
            slo_tbt_ms=_num(_require(d, "slo_tbt_ms", path), f"{path}.slo_tbt_ms", 0.0, open_lo=True),
            deposit_tokens=_int(d.get("deposit_tokens", 0), f"{path}.deposit_tokens", 0),
            remaining_tokens=(None if d.get("remaining_tokens") is None
                              else _int(d["remaining_tokens"], f"{path}.remaining_tokens", 0)),
        )


@dataclass(frozen=True)
class PlanPolicy:
    """The planner's knobs (OrbitFlow §3.3.1)."""

    alpha: float = 1.0
    """Cap on the summed per-request late fraction over the window."""
    window_min: int = 1
    """Smallest decode window Δ in steps."""
    window_max: int = 64
    """Largest decode window Δ in steps."""
    max_recompute_ratio: float = 0.0
    """Largest uncached prefix the planner may choose, as a fraction of a request's blocks:
    ``u_r <= min(floor(ratio * b_r), b_r - 1)`` (``docs/recompute.md``); in [0, 1), 0 = off."""
    deposit_credit: bool = True
    """Whether a request's token deposit masks its late steps in the SLO cap (OrbitFlow §3.3.1
    with §3.2, :mod:`controlplane.planner.slo_cap`); False: the cap counts every step slower
    than the SLO (the victim rule still weighs deposits)."""

    def __post_init__(self) -> None:
        _num(self.alpha, "policy.alpha", 0.0)
        _flag(self.deposit_credit, "policy.deposit_credit")
        _int(self.window_min, "policy.window_min", 1, 1_000_000)
        _int(self.window_max, "policy.window_max", 1, 1_000_000)
        _ratio(self.max_recompute_ratio, "policy.max_recompute_ratio")
        if self.window_max < self.window_min:
            raise SchemaError(
                "policy.window_max",
                f"{self.window_max} is below policy.window_min = {self.window_min}",
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, path: str = "policy") -> PlanPolicy:
        d = d or {}
        if not isinstance(d, Mapping):
            raise SchemaError(path, f"expected an object, got {type(d).__name__}")
        _only(d, path, ("alpha", "window_min", "window_max", "max_recompute_ratio", "deposit_credit"))
        default = cls()
        return cls(
            alpha=_num(d.get("alpha", default.alpha), f"{path}.alpha", 0.0),
            window_min=_int(d.get("window_min", default.window_min), f"{path}.window_min", 1, 1_000_000),
            window_max=_int(d.get("window_max", default.window_max), f"{path}.window_max", 1, 1_000_000),
            max_recompute_ratio=_ratio(
                d.get("max_recompute_ratio", default.max_recompute_ratio),
                f"{path}.max_recompute_ratio",
            ),
            deposit_credit=_flag(d.get("deposit_credit", default.deposit_credit), f"{path}.deposit_credit"),
        )


@dataclass(frozen=True)
class Batch:
    """One planning problem: the decoding requests of one worker at one step."""

    model: ModelSpec
    hardware: Hardware
    profile: Profile
    requests: tuple[RequestSpec, ...]
    policy: PlanPolicy = field(default_factory=PlanPolicy)

    def __post_init__(self) -> None:
        if len(self.profile.layer_compute_ms) != self.model.layers:
            raise SchemaError(
                "profile.layer_compute_ms",
                f"has {len(self.profile.layer_compute_ms)} entries, expected {self.model.layers}",
            )
        rms = self.profile.recompute_ms_per_token
        if rms is not None and len(rms) != self.model.layers:
            raise SchemaError(
                "profile.recompute_ms_per_token",
                f"has {len(rms)} entries, expected {self.model.layers}",
            )
        seen: set[str] = set()
        for i, r in enumerate(self.requests):
            if r.id in seen:
                raise SchemaError(f"requests[{i}].id", f"duplicate id {shown(r.id)}")
            seen.add(r.id)
        self.hardware.check_moves_blocks(self.model.block_bytes)

    @property
    def bw_blocks_per_ms(self) -> float:
        """Link bandwidth in blocks per ms (:meth:`Hardware.blocks_per_ms`)."""
        return self.hardware.blocks_per_ms(self.model.block_bytes)

    @property
    def offers_recompute(self) -> bool:
        """Whether the planner may choose the recompute option: the profile measures
        ``recompute_ms_per_token`` and ``policy.max_recompute_ratio > 0``."""
        return self.profile.recompute_ms_per_token is not None and self.policy.max_recompute_ratio > 0

    def blocks(self, extra_tokens: int = 0) -> list[int]:
        """b_r per request, optionally after ``extra_tokens`` more decode steps."""
        return [r.blocks(self.model.block_size, extra_tokens) for r in self.requests]

    def without(self, ids: Sequence[str]) -> Batch:
        """The same batch with the given request ids removed."""
        drop = set(ids)
        return Batch(
            self.model,
            self.hardware,
            self.profile,
            tuple(r for r in self.requests if r.id not in drop),
            self.policy,
        )

    @classmethod
    def from_dict(cls, d: Any) -> Batch:
        if not isinstance(d, Mapping):
            raise SchemaError("batch", f"expected an object, got {type(d).__name__}")
        _only(d, "", ("model", "hardware", "profile", "requests", "policy"))
        model = ModelSpec.from_dict(_require(d, "model", ""))
        hardware = Hardware.from_dict(_require(d, "hardware", ""))
        profile = Profile.from_dict(_require(d, "profile", ""), model.layers)
        raw_requests = _require(d, "requests", "")
        if not isinstance(raw_requests, list):
            raise SchemaError("requests", f"expected a list, got {type(raw_requests).__name__}")
        requests = tuple(
            RequestSpec.from_dict(r, f"requests[{i}]") for i, r in enumerate(raw_requests)
        )
        policy = PlanPolicy.from_dict(d.get("policy"))
        return cls(model, hardware, profile, requests, policy)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form :meth:`from_dict` reads back to an equal batch; the recompute fields
        appear only when set (a batch without them serialises exactly as before issue 16)."""
        out: dict[str, Any] = {
            "model": {
                "layers": self.model.layers,
                "block_size": self.model.block_size,
                "block_bytes": self.model.block_bytes,
            },
            "hardware": {
                "gpu_kv_budget_blocks": self.hardware.gpu_kv_budget_blocks,
                "h2d_gbps": self.hardware.h2d_gbps,
            },
            "profile": {"layer_compute_ms": list(self.profile.layer_compute_ms)},
            "requests": [
                {
                    "id": r.id,
                    "context_tokens": r.context_tokens,
                    "slo_tbt_ms": r.slo_tbt_ms,
                    "deposit_tokens": r.deposit_tokens,
                    **({} if r.remaining_tokens is None else {"remaining_tokens": r.remaining_tokens}),
                }
                for r in self.requests
            ],
            "policy": {
                "alpha": self.policy.alpha,
                "window_min": self.policy.window_min,
                "window_max": self.policy.window_max,
            },
        }
        if self.profile.recompute_ms_per_token is not None:
            out["profile"]["recompute_ms_per_token"] = list(self.profile.recompute_ms_per_token)
        if self.profile.fetch_launch_ms:
            out["profile"]["fetch_launch_ms"] = self.profile.fetch_launch_ms
        if self.policy.max_recompute_ratio:
            out["policy"]["max_recompute_ratio"] = self.policy.max_recompute_ratio
        if not self.policy.deposit_credit:
            out["policy"]["deposit_credit"] = False
        return out
