"""The per-request opt-in for the placement info: ``custom_params.kvplane_return_placement``.

``true`` asks for ``meta_info["kvplane"]`` / ``sglext.kvplane`` (:mod:`sglang_ext.request_placement`);
``false``, ``null`` or absent does not; any other value is refused where the request enters
(:func:`sglang_ext.request_slo.sampling_params_error`: HTTP 400 naming the field on every request
kind, before anything reaches the scheduler). Standard library only (the request entry imports it).
"""

from __future__ import annotations

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
    return f"custom_params.{PARAM}={value!r} is invalid (allowed: true or false)"
