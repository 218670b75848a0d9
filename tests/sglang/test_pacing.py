"""Unit tests of the streaming pacer (OrbitFlow §3.2 token deposit on SGLang's stream).

The async driver runs on an event loop with a virtual clock: ``loop.time()`` only moves when
the loop would otherwise block, by exactly the time to the next timer. A fake source that
``asyncio.sleep``s between chunks therefore produces them at exact virtual times and every
release time is exact, so timing assertions are deterministic (no real waiting).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.controller.token_deposit import TokenDeposit
from sglang_ext import args as kv_args
from sglang_ext.context import PluginContext
from sglang_ext.pacing import (
    SLO_PARAM,
    StreamPacer,
    around_stream_one_response,
    pace_stream,
    request_slo_tbt_ms,
    snapshot_chunk,
)

EPS_MS = 1e-6


class _VirtualSelector:
    """Selector whose ``select(timeout)`` advances the loop's virtual clock instead of blocking."""

    def __init__(self, real: selectors.BaseSelector, loop: VirtualClockLoop) -> None:
        self._real = real
        self._loop = loop

    def select(self, timeout: float | None = None) -> list:
        ready = self._real.select(0)
        if not ready and timeout:
            self._loop.virtual_s += timeout
        elif not ready and timeout is None and not self._loop._ready:
            raise RuntimeError("virtual loop would block forever (no timers, no ready callbacks)")
        return ready

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual; idle waits cost no real time."""

    def __init__(self) -> None:
        super().__init__()
        self.virtual_s = 0.0
        self._selector = _VirtualSelector(self._selector, self)

    def time(self) -> float:
        return self.virtual_s


def run_virtual(coro_fn: Callable[[], Any]) -> Any:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()


def chunk(total: int, text: str = "") -> dict:
    """An SGLang-like incremental chunk bringing the stream to ``total`` output tokens."""
    return {"text": text, "output_ids": [total], "meta_info": {"completion_tokens": total}}


async def fake_source(
    schedule: Sequence[tuple[float, dict]], closed: list | None = None
) -> AsyncIterator[dict]:
    """Yield each chunk at its (virtual, seconds) production time."""
    loop = asyncio.get_running_loop()
    try:
        for at_s, item in schedule:
            delay = at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            yield item
    finally:
        if closed is not None:
            closed.append(loop.time())


async def collect(gen: AsyncIterator[dict]) -> list[tuple[float, dict]]:
    loop = asyncio.get_running_loop()
    return [(loop.time() * 1000.0, item) async for item in gen]


def paced(schedule: Sequence[tuple[float, dict]], slo_ms: float) -> list[tuple[float, dict]]:
    async def main() -> list[tuple[float, dict]]:
        return await collect(pace_stream(fake_source(schedule), StreamPacer(slo_ms)))

    return run_virtual(main)


def expected_release_ms(gen_ms: Sequence[float], slo_ms: float, end_ms: float) -> list[float]:
    """Per-token release times by the controller's TokenDeposit (the reference)."""
    deposit = TokenDeposit(slo_ms)
    times: dict[int, float] = {}
    for g in gen_ms:
        for d in deposit.generate(g, 1):
            times[d.index] = d.delivered_ms
    for d in deposit.finish(end_ms):
        times[d.index] = d.delivered_ms
    return [times[i] for i in range(len(gen_ms))]


# ----- sync core ---------------------------------------------------------------------------


def test_core_releases_first_chunk_at_once_then_one_per_slo() -> None:
    """The first token is released when produced; later ones one SLO apart while deposited."""
    pacer: StreamPacer[dict] = StreamPacer(100.0)
    assert pacer.push(0.0, chunk(1, "a")) == [chunk(1, "a")]
    assert pacer.push(10.0, chunk(2, "b")) == []
    assert pacer.push(20.0, chunk(3, "c")) == []
    assert pacer.next_release_ms() == pytest.approx(100.0)
    assert pacer.advance(99.0) == []
    assert pacer.advance(100.0) == [chunk(2, "b")]
    assert pacer.advance(200.0) == [chunk(3, "c")]
    assert pacer.next_release_ms() is None


def test_core_multi_token_chunk_waits_for_its_last_token() -> None:
    """A chunk carrying k new tokens is released when its k-th token is due, never earlier."""
    pacer: StreamPacer[dict] = StreamPacer(50.0)
    assert pacer.push(0.0, chunk(1)) == [chunk(1)]
    assert pacer.push(1.0, chunk(4)) == []  # tokens 2..4 due at 50, 100, 150
    assert pacer.advance(100.0) == []
    assert pacer.advance(150.0) == [chunk(4)]


