"""Paced streaming output: the token deposit of OrbitFlow §3.2 on SGLang's streaming path.

Streamed chunks of a request are *deposited* when SGLang produces them and *released* to the
client at one token per TBT-SLO interval, so the user sees a steady rate while the request is
paused or its steps stall (the reserve built while generation ran ahead hides the stall). The
first token is released as soon as it exists (TTFT is not paced); when the request finishes the
remaining deposit is released at once. The timing rule is
:class:`controlplane.controller.token_deposit.TokenDeposit` -- the same object the controller
and the simulator use; this module only maps SGLang chunks onto its tokens.

Hook point (main process): AROUND ``TokenizerManager._stream_one_response`` (one async generator
per request). With ``--enable-layered-kv --kv-pacing on`` and ``obj.stream`` the generator is
wrapped by :func:`pace_stream`; non-streaming requests, and every request with the flag or pacing
off, get SGLang's generator untouched.

Off by default (issue 17, measured by ``kvplane bench pacing``): the rule paces every stream,
not only one that is paused or stalls. A server that generates faster than the SLO (15 ms a token
against the default 200 ms) has its streams slowed to one token per SLO and most of their text
released in the finish burst, whether or not anything stalls; what pacing buys -- a stall hidden
behind the tokens a stream ran ahead by -- only exists for streams that do get paused. The trade,
with the measured numbers, is in the README ("Streaming pacing").

Chunks and tokens. A chunk carries ``meta_info["completion_tokens"]`` (cumulative output tokens);
its new tokens go into the deposit and the chunk is released once the deposit has delivered its
last token. With SGLang's default ``stream_interval=1`` a chunk holds one token, so release is
per token; a chunk holding k tokens (coalesced outputs, speculative decoding) is released whole
when its k-th token is due -- chunks are never split, reordered or dropped, so the concatenated
stream is exactly SGLang's. Non-incremental intermediate chunks reference SGLang's growing
per-request lists (``output_ids`` and logprob lists), so a chunk is snapshotted when deposited
(:func:`snapshot_chunk`).

SLO of a request: ``custom_params["kvplane_slo_tbt_ms"]`` of its sampling parameters when given
(OpenAI endpoints: the request's ``custom_params`` field; ``/generate``:
``sampling_params.custom_params``), else the policy default ``slo_tbt_ms``: at launch the
``--kv-policy`` file's, or :class:`controlplane.policy.Policy`'s default; with
``--kv-policy-listen``, the live policy's once an update changes it (TP rank 0's scheduler sends it
to this process, :mod:`sglang_ext.pacing_slo_update`; read once per stream, when it starts, from
:meth:`sglang_ext.context.PluginContext.pacing_default_slo_tbt_ms`). A bad override never gets here: it is
refused with HTTP 400 where the request enters, on every request kind
(:mod:`sglang_ext.request_slo`); should one arrive anyway, the stream is aborted with the same
``ValueError``.

Loaded in the main (tokenizer) process only through the hook; no torch import.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import structlog

from controlplane.controller.token_deposit import TokenDeposit
from sglang_ext import compat
from sglang_ext.request_slo import MAX_SLO_TBT_MS as MAX_SLO_TBT_MS  # re-exported (older importers)
from sglang_ext.request_slo import SLO_PARAM as SLO_PARAM
from sglang_ext.request_slo import request_slo_tbt_ms

if TYPE_CHECKING:
    from sglang_ext.args import LayeredKVArgs
    from sglang_ext.context import PluginContext

log = structlog.get_logger(__name__)

T = TypeVar("T")


def chunk_completion_tokens(chunk: Any) -> int | None:
    """Cumulative output tokens of an SGLang stream chunk, or None when it carries no count."""
    if not isinstance(chunk, dict):
        return None
    meta = chunk.get("meta_info")
    if not isinstance(meta, dict):
        return None
    count = meta.get("completion_tokens")
    if isinstance(count, bool) or not isinstance(count, int):
        return None
    return count


def snapshot_chunk(chunk: Any) -> Any:
    """A copy of ``chunk`` whose lists no longer alias SGLang's growing per-request state.

    SGLang's non-incremental intermediate chunks pass ``state.output_ids`` (and logprob lists in
    ``meta_info``) by reference; a chunk held in the deposit must keep the values it had when it
    was produced. Top-level and ``meta_info`` lists are copied (shallowly); anything else is shared.
    """
    if not isinstance(chunk, dict):
        return chunk
    out = {k: (list(v) if isinstance(v, list) else v) for k, v in chunk.items()}
    meta = out.get("meta_info")
    if isinstance(meta, dict):
        out["meta_info"] = {k: (list(v) if isinstance(v, list) else v) for k, v in meta.items()}
    return out


class StreamPacer(Generic[T]):
    """Chunk-level view of one request's :class:`TokenDeposit`; explicit time in ms.

    ``count_tokens(chunk)`` returns the cumulative output-token count a chunk brings the stream
    to (None: the chunk adds one token). Every method returns the chunks released by that call,
    in production order. Not thread-safe: one owner drives it.
    """

    def __init__(
        self,
        slo_tbt_ms: float,
        count_tokens: Callable[[T], int | None] = chunk_completion_tokens,
    ) -> None:
        self._deposit = TokenDeposit(slo_tbt_ms)
        self._count_tokens = count_tokens
        self._held: deque[tuple[int, T]] = deque()  # (cumulative tokens once released, chunk)
        self._tokens = 0  # cumulative tokens produced so far
        self._released_tokens = 0
        self._chunks_in = 0
        self._chunks_out = 0

    @property
    def deposit(self) -> TokenDeposit:
        """The underlying token deposit (balance, violations, SLO)."""
        return self._deposit

    @property
    def held_chunks(self) -> int:
        """Chunks deposited but not yet released."""
        return len(self._held)

    @property
    def chunks_released(self) -> int:
        """Chunks released so far."""
        return self._chunks_out

    def push(self, now_ms: float, chunk: T) -> list[T]:
        """Deposit a chunk produced at ``now_ms``; return the chunks due by then."""
        count = self._count_tokens(chunk)
        total = self._tokens + 1 if count is None else max(self._tokens, count)
        new_tokens = total - self._tokens
        self._tokens = total
        self._held.append((total, chunk))
        self._chunks_in += 1
        self._note(self._deposit.generate(now_ms, new_tokens))
        return self._release()

    def advance(self, now_ms: float) -> list[T]:
        """Release every chunk whose last token is due at or before ``now_ms``."""
        self._note(self._deposit.advance(now_ms))
        return self._release()

    def finish(self, now_ms: float) -> list[T]:
        """The stream ended at ``now_ms``: release what is due, then everything held (burst)."""
        self._note(self._deposit.finish(now_ms))
        return self._release()

    def next_release_ms(self) -> float | None:
        """When the next deposited token is due (a wake-up time), None while nothing is held."""
        if not self._held:
            return None
        return self._deposit.next_delivery_ms()

    def _note(self, deliveries: list) -> None:
        self._released_tokens += len(deliveries)

    def _release(self) -> list[T]:
        out: list[T] = []
        while self._held and self._held[0][0] <= self._released_tokens:
            out.append(self._held.popleft()[1])
        self._chunks_out += len(out)
        return out


_END = object()


def _loop_clock_ms() -> float:
    return asyncio.get_running_loop().time() * 1000.0


async def pace_stream(
    source: AsyncIterator[T],
    pacer: StreamPacer[T],
    *,
    snapshot: Callable[[T], T] = snapshot_chunk,
    clock_ms: Callable[[], float] = _loop_clock_ms,
    rid: str | None = None,
) -> AsyncIterator[T]:
    """Yield ``source``'s chunks in order, released by ``pacer``.

    A producer task drains ``source`` as fast as it yields (so generation times are observed
    when they happen) into a queue; this generator releases chunks when the deposit says so.
    The clock defaults to the event loop's (``loop.time()``), which is also what the timeouts
    use, so a virtual-time loop drives it deterministically. An exception from ``source`` is
    raised after every chunk produced before it was released; closing this generator (client
    gone) cancels the producer, which closes ``source``.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def produce() -> None:
        try:
            async for chunk in source:
                queue.put_nowait(snapshot(chunk))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # forwarded in order, re-raised by the consumer
            queue.put_nowait((_END, exc))
            return
        queue.put_nowait((_END, None))

    producer = asyncio.create_task(produce())
    getter: asyncio.Task[Any] | None = None  # kept across timeouts: a got item is never lost
    error: BaseException | None = None
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(queue.get())
            due = pacer.next_release_ms()
            timeout_s = None if due is None else max(0.0, (due - clock_ms()) / 1000.0)
            done, _ = await asyncio.wait({getter}, timeout=timeout_s)
            if not done:
                for chunk in pacer.advance(clock_ms()):
                    yield chunk
                continue
            item, getter = getter.result(), None
            if isinstance(item, tuple) and len(item) == 2 and item[0] is _END:
                error = item[1]
                break
            for chunk in pacer.push(clock_ms(), item):
                yield chunk
        for chunk in pacer.finish(clock_ms()):
            yield chunk
        deposit = pacer.deposit
        log.debug(
            "stream_paced",
            rid=rid,
            tokens=deposit.generated,
            chunks=pacer.chunks_released,
            slo_tbt_ms=deposit.slo_tbt_ms,
            violations=deposit.violations,
        )
        if error is not None:
            raise error
    finally:
        for task in (getter, producer):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass


