"""The placement info in the main process: ``meta_info["kvplane"]`` from SGLang's customized-info
channel, the paced stream's deposit, the opt-in check (no SGLang needed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_ext.args import LayeredKVArgs
from sglang_ext.context import PluginContext
from sglang_ext.pacing import StreamPacer
from sglang_ext.placement_response import (
    SINK_PARAM,
    around_stream_one_response,
    around_update_request_meta_info,
    tap_paced_deposit,
)
from sglang_ext.request_placement import KEY, PARAM

RECORD = {"layers": 4, "layers_offloaded": 2, "deposit_tokens": 0, "deposit_source": "controller"}


class Recorder:
    """SGLang's ``update_request_meta_info`` as a recording stand-in (what reached it)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, tm: Any, meta_info: dict, state: Any, customized_info: dict, index: int, reason: Any) -> None:
        self.calls.append(dict(customized_info))
        for key, values in customized_info.items():
            meta_info[key] = list(values[index])


def _state(custom_params: dict | None = None) -> Any:
    return SimpleNamespace(obj=SimpleNamespace(sampling_params={"custom_params": custom_params}))


def test_the_record_becomes_one_dict_for_its_request_and_nothing_for_the_others():
    """Scenario: one output batch of three requests, the middle one finishing with a record (SGLang
    pads the others with None per token) plus a model's own per-token key. The middle request gets
    ``meta_info["kvplane"]`` = the record; the others get no kvplane key (negative control); the
    model's key still reaches SGLang, without kvplane's."""
    info = {KEY: [[None, None], [RECORD], [None]], "model_key": [[1, 2], [3], [4]]}
    original = Recorder()
    metas = [{"id": f"r{i}"} for i in range(3)]
    for i, meta in enumerate(metas):
        around_update_request_meta_info(original, None, meta, _state(), info, i, None)
    assert metas[1][KEY] is RECORD
    assert KEY not in metas[0] and KEY not in metas[2]
    assert [m["model_key"] for m in metas] == [[1, 2], [3], [4]]
    assert all(set(call) == {"model_key"} for call in original.calls)


def test_outputs_without_the_key_go_to_sglang_unchanged_and_a_lone_key_not_at_all():
    """Without kvplane's key SGLang sees the call as it was; with only kvplane's, SGLang is not
    called (it would accumulate an empty per-token list)."""
    original = Recorder()
    meta: dict = {"id": "r"}
    around_update_request_meta_info(original, None, meta, _state(), {"model_key": [[7]]}, 0, None)
    assert original.calls == [{"model_key": [[7]]}] and meta == {"id": "r", "model_key": [7]}
    original = Recorder()
    around_update_request_meta_info(original, None, {"id": "r"}, _state(), {KEY: [[RECORD]]}, 0, None)
    assert original.calls == []


def test_a_streaming_openai_request_gets_its_record_in_its_sink():
    """The sink a streaming OpenAI handler put in the request's custom_params receives the record
    under the request id; a request with no sink is unaffected."""
    sink: dict = {}
    state = _state({PARAM: True, SINK_PARAM: sink})
    around_update_request_meta_info(Recorder(), None, {"id": "rid-1"}, state, {KEY: [[RECORD]]}, 0, None)
    assert sink == {"rid-1": RECORD}


def _chunks(times_and_tokens: list[tuple[float, int]], record: dict) -> list[dict]:
    out = [{"text": "x", "meta_info": {"completion_tokens": n}} for _, n in times_and_tokens]
    out[-1]["meta_info"][KEY] = record
    return out


async def _collect(source: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in source]


@pytest.mark.parametrize("slo_ms", [50.0, 200.0])
def test_the_paced_deposit_is_the_pacers_balance_when_generation_ended(slo_ms):
    """Six tokens produced at 0, 10, 20, 30, 40 and 300 ms: the tap's ``deposit_tokens`` equals a
    real :class:`StreamPacer`'s balance after the same pushes (and differs between SLOs: the
    figure depends on the pacing rule, not on the chunk count)."""
    schedule = [(0.0, 1), (10.0, 2), (20.0, 3), (30.0, 4), (40.0, 5), (300.0, 6)]
    record = dict(RECORD)
    chunks = _chunks(schedule, record)
    clock = iter(t for t, _ in schedule)

    async def source() -> AsyncIterator[dict]:
        for chunk in chunks:
            yield chunk

    out = asyncio.run(_collect(tap_paced_deposit(source(), slo_ms, clock_ms=lambda: next(clock))))
    assert out == chunks and all(KEY not in c["meta_info"] for c in out[:-1])
    pacer: StreamPacer[dict] = StreamPacer(slo_ms)
    for (t, _), chunk in zip(schedule, chunks, strict=True):
        pacer.push(t, chunk)
    assert record["deposit_source"] == "pacer"
    assert record["deposit_tokens"] == pacer.deposit.balance
    assert record["deposit_tokens"] == {50.0: 0, 200.0: 4}[slo_ms]