def test_core_finish_bursts_the_remainder_in_order() -> None:
    """finish() releases every held chunk at once, in production order."""
    pacer: StreamPacer[dict] = StreamPacer(1000.0)
    items = [chunk(i, str(i)) for i in range(1, 6)]
    released = []
    for i, item in enumerate(items):
        released += pacer.push(float(i), item)
    released += pacer.finish(10.0)
    assert released == items
    assert pacer.held_chunks == 0


def test_core_zero_token_chunk_follows_its_predecessor() -> None:
    """A chunk adding no token (e.g. a final meta-only chunk) is released right after the previous one."""
    pacer: StreamPacer[dict] = StreamPacer(100.0)
    pacer.push(0.0, chunk(1))
    assert pacer.push(5.0, chunk(2)) == []
    assert pacer.push(6.0, chunk(2, "meta")) == []
    assert pacer.advance(100.0) == [chunk(2), chunk(2, "meta")]


def test_snapshot_breaks_aliasing_of_growing_lists() -> None:
    """A deposited chunk keeps the output_ids it had when produced, though SGLang keeps appending."""
    shared = [1, 2]
    out = {"text": "x", "output_ids": shared, "meta_info": {"completion_tokens": 2, "lp": shared}}
    snap = snapshot_chunk(out)
    shared.append(3)
    assert snap["output_ids"] == [1, 2]
    assert snap["meta_info"]["lp"] == [1, 2]
    assert snap["text"] == "x"


# ----- async driver on a virtual clock -----------------------------------------------------


def test_stall_is_hidden_by_the_reserve() -> None:
    """Scenario: 8 tokens produced fast, then a 300 ms pause, then 4 more; the user sees a steady 50 ms rate."""
    schedule = [(i * 0.010, chunk(i + 1, f"t{i}")) for i in range(8)]
    schedule += [(0.370 + i * 0.010, chunk(9 + i, f"t{8 + i}")) for i in range(4)]
    out = paced(schedule, 50.0)
    assert [item for _, item in out] == [item for _, item in schedule]
    times = [t for t, _ in out]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Before the finish burst every gap is exactly one SLO: the 300 ms stall is invisible.
    burst_start = next(i for i, t in enumerate(times) if t >= 0.400 * 1000 - EPS_MS)
    assert all(abs(g - 50.0) < 1e-6 for g in gaps[: burst_start - 1])
    assert times == pytest.approx(
        expected_release_ms([s * 1000 for s, _ in schedule], 50.0, schedule[-1][0] * 1000)
    )


def test_empty_deposit_releases_on_production() -> None:
    """When generation is slower than the SLO, each chunk is released as soon as it is produced."""
    schedule = [(i * 0.2, chunk(i + 1)) for i in range(5)]
    out = paced(schedule, 50.0)
    assert [t for t, _ in out] == pytest.approx([s * 1000 for s, _ in schedule])


@settings(max_examples=60, deadline=None)
@given(
    gaps_ms=st.lists(st.floats(0.0, 200.0), min_size=1, max_size=25),
    steps=st.lists(st.integers(0, 3), min_size=25, max_size=25),
    slo_ms=st.floats(1.0, 150.0),
)
def test_paced_stream_is_identical_ordered_and_spaced(
    gaps_ms: list[float], steps: list[int], slo_ms: float
) -> None:
    """For any production schedule: same chunks in the same order, never before production,
    and consecutive releases before the final burst at least one SLO apart."""
    schedule, t, total = [], 0.0, 0
    for gap, k in zip(gaps_ms, steps, strict=False):
        t += gap / 1000.0
        total += k if schedule else max(k, 1)
        schedule.append((t, chunk(total, f"<{total}>")))
    out = paced(schedule, slo_ms)
    assert [item for _, item in out] == [item for _, item in schedule]
    end_ms = schedule[-1][0] * 1000
    for (rel, _), (prod_s, _) in zip(out, schedule, strict=True):
        assert rel >= prod_s * 1000 - EPS_MS
    # Spacing is between chunks that carry new tokens (a zero-token chunk rides with its
    # predecessor's token); a chunk of k tokens is due k SLOs after the previous token chunk.
    last_ms, last_total = None, 0
    for rel, item in out:
        total = item["meta_info"]["completion_tokens"]
        if total == last_total:
            continue
        if last_ms is not None and rel < end_ms - EPS_MS:
            assert rel - last_ms >= (total - last_total) * slo_ms - 1e-6
        last_ms, last_total = rel, total


