"""kvplane's per-request parameters and placement info on ``/v1/responses`` (OpenAI Responses API).

SGLang 0.5.23's ``ResponsesRequest`` has no ``custom_params`` field (unlike ``CompletionRequest``
and ``ChatCompletionRequest``) and pydantic drops unknown fields, so a request's
``custom_params`` never reaches the engine there; its ``ResponsesResponse`` has no ``sglext``
either. With ``--enable-layered-kv`` kvplane fills both gaps for its own keys:

* Input -- AROUND ``OpenAIServingResponses.create_responses(self, request, raw_request)``: the
  top-level ``custom_params`` of the raw JSON body (the same place as on ``/v1/completions``) is
  read (only when the body mentions it: one substring search of the cached body), its ``kvplane_*``
  keys are checked with the same rules as on every other endpoint (HTTP 400 naming the field
  before anything runs, in SGLang's Responses error shape; a ``custom_params`` that is not an
  object is refused too) and kept on the request's ``raw_request.state``. Other keys stay ignored,
  as SGLang ignores them on this endpoint. AROUND
  ``OpenAIServingResponses._generate_with_builtin_tools`` (which receives the engine's
  ``sampling_params`` dict and ``raw_request``) puts them into ``sampling_params["custom_params"]``
  -- a new dict, so a ``--preferred-sampling-params`` default is never mutated -- so every
  generation turn of the request carries them: the SLO override, the recompute override and the
  placement opt-in then work as on ``/v1/chat/completions`` (pacing included, the request is a
  ``GenerateReqInput`` like any other).
* Output -- a request with ``custom_params.kvplane_return_placement: true`` gets a sink in its
  ``custom_params`` (:data:`sglang_ext.placement_response.SINK_PARAM`: the main process drops
  the finished record there by rid). The non-streaming ``ResponsesResponse`` comes back as
  :class:`KvplaneResponsesResponse` with ``sglext.kvplane`` (SGLang's extension object of OpenAI
  responses); a stream's terminal lifecycle event (``response.completed`` / ``.incomplete`` /
  ``.failed``, whose ``response`` is the final response object) gets
  ``response.sglext.kvplane``. With built-in tool turns (several generations under one id) the
  last turn's record is returned.

Not covered: ``background: true`` responses (the handler returns the queued response before
anything ran; the stored copy ``GET /v1/responses/{id}`` returns is SGLang's, without
``sglext``), likewise the stored copy of any response. A request that does not mention
``custom_params`` costs one substring search of its body and one ``getattr``. Main process only.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from sglang_ext import compat
from sglang_ext.openai_placement import KvplaneSglExt
from sglang_ext.placement_param import KEY, wants_placement
from sglang_ext.placement_response import SINK_PARAM
from sglang_ext.request_slo import PREFIX, custom_params_type_error, sampling_params_error

STATE_ATTR = "kvplane_custom_params"
"""``raw_request.state`` attribute carrying the request's checked kvplane keys to the engine call."""
TERMINAL_EVENTS = tuple(f"event: response.{status}\n" for status in ("completed", "incomplete", "failed"))
"""SSE heads of the lifecycle events that carry the final response object."""


class KvplaneResponsesResponse(compat.ResponsesResponse):  # type: ignore[misc, name-defined]
    """SGLang's ``ResponsesResponse`` plus SGLang's ``sglext`` extension object, with ``kvplane``."""

    sglext: KvplaneSglExt | None = None


def body_custom_params(body: Any) -> tuple[dict[str, Any] | None, str | None]:
    """The ``kvplane_*`` keys of a Responses body's ``custom_params`` and the refusal, if any:
    ``(keys, None)``, ``(None, message)``, or ``(None, None)`` when there is nothing of kvplane's."""
    custom = body.get("custom_params") if isinstance(body, dict) else None
    if (shape := custom_params_type_error(custom)) is not None:
        return None, shape
    if custom is None:
        return None, None
    own = {k: v for k, v in custom.items() if isinstance(k, str) and k.startswith(PREFIX)}
    if not own:
        return None, None
    message = sampling_params_error({"custom_params": own})
    return (None, message) if message is not None else (own, None)


