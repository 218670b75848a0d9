"""The per-request opt-in for the placement info: ``custom_params.kvplane_return_placement``.

``true`` asks for ``meta_info["kvplane"]`` / ``sglext.kvplane`` (:mod:`sglang_ext.request_placement`);
``false``, ``null`` or absent does not; any other value is refused where the request enters
(:func:`sglang_ext.request_slo.sampling_params_error`: HTTP 400 naming the field on every request
kind, before anything reaches the scheduler). Standard library only (the request entry imports it).
"""

from __future__ import annotations

import json
from typing import Any

PARAM = "kvplane_return_placement"
"""``custom_params`` key asking for the placement info (``true``; ``false`` or absent: not asked)."""
KEY = "kvplane"
"""Key of the info: in ``req.customized_info`` (scheduler) and in ``meta_info`` (response)."""


def wants_placement(custom_params: Any) -> bool:
    """Whether a request's ``custom_params`` ask for the placement info."""
    return isinstance(custom_params, dict) and custom_params.get(PARAM) is True


def placement_param_error(custom_params: Any) -> str | None:
    """The refusal for a bad ``custom_params.kvplane_return_placement`` (not a JSON boolean), or None."""
    if not isinstance(custom_params, dict):
        return None
    value = custom_params.get(PARAM)
    if value is None or isinstance(value, bool):
        return None
    return f"custom_params.{PARAM}={as_json(value)} is invalid (allowed: true or false)"


def as_json(value: Any, limit: int = 200) -> str:
    """A request's value as its JSON spelling (``true``, ``"fast"``, ``null``: what the client
    sent, not Python's ``True`` / ``'fast'``), cut to ``limit`` characters."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        try:
            text = repr(value)
        except ValueError:  # an integer Python refuses to print (over 4,300 digits)
            return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
