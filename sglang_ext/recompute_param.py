"""The per-request recompute override: ``custom_params.kvplane_recompute_ratio`` / ``_layers``.

eLLM's uncached ratio ``r`` (``docs/recompute.md``): a decoding request with ``ratio = r`` keeps
the first ``floor(r * prompt_tokens / page_size)`` pages of its context in no device layer and
recomputes them every decode step at its lowest ``layers`` layers (default: all of them, eLLM's
pure recompute), fetching them from host memory above. The prefix is fixed at the request's
first decode step. It is an operator's / test's override of what the control plane plans
(:func:`recompute_forced`: a forced request ignores the plan's ``recompute_blocks``).

Checked at the request entry (``request_slo.sampling_params_error``: HTTP 400 before anything
runs); standard library only.
"""

from __future__ import annotations

from typing import Any

from sglang_ext.placement_param import as_json

RATIO = "kvplane_recompute_ratio"
"""``custom_params`` key: the uncached ratio, a number in ``[0, 1)``."""
LAYERS = "kvplane_recompute_layers"
"""``custom_params`` key: layers recomputed (the rest fetched), an integer ``>= 0`` (clamped to the
model's layers; default all)."""


def recompute_param_error(custom_params: Any) -> str | None:
    """The refusal for a bad ratio or layer count, or None."""
    if not isinstance(custom_params, dict):
        return None
    ratio = custom_params.get(RATIO)
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio < 1:
            return f"custom_params.{RATIO}={as_json(ratio)} is invalid (allowed: a number in [0, 1))"
    layers = custom_params.get(LAYERS)
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
            return f"custom_params.{LAYERS}={as_json(layers)} is invalid (allowed: an integer >= 0)"
        if ratio is None:
            return f"custom_params.{LAYERS} needs custom_params.{RATIO}"
    return None


def recompute_forced(custom_params: Any, default_ratio: float = 0.0) -> bool:
    """Whether the request's ``(u, k)`` is forced -- by its own valid ``custom_params`` ratio
    (0 included: forced to recompute nothing) or by the launch's ``--kv-recompute-ratio > 0`` --
    instead of planned by the control plane (``Plan.recompute_blocks``)."""
    own = isinstance(custom_params, dict) and custom_params.get(RATIO) is not None \
        and recompute_param_error(custom_params) is None
    return own or default_ratio > 0


def recompute_request(custom_params: Any, model_layers: int, default_ratio: float = 0.0,
                      default_layers: int | None = None) -> tuple[float, int] | None:
    """``(ratio, layers)`` for a request (its own override, checked at entry, else the launch's
    ``--kv-recompute-ratio`` / ``--kv-recompute-layers``), or None (nothing recomputed)."""
    own = isinstance(custom_params, dict) and custom_params.get(RATIO) is not None \
        and recompute_param_error(custom_params) is None
    ratio = custom_params[RATIO] if own else default_ratio
    layers = custom_params.get(LAYERS) if own else default_layers
    if not ratio:
        return None
    return float(ratio), model_layers if layers is None else min(int(layers), model_layers)