def test_source_error_raised_after_earlier_chunks() -> None:
    """An exception from SGLang's generator reaches the client after every chunk produced before it."""

    async def failing() -> AsyncIterator[dict]:
        yield chunk(1, "a")
        await asyncio.sleep(0.001)
        yield chunk(2, "b")
        raise ValueError("client disconnected")

    async def main() -> list[dict]:
        got = []
        with pytest.raises(ValueError, match="client disconnected"):
            async for item in pace_stream(failing(), StreamPacer(500.0)):
                got.append(item)
        return got

    assert run_virtual(main) == [chunk(1, "a"), chunk(2, "b")]


def test_closing_the_paced_stream_closes_the_source() -> None:
    """A client that goes away (aclose) cancels the producer and SGLang's generator is finalised."""
    closed: list[float] = []
    schedule = [(i * 0.01, chunk(i + 1)) for i in range(100)]

    async def main() -> None:
        gen = pace_stream(fake_source(schedule, closed), StreamPacer(20.0))
        assert (await gen.__anext__()) == chunk(1)
        await gen.aclose()

    run_virtual(main)
    assert closed, "the source generator was not finalised"


# ----- SLO resolution and the SGLang hook dispatch ------------------------------------------


def test_request_slo_override_and_default() -> None:
    """custom_params overrides the policy default; absent or null means the default."""
    assert request_slo_tbt_ms({}, 200.0) == 200.0
    assert request_slo_tbt_ms({"custom_params": None}, 200.0) == 200.0
    assert request_slo_tbt_ms({"custom_params": {SLO_PARAM: 40}}, 200.0) == 40.0


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "50", True, 2e7])
def test_request_slo_bad_override_names_field_and_range(bad: object) -> None:
    """A bad per-request SLO is a ValueError naming custom_params.kvplane_slo_tbt_ms and the range."""
    with pytest.raises(
        ValueError, match=r"custom_params\.kvplane_slo_tbt_ms=.*allowed \(0, 1e\+07\]"
    ):
        request_slo_tbt_ms({"custom_params": {SLO_PARAM: bad}}, 200.0)


class _Obj:
    def __init__(self, stream: bool, sampling_params: dict | None = None) -> None:
        self.stream = stream
        self.rid = "r1"
        self.sampling_params = sampling_params or {}


class _FakeTokenizerManager:
    """Stands in for SGLang's TokenizerManager in hook-dispatch tests (the e2e test uses the real one)."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)


def _original(items: list[dict]) -> Callable[..., AsyncIterator[dict]]:
    async def gen(self: Any, obj: Any, state: Any, request: Any = None) -> AsyncIterator[dict]:
        for item in items:
            yield item

    return gen


@pytest.fixture
def ctx() -> PluginContext:
    """A fresh per-process context (what register() builds)."""
    return PluginContext()


@pytest.fixture
def layered(ctx: PluginContext) -> Callable[[str], None]:
    def set_pacing(mode: str) -> None:
        ctx.layered = kv_args.LayeredKVArgs(enable_layered_kv=True, kv_pacing=mode)

    return set_pacing


def test_hook_passes_non_streaming_and_pacing_off_through(ctx: PluginContext, layered: Callable[[str], None]) -> None:
    """Non-streaming requests, and streaming ones with --kv-pacing off, get SGLang's generator itself."""
    items = [chunk(1)]
    layered("on")
    tm = _FakeTokenizerManager()
    gen = around_stream_one_response(
        ctx, _original(items), tm, obj=_Obj(False), state=None, request=None
    )
    assert gen.__qualname__.endswith("gen")
    layered("off")
    gen = around_stream_one_response(ctx, _original(items), tm, obj=_Obj(True), state=None, request=None)
    assert gen.__qualname__.endswith("gen")


def test_hook_paces_streaming_and_rejects_bad_slo(ctx: PluginContext, layered: Callable[[str], None]) -> None:
    """A streaming request is paced with its SLO; a bad override aborts it with a clear ValueError."""
    layered("on")
    tm = _FakeTokenizerManager()
    items = [chunk(1, "a"), chunk(2, "b")]
    obj = _Obj(True, {"custom_params": {SLO_PARAM: 30}})
    gen = around_stream_one_response(ctx, _original(items), tm, obj=obj, state=None, request=None)
    assert gen.__qualname__ == "pace_stream"
    out = run_virtual(lambda: collect(gen))
    assert [item for _, item in out] == items
    bad = _Obj(True, {"custom_params": {SLO_PARAM: -5}})
    gen = around_stream_one_response(ctx, _original(items), tm, obj=bad, state=None, request=None)

    async def first() -> None:
        await gen.__anext__()

    with pytest.raises(ValueError, match="kvplane_slo_tbt_ms=-5"):
        run_virtual(first)
    assert tm.aborted == ["r1"]
