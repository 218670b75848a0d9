"""DeviceProfile: the ``kvplane profile`` file the planner and simulator load (no torch).

Schema (JSON object)::

    {"device": "NVIDIA H100 80GB HBM3",     # what was measured
     "layers": 32, "block_size": 16,
     "block_bytes": 131072,                 # one block of one layer, K and V
     "h2d_gbps": 24.1, "d2h_gbps": 24.8,    # 1e9 bytes per second
     "layer_compute_ms": {"fixed_ms": 0.05, "per_token_ms": 0.0004},
                          # or a list of points [{"tokens": 64, "ms": 0.08}, ...]
     "recompute_ms_per_token": 0.0002,      # optional (issue 16, docs/recompute.md)
     "fetch_launch_ms": 0.3                 # optional: host cost of one fetch launch
    }

``layer_compute_ms(tokens)`` gives one layer's compute time for a batch of that many tokens:
the affine form directly, the point list by piecewise-linear interpolation (clamped extrapolation
with the end segments' slope).

``recompute_ms_per_token`` (optional, >= 0) is what one recomputed prefix token adds to one
layer's compute (eLLM §4.2.1 Eq. 2, linear in the tokens): ``kvplane profile`` times one layer's
prefill of a prefix through the same layer and divides by its tokens. Absent: the worker reports
no recompute cost and the control plane never plans recompute for it.

``fetch_launch_ms`` (optional, >= 0; absent: 0) is the host cost of one fetch launch in the
placement model (``controlplane/model/timeline.py``): what a fetch the model hides still adds to
the step, per launch. ``kvplane gpu-check`` fits it from its hidden-fetch placement
(``overlap.fetch_launch_ms``); the controller starts from it and keeps learning it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _num(d: Mapping[str, Any], key: str, lo: float, *, integer: bool = False, open_lo: bool = False) -> Any:
    if key not in d:
        raise ValueError(f"profile.{key} is required")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not float(v).is_integer()):
        kind = "an integer" if integer else "a number"
        raise ValueError(f"profile.{key} must be {kind}, got {v!r}")
    if not math.isfinite(v) or (v <= lo if open_lo else v < lo):
        raise ValueError(f"profile.{key} = {v!r} out of range ({'>' if open_lo else '>='} {lo})")
    return int(v) if integer else float(v)


@dataclass(frozen=True)
class DeviceProfile:
    """A measured device profile (see module docstring)."""

    device: str
    """Device name the figures were measured on (GPU name, or ``CPU: <model>``)."""
    layers: int
    """Transformer layers."""
    block_size: int
    """Tokens per block."""
    block_bytes: int
    """Bytes of one block of one layer (K and V)."""
    h2d_gbps: float
    """Batched host-to-device bandwidth, GB/s."""
    d2h_gbps: float
    """Batched device-to-host bandwidth, GB/s."""
    fixed_ms: float | None = None
    """Affine layer compute: ms at zero tokens (None when points are given)."""
    per_token_ms: float | None = None
    """Affine layer compute: ms per batch token (None when points are given)."""
    points: tuple[tuple[int, float], ...] = ()
    """(batch tokens, layer ms) measured points, ascending tokens."""
    recompute_ms_per_token: float | None = None
    """ms one recomputed prefix token adds to one layer (None: not measured, no recompute)."""
    fetch_launch_ms: float = 0.0
    """Host cost of one fetch launch, ms (the placement model's ``launch_ms``)."""

    def __post_init__(self) -> None:
        if (self.fixed_ms is None) == (not self.points):
            raise ValueError("profile.layer_compute_ms: give either fixed_ms/per_token_ms or points")
        toks = [t for t, _ in self.points]
        if toks != sorted(set(toks)):
            raise ValueError(f"profile.layer_compute_ms points must have distinct ascending tokens, got {toks}")

    @property
    def h2d_blocks_per_ms(self) -> float:
        """The placement model's ``bw_blocks_per_ms``: h2d_gbps * 1e6 / block_bytes."""
        return self.h2d_gbps * 1e6 / self.block_bytes

    def layer_compute_ms(self, tokens: int) -> float:
        """One layer's compute time (ms) for a batch of ``tokens`` tokens."""
        if self.fixed_ms is not None:
            return self.fixed_ms + (self.per_token_ms or 0.0) * tokens
        pts = self.points
        if len(pts) == 1:
            return pts[0][1]
        i = 1
        while i < len(pts) - 1 and pts[i][0] < tokens:
            i += 1
        (t0, m0), (t1, m1) = pts[i - 1], pts[i]
        return max(0.0, m0 + (m1 - m0) * (tokens - t0) / (t1 - t0))

    def to_dict(self) -> dict[str, Any]:
        comp: Any
        if self.fixed_ms is not None:
            comp = {"fixed_ms": self.fixed_ms, "per_token_ms": self.per_token_ms}
        else:
            comp = [{"tokens": t, "ms": m} for t, m in self.points]
        return {
            "device": self.device,
            "layers": self.layers,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "h2d_gbps": self.h2d_gbps,
            "d2h_gbps": self.d2h_gbps,
            "layer_compute_ms": comp,
            **({} if (rms := self.recompute_ms_per_token) is None else {"recompute_ms_per_token": rms}),
            **({"fetch_launch_ms": self.fetch_launch_ms} if self.fetch_launch_ms else {}),
        }

    @classmethod
    def from_dict(cls, d: Any) -> DeviceProfile:
        if not isinstance(d, Mapping):
            raise ValueError(f"profile must be a JSON object, got {type(d).__name__}")
        device = d.get("device")
        if not isinstance(device, str) or not device:
            raise ValueError(f"profile.device must be a non-empty string, got {device!r}")
        comp = d.get("layer_compute_ms")
        common = dict(
            device=device,
            layers=_num(d, "layers", 1, integer=True),
            block_size=_num(d, "block_size", 1, integer=True),
            block_bytes=_num(d, "block_bytes", 1, integer=True),
            h2d_gbps=_num(d, "h2d_gbps", 0, open_lo=True),
            d2h_gbps=_num(d, "d2h_gbps", 0, open_lo=True),
            recompute_ms_per_token=None if d.get("recompute_ms_per_token") is None
            else _num(d, "recompute_ms_per_token", 0),
            fetch_launch_ms=0.0 if d.get("fetch_launch_ms") is None else _num(d, "fetch_launch_ms", 0),
        )
        if isinstance(comp, Mapping):
            return cls(
                **common,
                fixed_ms=_num(comp, "fixed_ms", 0),
                per_token_ms=_num(comp, "per_token_ms", 0),
            )
        if isinstance(comp, list) and comp:
            pts = []
            for i, p in enumerate(comp):
                if not isinstance(p, Mapping):
                    raise ValueError(f"profile.layer_compute_ms[{i}] must be an object")
                pts.append((_num(p, "tokens", 0, integer=True), _num(p, "ms", 0)))
            return cls(**common, points=tuple(pts))
        raise ValueError(
            "profile.layer_compute_ms must be {fixed_ms, per_token_ms} or a non-empty list of "
            f"{{tokens, ms}} points, got {comp!r}"
        )

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        """Read and validate a profile JSON file."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