class Manager:
    """The tokenizer manager's ``abort_request`` (what a refusal calls)."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)


def _source_factory(n_tokens: int, with_record: bool, made: list[Any]) -> Any:
    """SGLang's per-request generator: ``n_tokens`` chunks, the last with a record; each generator
    made is appended to ``made``."""

    async def gen() -> AsyncIterator[dict]:
        for n in range(1, n_tokens + 1):
            meta: dict = {"completion_tokens": n}
            if with_record and n == n_tokens:
                meta[KEY] = dict(RECORD)
            yield {"text": "x", "meta_info": meta}

    def make(tm: Any, obj: Any, state: Any, request: Any) -> Any:
        made.append(gen())
        return made[-1]

    return make


def _ctx(pacing: str) -> PluginContext:
    return PluginContext(layered=LayeredKVArgs(enable_layered_kv=True, kv_pacing=pacing))


def _obj(custom: dict, stream: bool = True) -> Any:
    return SimpleNamespace(rid="r", stream=stream, sampling_params={"custom_params": custom})


def test_a_bad_opt_in_aborts_the_request_with_one_message():
    """``kvplane_return_placement: "yes"``: the request is aborted and the stream raises the
    ValueError naming the field (SGLang answers HTTP 400 with it)."""
    manager, made = Manager(), []
    gen = around_stream_one_response(_ctx("off"), _source_factory(3, False, made), manager,
                                     _obj({PARAM: "yes"}), None, None)
    with pytest.raises(ValueError, match=rf'custom_params\.{PARAM}="yes" is invalid \(allowed: true or false\)'):
        asyncio.run(_collect(gen))
    assert manager.aborted == ["r"] and made[0].ag_frame is None  # SGLang's generator closed


def test_without_pacing_the_stream_is_sglangs_own_generator():
    """Pacing off: a request that asked gets SGLang's generator itself (the controller's deposit
    stays in its record)."""
    factory = _source_factory(3, True, [])
    marker = object()
    assert around_stream_one_response(_ctx("off"), lambda *a: marker, None, _obj({PARAM: True}), None, None) is marker
    out = asyncio.run(_collect(around_stream_one_response(_ctx("off"), factory, None, _obj({PARAM: True}), None, None)))
    assert out[-1]["meta_info"][KEY]["deposit_source"] == "controller"


def test_a_paced_stream_that_asked_reports_the_pacers_deposit():
    """Pacing on, a 1e6 ms SLO: every token after the first waits, so the three held back when
    generation ended are the deposit (``pacer``); the same stream without the opt-in keeps the
    controller's figure (negative control)."""
    custom = {PARAM: True, "kvplane_slo_tbt_ms": 1e6}
    out = asyncio.run(_collect(around_stream_one_response(_ctx("on"), _source_factory(4, True, []), None,
                                                          _obj(custom), None, None)))
    assert [c["meta_info"]["completion_tokens"] for c in out] == [1, 2, 3, 4]
    assert (out[-1]["meta_info"][KEY]["deposit_tokens"], out[-1]["meta_info"][KEY]["deposit_source"]) == (3, "pacer")
    plain = asyncio.run(_collect(around_stream_one_response(_ctx("on"), _source_factory(4, True, []), None,
                                                            _obj({"kvplane_slo_tbt_ms": 1e6}), None, None)))
    assert plain[-1]["meta_info"][KEY]["deposit_source"] == "controller"


def test_the_request_entry_refuses_a_bad_opt_in_for_every_request_kind():
    """``request_slo.sampling_params_error`` (AROUND ``generate_request`` and ``/generate``'s
    contract check) names a non-boolean opt-in, in one request or a batch; booleans and null pass."""
    from sglang_ext.request_slo import body_error, sampling_params_error

    for ok in (True, False, None):
        assert sampling_params_error({"custom_params": {PARAM: ok}}) is None
    message = f'custom_params.{PARAM}="yes" is invalid (allowed: true or false)'
    assert sampling_params_error({"custom_params": {PARAM: "yes"}}) == message
    assert sampling_params_error([{}, {"custom_params": {PARAM: "yes"}}]) == message
    assert body_error({"text": "x", "sampling_params": {"custom_params": {PARAM: 1}}}) == (
        f"custom_params.{PARAM}=1 is invalid (allowed: true or false)")
