"""Hardware/model profiles: what the simulator needs to time a step.

A profile is a JSON file. Two formats load:

* the simulator's own (``"format": "kvplane-sim-profile/v1"``; the presets in ``presets/``), and
* the data plane's ``kvplane profile`` output (measured on a real GPU), recognised by its
  ``layer_compute_ms`` and ``h2d_gbps`` fields; see :func:`from_measured`.

Step-time model (issue 3 "Engine model"):

* decode: per-layer compute is affine in the batch's context tokens,
  ``comp_l = decode_layer_base_ms + decode_layer_ms_per_token * batch_tokens``; transfer stalls
  come from :func:`controlplane.model.step_time_ms`.
* prefill: LayerKV Eq. (3), ``T = alpha * s * (2 * n_param + 2 * s * n_hidden) / FLOPS``. We read
  ``n_hidden`` as the hidden width summed over layers (``L * h``) so that the quadratic attention
  term has its usual magnitude (the literal per-layer width makes it negligible).
* layer-wise prefill offload: LayerKV Eq. (4), ``T_off = beta * s * (L - x) * kv_bytes / BW``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from controlplane.model import link_blocks_per_ms

PRESET_DIR = Path(__file__).parent / "presets"
FORMAT = "kvplane-sim-profile/v1"


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"profile.{name}: expected a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"profile.{name}: {value} is out of range (allowed {bound})")


@dataclass(frozen=True)
class SimProfile:
    """One model on one GPU + host link. Every number's source is in ``sources``."""

    name: str
    """Preset or file name."""
    model: str
    """Model name (documentation only)."""
    layers: int
    """Transformer layers L."""
    hidden: int
    """Hidden width h."""
    vocab: int
    """Vocabulary size V (eLLM Eq. 2-3)."""
    n_params: float
    """Parameter count (LayerKV Eq. 3)."""
    kv_bytes_per_token_layer: int
    """K+V bytes of one token in one layer: 2 * kv_heads * head_dim * dtype_bytes."""
    block_size: int
    """Tokens per KV block."""
    gpu_kv_budget_blocks: int
    """GPU blocks (of one layer each) available for KV, resident plus staging."""
    h2d_gbps: float
    """Host-to-device bandwidth, GB/s."""
    d2h_gbps: float
    """Device-to-host bandwidth, GB/s."""
    decode_layer_base_ms: float
    """Per-layer decode compute independent of context (weights read), ms."""
    decode_layer_ms_per_token: float
    """Per-layer decode compute per context token in the batch (KV read), ms."""
    prefill_tflops: float
    """Peak dense FLOP/s of the device, in TFLOP/s (LayerKV Eq. 3 denominator)."""
    prefill_alpha: float = 1.0
    """LayerKV Eq. 3 empirical correction factor."""
    offload_beta: float = 1.0
    """LayerKV Eq. 4 empirical correction factor."""
    max_batch_size: int = 4
    """Largest number of requests in flight (running plus paused)."""
    token_budget: int = 32768
    """Largest total context tokens of requests in flight."""
    solver_model_ms: float = 2.0
    """Solver time charged per planner call under ``--solver-time model``."""
    fetch_launch_ms: float = 0.0
    """Host cost of one fetch launch (``controlplane/model/timeline.py``): the simulated step's
    truth. 0 (the presets): a host that runs ahead of the GPU; ``kvplane gpu-check`` measured what
    a hidden fetch still costs an eager H200 forward (``overlap.fetch_launch_ms``)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each number comes from."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "vocab", "kv_bytes_per_token_layer", "block_size",
                     "max_batch_size", "token_budget"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"profile.{name}: {v!r} is out of range (allowed integer >= 1)")
        if isinstance(self.gpu_kv_budget_blocks, bool) or not isinstance(
            self.gpu_kv_budget_blocks, int
        ) or self.gpu_kv_budget_blocks < self.layers:
            raise ValueError(
                f"profile.gpu_kv_budget_blocks: {self.gpu_kv_budget_blocks!r} is out of range "
                f"(allowed integer >= layers = {self.layers})"
            )
        for name in ("n_params", "h2d_gbps", "d2h_gbps", "prefill_tflops", "prefill_alpha",
                     "offload_beta"):
            _positive(name, getattr(self, name))
        for name in ("decode_layer_base_ms", "decode_layer_ms_per_token", "solver_model_ms", "fetch_launch_ms"):
            _positive(name, getattr(self, name), allow_zero=True)

    # ---- derived -----------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.block_size * self.kv_bytes_per_token_layer

    @property
    def h2d_blocks_per_ms(self) -> float:
        return link_blocks_per_ms(self.h2d_gbps, self.block_bytes)

    @property
    def d2h_blocks_per_ms(self) -> float:
        return link_blocks_per_ms(self.d2h_gbps, self.block_bytes)

    @property
    def gpu_tokens_all_layers(self) -> int:
        """Tokens whose KV (all layers) fits the GPU budget."""
        return self.gpu_kv_budget_blocks // self.layers * self.block_size

    def blocks(self, tokens: int) -> int:
        """Blocks per layer for ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def layer_compute_ms(self, batch_tokens: int) -> float:
        """One decode layer's compute for a batch holding ``batch_tokens`` context tokens."""
        return self.decode_layer_base_ms + self.decode_layer_ms_per_token * batch_tokens

    def decode_resident_ms(self, batch_tokens: int) -> float:
        """A decode step with every layer resident."""
        return self.layers * self.layer_compute_ms(batch_tokens)

    def prefill_ms(self, tokens: int) -> float:
        """LayerKV Eq. (3): prefill time of ``tokens`` prompt tokens."""
        flops = tokens * (2 * self.n_params + 2 * tokens * self.layers * self.hidden)
        return self.prefill_alpha * flops / (self.prefill_tflops * 1e12) * 1e3

    def offload_ms(self, tokens: int, offloaded_layers: int) -> float:
        """LayerKV Eq. (4): D2H time of ``offloaded_layers`` layers of ``tokens`` tokens."""
        nbytes = tokens * offloaded_layers * self.kv_bytes_per_token_layer
        return self.offload_beta * nbytes / (self.d2h_gbps * 1e9) * 1e3

    def min_gpu_layers(self, tokens: int) -> int:
        """LayerKV §3.1.1: fewest layers kept on the GPU so that T_offload <= T_prefill."""
        t_prefill = self.prefill_ms(tokens)
        for x in range(self.layers + 1):
            if self.offload_ms(tokens, self.layers - x) <= t_prefill:
                return x
        return self.layers

    def prefill_step_ms(self, tokens: int, gpu_layers: int) -> float:
        """Prefill with layer-wise offload overlapped (Eq. 4): the last layer's D2H is exposed."""
        t_prefill = self.prefill_ms(tokens)
        off = self.offload_ms(tokens, self.layers - gpu_layers)
        return max(t_prefill, t_prefill / self.layers + off)

    def base_tbt_slo_ms(self) -> float:
        """OrbitFlow §5.1 baseline SLO: decode latency of the longest request served without
        offloading (all its KV on the GPU, alone in the batch)."""
        return self.decode_resident_ms(self.gpu_tokens_all_layers)

    def with_changes(self, **changes: Any) -> SimProfile:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str = "profile") -> SimProfile:
        if not isinstance(d, Mapping):
            raise ValueError(f"profile: expected an object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            return from_measured(d, name)
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known - {"format"})
        if unknown:
            raise ValueError(f"profile: unknown fields {unknown} (allowed: {sorted(known)})")
        values = {k: v for k, v in d.items() if k != "format"}
        values.setdefault("name", name)
        missing = sorted(
            f for f, spec in cls.__dataclass_fields__.items()
            if f not in values and spec.default is spec.default_factory  # both MISSING
        )
        if missing:
            raise ValueError(f"profile: missing required fields {missing}")
        return cls(**values)


