"""A request's own TBT SLO (``custom_params.kvplane_slo_tbt_ms``), checked where requests enter.

The value is read by the scheduler (admission, ``sglang_ext.admission``) and by streamed-output
pacing (``sglang_ext.pacing``). A bad one is refused with a ``ValueError`` naming the field, the
value and the allowed range, before SGLang does anything with the request, on every request kind
while ``--enable-layered-kv`` is on (pacing on or off):

* AROUND ``TokenizerManager.generate_request`` -- the main process's one entry for ``/generate``,
  ``/v1/completions``, ``/v1/chat/completions`` (streaming or not) and the Engine API. The refusal
  is the generator's first item, as SGLang's own checks do: the OpenAI endpoints answer HTTP 400
  (``serving_base.handle_request``, and the streaming handlers pull the first chunk before they
  send headers); ``/generate`` without streaming answers 400 (``_create_error_response``).
* AFTER ``api_contract.generate_contract_error`` -- ``/generate``'s schema check of the raw JSON
  body. A streaming ``/generate`` starts its HTTP 200 response before it pulls the first item (a
  ``ValueError`` then arrives as an SSE ``error`` event), so its bodies are checked here first and
  answered HTTP 400 ``{"error": "<message>"}`` like any contract violation.

Accepted: a number (int or float, not a bool) in (0, 1e7] ms, the same bound as
:attr:`controlplane.policy.Policy.slo_tbt_ms`; a missing key or ``null`` means the policy's
default. ``sampling_params`` may be one dict or a list of them (a ``/generate`` batch). The same
entry refuses a ``custom_params.kvplane_return_placement`` that is not a JSON boolean
(:mod:`sglang_ext.placement_param`), any ``kvplane_*`` key that is not one of kvplane's
(:data:`KVPLANE_PARAMS`: a misspelling, which would otherwise be ignored) and a caller-chosen
``rid`` longer than the control plane's id limit (:func:`rid_error`).

Per request: one dict lookup when the key is absent. No torch, no SGLang import.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from controlplane.api import MAX_ID_CHARS
from sglang_ext import compat
from sglang_ext.placement_param import PARAM as PLACEMENT_PARAM
from sglang_ext.placement_param import as_json, placement_param_error
from sglang_ext.recompute_param import LAYERS as RECOMPUTE_LAYERS
from sglang_ext.recompute_param import RATIO as RECOMPUTE_RATIO
from sglang_ext.recompute_param import recompute_param_error

MAX_RID_CHARS = MAX_ID_CHARS - 16
"""Longest caller-chosen ``rid``: the control plane's id limit less room for ``_N`` (SGLang names
the requests of a batch or of ``n`` parallel samples ``f"{rid}_{i}"``)."""
SLO_PARAM = "kvplane_slo_tbt_ms"
"""Key in a request's ``custom_params`` overriding its TBT SLO (ms)."""
MAX_SLO_TBT_MS = 1e7
"""Largest accepted SLO, the same bound as :attr:`controlplane.policy.Policy.slo_tbt_ms`."""
PREFIX = "kvplane_"
"""The prefix of kvplane's ``custom_params`` keys."""
KVPLANE_PARAMS = (SLO_PARAM, PLACEMENT_PARAM, RECOMPUTE_RATIO, RECOMPUTE_LAYERS)
"""Every ``custom_params`` key of kvplane's: any other ``kvplane_*`` key is refused (a misspelt one
would otherwise be ignored, the request served as if it had not asked); other keys are SGLang's."""


def request_slo_tbt_ms(sampling_params: Any, default_slo_tbt_ms: float) -> float:
    """The TBT SLO of a request: its ``custom_params[SLO_PARAM]`` if set, else the default.

    Raises ValueError naming the field, the value and the allowed range for a bad override.
    """
    custom = sampling_params.get("custom_params") if isinstance(sampling_params, dict) else None
    if not isinstance(custom, dict) or custom.get(SLO_PARAM) is None:
        return float(default_slo_tbt_ms)
    value = custom[SLO_PARAM]
    allowed = f"(allowed (0, {MAX_SLO_TBT_MS:g}] ms)"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"custom_params.{SLO_PARAM}={as_json(value)} is not a number {allowed}")
    # the range first: an int past a float's range compares exactly, where isfinite would overflow
    if not 0 < value <= MAX_SLO_TBT_MS or not math.isfinite(value):
        raise ValueError(f"custom_params.{SLO_PARAM}={as_json(value)} is out of range {allowed}")
    return float(value)


