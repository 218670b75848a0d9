"""The per-request placement info on the OpenAI endpoints: ``sglext.kvplane``.

SGLang puts its own per-request extras of ``/v1/completions`` and ``/v1/chat/completions``
(``return_cached_tokens_details``, routed experts, speculative-decoding details) in the
response-level extension object ``"sglext"``; kvplane's info goes there too, as
``sglext.kvplane``: one record (:data:`sglang_ext.placement_record.RESULT_FIELDS`) for one
choice, a list in choice order for ``n > 1`` or a list of prompts.

* Non-streaming: AFTER ``_build_completion_response`` / ``_build_chat_response`` -- when a
  result carries ``meta_info["kvplane"]`` the response is returned as the same response with an
  ``sglext`` that also has ``kvplane`` (subclasses of SGLang's models below, so serialisation and
  every other field are SGLang's).
* Streaming: AROUND ``_generate_completion_stream`` / ``_generate_chat_stream`` -- for a request
  that asked, a sink dict goes into its own ``custom_params`` (where
  :mod:`sglang_ext.placement_response` drops each finished record by rid) and one more chunk,
  ``{"choices": [], "sglext": {"kvplane": ...}}`` shaped like SGLang's own sglext chunk, is sent
  right before ``data: [DONE]``.

A request that did not ask costs one dict lookup (streaming) or one pass over its results'
``meta_info`` (non-streaming). Main process only; imported by the hooks on first use.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from sglang_ext.compat import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
    SglExt,
)
from sglang_ext.placement_param import KEY, wants_placement
from sglang_ext.placement_response import SINK_PARAM, custom_params_of

DONE = "data: [DONE]\n\n"
"""SGLang's last SSE line of an OpenAI stream."""


class KvplaneSglExt(SglExt):  # type: ignore[misc, valid-type]
    """SGLang's ``sglext`` plus ``kvplane`` (None fields are dropped by SGLang's serializer)."""

    kvplane: Any = None


class KvplaneCompletionResponse(CompletionResponse):  # type: ignore[misc, valid-type]
    sglext: KvplaneSglExt | None = None


class KvplaneChatCompletionResponse(ChatCompletionResponse):  # type: ignore[misc, valid-type]
    sglext: KvplaneSglExt | None = None


class KvplaneCompletionStreamResponse(CompletionStreamResponse):  # type: ignore[misc, valid-type]
    sglext: KvplaneSglExt | None = None


class KvplaneChatCompletionStreamResponse(ChatCompletionStreamResponse):  # type: ignore[misc, valid-type]
    sglext: KvplaneSglExt | None = None


def _value(records: list[Any]) -> Any:
    """One record for one choice, else the list in choice order."""
    return records[0] if len(records) == 1 else records


def _extended_sglext(sglext: Any, records: list[Any]) -> KvplaneSglExt:
    fields = {} if sglext is None else dict(sglext)
    return KvplaneSglExt.model_construct(**fields, kvplane=_value(records))


def with_placement(response: Any, records: list[Any]) -> Any:
    """``response`` (a completion or chat response) with ``sglext.kvplane``; anything else (an
    error response) unchanged."""
    if isinstance(response, CompletionResponse):
        cls: Any = KvplaneCompletionResponse
    elif isinstance(response, ChatCompletionResponse):
        cls = KvplaneChatCompletionResponse
    else:
        return response
    return cls.model_construct(**{**dict(response), "sglext": _extended_sglext(response.sglext, records)})


def after_build_response(result: Any, serving: Any, request: Any, ret: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``_build_completion_response`` / ``_build_chat_response(self, request, ret, created)``."""
    items = ret if isinstance(ret, list) else [ret]
    records = [item.get("meta_info", {}).get(KEY) if isinstance(item, dict) else None for item in items]
    if not any(isinstance(r, dict) for r in records):
        return None
    return with_placement(result, records)


def extension_chunk(chat: bool, *, rid: str, model: str, records: list[Any]) -> str:
    """The SSE line carrying ``sglext.kvplane``, shaped like SGLang's own sglext chunk."""
    cls: Any = KvplaneChatCompletionStreamResponse if chat else KvplaneCompletionStreamResponse
    chunk = cls(id=rid, created=int(time.time()), model=model, choices=[], sglext=_extended_sglext(None, records))
    return f"data: {chunk.model_dump_json()}\n\n"


def _rids(adapted_request: Any, sink: dict) -> list[str]:
    rid = getattr(adapted_request, "rid", None)
    ordered = rid if isinstance(rid, list) else [rid]
    return [r for r in ordered if r in sink] + [r for r in sink if r not in ordered]


async def _with_extension(
    source: AsyncIterator[str], chat: bool, adapted_request: Any, request: Any, sink: dict
) -> AsyncIterator[str]:
    async for line in source:
        if line == DONE and sink:
            rids = _rids(adapted_request, sink)
            yield extension_chunk(chat, rid=rids[0], model=request.model, records=[sink[r] for r in rids])
        yield line


def around_stream(chat: bool) -> Callable[..., Any]:
    """AROUND ``_generate_completion_stream`` (``chat=False``) / ``_generate_chat_stream``
    (``self, adapted_request, request, raw_request``)."""

    def around(original: Callable[..., Any], serving: Any, adapted_request: Any, request: Any, *args: Any,
               **kwargs: Any) -> Any:
        source = original(serving, adapted_request, request, *args, **kwargs)
        custom = custom_params_of(adapted_request)
        if not wants_placement(custom):
            return source
        sink: dict[str, Any] = {}
        custom[SINK_PARAM] = sink
        return _with_extension(source, chat, adapted_request, request, sink)

    return around