def from_measured(d: Mapping[str, Any], name: str) -> SimProfile:
    """A profile from the data plane's ``kvplane profile`` JSON
    (``sglang_ext/dataplane/profile_schema.py``: ``device``, ``layers``, ``block_size``,
    ``block_bytes``, ``h2d_gbps``, ``d2h_gbps`` and ``layer_compute_ms`` as
    ``{fixed_ms, per_token_ms}`` or a list of ``{tokens, ms}`` points, fitted here by least
    squares to the affine model). Fields the file lacks (model shape beyond the KV layout,
    prefill rate, GPU budget unless ``gpu_kv_budget_blocks`` is given) come from the preset named
    by ``base`` (default: the A5000 preset). A plain number or per-layer list for
    ``layer_compute_ms`` is accepted too (its mean is the batch-independent part).
    """
    if "layer_compute_ms" not in d or "h2d_gbps" not in d:
        raise ValueError(
            f"profile {name}: neither a simulator profile (format={FORMAT!r}) nor a measured "
            "`kvplane profile` file (needs layer_compute_ms and h2d_gbps)"
        )
    base = load_profile(str(d.get("base", "llama3-8b-a5000-pcie3")))
    comp = d["layer_compute_ms"]
    per_token: float | None = None
    layers = int(d.get("layers", base.layers))
    if isinstance(comp, Mapping):
        if "fixed_ms" not in comp:
            raise ValueError(f"profile {name}: layer_compute_ms needs fixed_ms (and per_token_ms)")
        comp_ms = float(comp["fixed_ms"])
        per_token = float(comp.get("per_token_ms", 0.0))
    elif isinstance(comp, list | tuple) and comp and isinstance(comp[0], Mapping):
        pts = [(float(p["tokens"]), float(p["ms"])) for p in comp]
        if len(pts) == 1:
            comp_ms, per_token = pts[0][1], 0.0
        else:
            mx = sum(t for t, _ in pts) / len(pts)
            my = sum(m for _, m in pts) / len(pts)
            var = sum((t - mx) ** 2 for t, _ in pts)
            per_token = sum((t - mx) * (m - my) for t, m in pts) / var if var else 0.0
            per_token = max(0.0, per_token)
            comp_ms = max(0.0, my - per_token * mx)
    elif isinstance(comp, list | tuple):
        if not comp:
            raise ValueError(f"profile {name}: layer_compute_ms is empty")
        comp_ms = sum(float(c) for c in comp) / len(comp)
        layers = int(d.get("layers", len(comp)))
    else:
        comp_ms = float(comp)
    changes: dict[str, Any] = {
        "name": name,
        "layers": layers,
        "decode_layer_base_ms": comp_ms,
        "h2d_gbps": float(d["h2d_gbps"]),
        "d2h_gbps": float(d.get("d2h_gbps", d["h2d_gbps"])),
        "sources": {**base.sources, "measured": f"kvplane profile on {d.get('device', '?')}"},
    }
    if per_token is not None:
        changes["decode_layer_ms_per_token"] = per_token
    for key in ("gpu_kv_budget_blocks", "block_size"):
        if key in d:
            changes[key] = int(d[key])
    launch = d.get("fetch_launch_ms")
    if launch is not None:
        if isinstance(launch, bool) or not isinstance(launch, int | float):
            raise ValueError(f"profile {name}: fetch_launch_ms must be a number >= 0, got {launch!r}")
        changes["fetch_launch_ms"] = float(launch)
    if "block_bytes" in d:
        bs = int(d.get("block_size", base.block_size))
        changes["kv_bytes_per_token_layer"] = max(1, int(d["block_bytes"]) // bs)
    if "gpu_kv_budget_blocks" not in d:
        # Keep the base preset's KV capacity in tokens when the block layout changes.
        tokens = base.gpu_tokens_all_layers
        bs = changes.get("block_size", base.block_size)
        changes["gpu_kv_budget_blocks"] = max(layers, tokens // bs * layers)
    return base.with_changes(**changes)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> SimProfile:
    """A preset by name (see :func:`preset_names`) or a JSON file path."""
    path = Path(name_or_path)
    if (PRESET_DIR / f"{name_or_path}.json").exists():
        path = PRESET_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise ValueError(
            f"profile: {name_or_path!r} is neither a file nor a preset (presets: {preset_names()})"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {path}: invalid JSON ({exc})") from exc
    return SimProfile.from_dict(data, name=path.stem)