def sampling_params_error(sampling_params: Any) -> str | None:
    """The refusal for a request's ``sampling_params`` (a dict, a list of dicts, or anything SGLang
    itself judges), or None when its ``custom_params`` is absent or an object and its SLO
    override and its placement-info opt-in (``custom_params.kvplane_return_placement``, a JSON
    boolean) are absent or valid."""
    items = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for item in items:
        if isinstance(item, dict) and (shape := custom_params_type_error(item.get("custom_params"))):
            return shape  # SGLang types it Optional[Dict] but does not check it on /generate
        if isinstance(item, dict) and (unknown := unknown_param_error(item.get("custom_params"))):
            return unknown
        try:
            request_slo_tbt_ms(item, 0.0)
        except ValueError as exc:
            return str(exc)
        if isinstance(item, dict) and (opt_in := placement_param_error(item.get("custom_params"))):
            return opt_in  # custom_params.kvplane_return_placement (sglang_ext/placement_param.py)
        if isinstance(item, dict) and (forced := recompute_param_error(item.get("custom_params"))):
            return forced  # custom_params.kvplane_recompute_* (sglang_ext/recompute_param.py)
        if isinstance(item, dict) and (beam := beam_width_error(item.get("beam_width"))):
            return beam
    return None


def beam_width_error(beam_width: Any) -> str | None:
    """The refusal for a beam search (``sampling_params.beam_width`` > 1), or None. SGLang 0.5.23
    decodes a beam's members as rows beside their request (``ScheduleBatch.prepare_for_decode``
    appends them to ``out_cache_loc``, aliasing the leader's prompt KV), which kvplane's
    per-request residency does not track: the step's slots would not match its requests, and
    the scheduler would die on the first decode step."""
    if isinstance(beam_width, bool) or not isinstance(beam_width, int | float) or beam_width <= 1:
        return None  # absent, 1, or SGLang's to judge (it refuses < 1 itself)
    return (f"sampling_params.beam_width={as_json(beam_width)} is not served under --enable-layered-kv (beam "
            "search rows share their request's KV, which the layered pool does not track); send "
            "beam_width 1 or none, or serve this model without --enable-layered-kv")


def unknown_param_error(custom: Any) -> str | None:
    """The refusal for a ``kvplane_*`` key of ``custom_params`` that is not one of
    :data:`KVPLANE_PARAMS` (a misspelling), or None."""
    if not isinstance(custom, dict):
        return None
    for key in custom:
        if isinstance(key, str) and key.startswith(PREFIX) and key not in KVPLANE_PARAMS:
            return f"custom_params.{key} is not a kvplane parameter (allowed: {', '.join(KVPLANE_PARAMS)})"
    return None


def custom_params_type_error(custom: Any) -> str | None:
    """The refusal for a ``custom_params`` that is neither absent nor an object, or None."""
    if custom is None or isinstance(custom, dict):
        return None
    return f"custom_params={as_json(custom)} is invalid (allowed: an object)"


def body_error(body: Any) -> str | None:
    """The refusal for a raw ``/generate`` JSON body, or None (non-objects are SGLang's to judge)."""
    if not isinstance(body, dict):
        return None
    return sampling_params_error(body.get("sampling_params")) or rid_error(body.get("rid"))


async def _refused(message: str) -> AsyncIterator[Any]:
    raise ValueError(message)
    yield  # pragma: no cover - makes this an async generator


def around_generate_request(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``TokenizerManager.generate_request(self, obj, request)``: SGLang's generator, or one
    whose first item is the refusal (nothing sent to the scheduler, no request state created)."""
    obj_at = compat.TOKENIZER_GENERATE_REQUEST.params.index("obj")
    obj = kwargs["obj"] if "obj" in kwargs else (args[obj_at] if len(args) > obj_at else None)
    message = sampling_params_error(getattr(obj, "sampling_params", None)) or rid_error(getattr(obj, "rid", None))
    if message is not None:
        return _refused(message)
    return original(*args, **kwargs)


def rid_error(rid: Any) -> str | None:
    """The refusal for a caller-chosen ``rid`` (one, or a batch's list) longer than the control
    plane's id limit, or None. The gRPC control plane refuses a whole step report naming such an
    id, so one request with a long ``rid`` kept its worker in fallback for as long as it ran
    (control-plane review, session 54)."""
    for one in rid if isinstance(rid, list) else (rid,):
        if isinstance(one, str) and len(one) > MAX_RID_CHARS:
            return (f"rid has {len(one)} characters (allowed at most {MAX_RID_CHARS} with "
                    f"--enable-layered-kv: the control plane's request id limit, {MAX_ID_CHARS}, less room "
                    "for the _N suffix SGLang adds to a batch's or a parallel sample's ids)")
    return None


def after_generate_contract_error(result: str | None, body: Any) -> str | None:
    """AFTER ``generate_contract_error(body)``: SGLang's own violation first, else kvplane's."""
    return result if result is not None else body_error(body)