# ----- SGLang hook --------------------------------------------------------------------------


class PacingSettings:
    """Pacing settings resolved from the kvplane launch options (cached by the process's
    :meth:`sglang_ext.context.PluginContext.pacing_settings`); ``default_slo_tbt_ms`` is the launch
    default, which a live policy update supersedes (``PluginContext.live_slo_tbt_ms``)."""

    def __init__(self, default_slo_tbt_ms: float) -> None:
        self.default_slo_tbt_ms = float(default_slo_tbt_ms)

    @classmethod
    def from_args(cls, layered: LayeredKVArgs) -> PacingSettings:
        """The default SLO of the ``--kv-policy`` file, else of :class:`controlplane.policy.Policy`."""
        from controlplane.policy import Policy

        if layered.kv_policy is not None:
            from controlplane.policy_store import load_policy_file

            slo = load_policy_file(layered.kv_policy).slo_tbt_ms
        else:
            slo = Policy().slo_tbt_ms
        log.info("pacing_enabled", default_slo_tbt_ms=slo)
        return cls(slo)


async def rejected_stream(
    tokenizer_manager: Any, obj: Any, source: Any, message: str
) -> AsyncIterator[Any]:
    """A stream that aborts ``obj``'s request, closes ``source`` and raises ``ValueError(message)``
    (HTTP 400 on the OpenAI endpoints) on its first pull."""
    try:
        tokenizer_manager.abort_request(obj.rid)
    finally:
        await source.aclose()
    raise ValueError(message)
    yield  # pragma: no cover - makes this an async generator


def around_stream_one_response(
    ctx: PluginContext, original: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``TokenizerManager._stream_one_response(self, obj, state, request)``, with the
    process's context (its pacing settings)."""
    source = original(*args, **kwargs)
    obj_at = compat.TOKENIZER_STREAM_ONE_RESPONSE.params.index("obj")
    obj = kwargs["obj"] if "obj" in kwargs else (args[obj_at] if len(args) > obj_at else None)
    if obj is None or not getattr(obj, "stream", False):
        return source
    settings = ctx.pacing_settings()
    if settings is None:
        return source
    try:
        slo = request_slo_tbt_ms(getattr(obj, "sampling_params", None), ctx.pacing_default_slo_tbt_ms(settings))
    except ValueError as exc:
        return rejected_stream(args[0], obj, source, str(exc))
    return pace_stream(source, StreamPacer(slo), rid=getattr(obj, "rid", None))