async def _raw_custom_params(raw_request: Any) -> tuple[dict[str, Any] | None, str | None]:
    if raw_request is None:
        return None, None
    body = await raw_request.body()  # Starlette caches it: FastAPI already read it
    if b"custom_params" not in body:
        return None, None
    try:
        parsed = json.loads(body)
    except ValueError:  # FastAPI parsed it already; nothing of kvplane's in a body it could not
        return None, None
    return body_custom_params(parsed)


def with_placement(response: Any, records: list[Any]) -> Any:
    """``response`` as :class:`KvplaneResponsesResponse` with ``sglext.kvplane`` (one record, or
    the list); anything but a ``ResponsesResponse`` (an error response) unchanged."""
    if not isinstance(response, compat.ResponsesResponse) or not records:
        return response
    value = records[0] if len(records) == 1 else records
    return KvplaneResponsesResponse.model_construct(
        **{**dict(response), "sglext": KvplaneSglExt.model_construct(kvplane=value)}
    )


def placement_event(event: str, records: list[Any]) -> str:
    """A terminal lifecycle SSE event with ``response.sglext.kvplane`` added (others unchanged)."""
    if not records or not event.startswith(TERMINAL_EVENTS):
        return event
    head, sep, data = event.partition("data: ")
    try:
        payload = json.loads(data)
    except ValueError:
        return event
    response = payload.get("response") if isinstance(payload, dict) else None
    if not isinstance(response, dict):
        return event
    sglext = response.get("sglext")
    value = records[0] if len(records) == 1 else records
    response["sglext"] = {**(sglext if isinstance(sglext, dict) else {}), KEY: value}
    return f"{head}{sep}{json.dumps(payload, separators=(',', ':'))}\n\n"


async def _with_placement_events(source: AsyncIterator[Any], sink: dict[str, Any]) -> AsyncIterator[Any]:
    try:
        async for event in source:
            if sink and isinstance(event, str):
                event = placement_event(event, list(sink.values()))
            yield event
    finally:
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()


async def around_create_responses(original: Callable[..., Any], serving: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``OpenAIServingResponses.create_responses(self, request, raw_request=None)``."""
    names = compat.OPENAI_RESPONSES_CREATE.args
    raw_request = kwargs.get(names[1], args[1] if len(args) > 1 else None)
    custom, message = await _raw_custom_params(raw_request)
    if message is not None:
        return serving.create_error_response(message, param="custom_params")
    if custom is None or raw_request is None:
        return await original(serving, *args, **kwargs)
    sink: dict[str, Any] | None = None
    if wants_placement(custom):
        sink = {}
        custom[SINK_PARAM] = sink
    setattr(raw_request.state, STATE_ATTR, custom)
    result = await original(serving, *args, **kwargs)
    if sink is None:
        return result
    if isinstance(result, compat.ResponsesResponse):
        return with_placement(result, list(sink.values()))
    if hasattr(result, "__aiter__"):  # a stream: its terminal event is built after generation
        return _with_placement_events(result, sink)
    return result


def around_generate(original: Callable[..., Any], serving: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``OpenAIServingResponses._generate_with_builtin_tools(self, request_id, request_prompt,
    adapted_request, sampling_params, context, raw_request=None, ...)``: the request's checked
    kvplane keys join its engine ``sampling_params["custom_params"]``."""
    names = compat.OPENAI_RESPONSES_GENERATE.args
    raw_at = len(names)  # raw_request follows the declared leading parameters
    raw_request = kwargs.get("raw_request", args[raw_at] if len(args) > raw_at else None)
    custom = getattr(getattr(raw_request, "state", None), STATE_ATTR, None)
    if custom:
        adapted = kwargs.get(names[2], args[2] if len(args) > 2 else None)
        sampling = kwargs.get(names[3], args[3] if len(args) > 3 else None)
        for params in (sampling, getattr(adapted, "sampling_params", None)):
            if isinstance(params, dict):
                existing = params.get("custom_params")
                params["custom_params"] = {**(existing if isinstance(existing, dict) else {}), **custom}
    return original(serving, *args, **kwargs)
