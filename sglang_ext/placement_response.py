"""The per-request placement info in the main (tokenizer) process: ``meta_info["kvplane"]``.

The scheduler attaches a finished request's record to SGLang's generic per-request channel
(``req.customized_info["kvplane"]``, :mod:`sglang_ext.request_placement`); SGLang carries it to
the main process with that output. Here:

* AROUND ``TokenizerManager.update_request_meta_info`` (SGLang's hook for ``customized_info``,
  called only for outputs that carry some): kvplane's key becomes ``meta_info["kvplane"]``, one
  dict, on the request's final output -- not SGLang's per-token list, and never on other requests
  of the same batch (SGLang pads them with ``None``; they get nothing). Other keys go on to SGLang.
* AROUND ``TokenizerManager._stream_one_response`` (every request; composed with pacing):
  for a paced stream that asked, the deposit it held back when generation finished replaces the
  controller's figure (``deposit_source: "pacer"``): the same
  :class:`~controlplane.controller.token_deposit.TokenDeposit` rule as the pacer, fed with the same
  chunks as they are produced. A ``custom_params.kvplane_return_placement`` that is not a JSON
  boolean is refused where the request enters (:mod:`sglang_ext.request_slo`, HTTP 400); should
  one get here anyway (a caller that skips that entry), the request is aborted with the same
  ``ValueError``.

The OpenAI endpoints read ``meta_info["kvplane"]`` in :mod:`sglang_ext.openai_placement`; a
streaming OpenAI request gets it through a per-request sink (:data:`SINK_PARAM`) its handler puts
in the request's own ``custom_params`` dict (shared by every sub-request SGLang derives from it).

Requests that did not ask cost one dict lookup per request. No torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from controlplane.controller.token_deposit import TokenDeposit
from sglang_ext import compat
from sglang_ext.pacing import rejected_stream
from sglang_ext.placement_param import KEY, placement_param_error, wants_placement

if TYPE_CHECKING:
    from sglang_ext.context import PluginContext

SINK_PARAM = "_kvplane_placement_sink"
"""``custom_params`` key of the dict a streaming OpenAI handler collects the records in (by rid)."""


def custom_params_of(obj: Any) -> Any:
    """The ``custom_params`` of a ``GenerateReqInput`` (its first item's for a batch), or None."""
    sampling = getattr(obj, "sampling_params", None)
    if isinstance(sampling, list):
        sampling = sampling[0] if sampling else None
    return sampling.get("custom_params") if isinstance(sampling, dict) else None


def around_update_request_meta_info(
    original: Callable[..., Any],
    tokenizer_manager: Any,
    meta_info: dict,
    state: Any,
    customized_info: dict,
    index: int,
    finish_reason: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """AROUND ``TokenizerManager.update_request_meta_info``: see the module docstring."""
    if not isinstance(customized_info, dict) or KEY not in customized_info:
        return original(tokenizer_manager, meta_info, state, customized_info, index, finish_reason, *args, **kwargs)
    values = customized_info[KEY][index]
    record = values[-1] if values else None
    if isinstance(record, dict):
        meta_info[KEY] = record
        sink = custom_params_of(getattr(state, "obj", None))
        sink = sink.get(SINK_PARAM) if isinstance(sink, dict) else None
        if isinstance(sink, dict):
            sink[meta_info.get("id")] = record
    rest = {k: v for k, v in customized_info.items() if k != KEY}
    if rest:
        return original(tokenizer_manager, meta_info, state, rest, index, finish_reason, *args, **kwargs)
    return None


def _new_tokens(chunk: Any, before: int) -> int:
    """Output tokens a chunk adds (its cumulative ``completion_tokens``; one when it has none)."""
    meta = chunk.get("meta_info") if isinstance(chunk, dict) else None
    count = meta.get("completion_tokens") if isinstance(meta, dict) else None
    if isinstance(count, bool) or not isinstance(count, int):
        return 1
    return max(0, count - before)


async def tap_paced_deposit(
    source: AsyncIterator[Any], slo_tbt_ms: float, clock_ms: Callable[[], float] | None = None
) -> AsyncIterator[Any]:
    """Yield ``source``'s chunks unchanged but for the final record: its ``deposit_tokens`` become
    the tokens a pacer with ``slo_tbt_ms`` still held when the last chunk was produced."""
    if clock_ms is None:
        loop = asyncio.get_running_loop()

        def clock_ms() -> float:
            return loop.time() * 1000.0

    deposit = TokenDeposit(slo_tbt_ms)
    tokens = 0
    async for chunk in source:
        new = _new_tokens(chunk, tokens)
        tokens += new
        deposit.generate(clock_ms(), new)
        meta = chunk.get("meta_info") if isinstance(chunk, dict) else None
        record = meta.get(KEY) if isinstance(meta, dict) else None
        if isinstance(record, dict):
            record["deposit_tokens"] = deposit.balance
            record["deposit_source"] = "pacer"
        yield chunk


def around_stream_one_response(ctx: PluginContext, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``TokenizerManager._stream_one_response(self, obj, state, request)`` with the flag
    on: the opt-in is checked, a paced stream that asked gets the deposit tap, pacing (when on)
    wraps the rest."""
    obj_at = compat.TOKENIZER_STREAM_ONE_RESPONSE.params.index("obj")
    obj = kwargs["obj"] if "obj" in kwargs else (args[obj_at] if len(args) > obj_at else None)
    custom = custom_params_of(obj)
    message = placement_param_error(custom)
    if message is not None:
        return rejected_stream(args[0], obj, original(*args, **kwargs), message)
    settings = ctx.pacing_settings()
    if settings is None:
        return original(*args, **kwargs)
    from sglang_ext.pacing import around_stream_one_response as paced

    if not (wants_placement(custom) and getattr(obj, "stream", False)):
        return paced(ctx, original, *args, **kwargs)
    from sglang_ext.pacing import request_slo_tbt_ms

    try:
        slo = request_slo_tbt_ms(getattr(obj, "sampling_params", None), ctx.pacing_default_slo_tbt_ms(settings))
    except ValueError:
        return paced(ctx, original, *args, **kwargs)  # pacing refuses it, with its own message

    def tapped(*a: Any, **kw: Any) -> Any:
        return tap_paced_deposit(original(*a, **kw), slo)

    return paced(ctx, tapped, *args, **kwargs)
