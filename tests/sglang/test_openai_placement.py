"""``sglext.kvplane`` on SGLang's own OpenAI response models (non-streaming and streaming)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.sglang

RECORD = {"layers": 4, "layers_offloaded": 1, "host_fraction": 0.25}


@pytest.fixture(scope="module")
def mod() -> Any:
    pytest.importorskip("sglang")
    from sglang_ext import openai_placement

    return openai_placement


def _completion(**kw: Any) -> Any:
    from sglang_ext.compat import CompletionResponse, resolve

    usage = resolve("sglang.srt.entrypoints.openai.protocol.UsageInfo")(prompt_tokens=3, total_tokens=5)
    return CompletionResponse(id="cmpl-1", model="m", choices=[], usage=usage, **kw)


def _chat() -> Any:
    from sglang_ext.compat import ChatCompletionResponse, resolve

    usage = resolve("sglang.srt.entrypoints.openai.protocol.UsageInfo")(prompt_tokens=3, total_tokens=5)
    return ChatCompletionResponse(id="chat-1", model="m", choices=[], usage=usage)


def test_a_completion_gets_sglext_kvplane_and_keeps_everything_else(mod):
    """The response is still SGLang's CompletionResponse (a subclass), serialises every field it
    had, keeps SGLang's own sglext fields and adds ``sglext.kvplane``."""
    from sglang_ext.compat import CompletionResponse, SglExt

    plain = _completion(sglext=SglExt(cached_tokens_details={"device": 2, "host": 0}))
    ret = [{"meta_info": {"id": "cmpl-1", "kvplane": RECORD}}]
    out = mod.after_build_response(plain, None, None, ret, 0)
    assert isinstance(out, CompletionResponse)
    got, want = json.loads(out.model_dump_json(by_alias=True)), json.loads(plain.model_dump_json(by_alias=True))
    assert got.pop("sglext") == {**want.pop("sglext"), "kvplane": RECORD}
    assert got == want


def test_no_record_no_change(mod):
    """Negative control: results without ``meta_info["kvplane"]`` leave SGLang's response as it is
    (the hook returns None), and an error response is never touched."""
    plain = _completion()
    assert mod.after_build_response(plain, None, None, [{"meta_info": {"id": "x"}}], 0) is None
    assert "sglext" not in json.loads(plain.model_dump_json())
    error = SimpleNamespace(status_code=400)
    assert mod.with_placement(error, [RECORD]) is error


def test_several_choices_give_a_list_in_choice_order_and_chat_works_alike(mod):
    """n > 1: one record per choice, in order (None where one is missing); the chat model too."""
    ret = [{"meta_info": {"kvplane": {"i": 0}}}, {"meta_info": {}}, {"meta_info": {"kvplane": {"i": 2}}}]
    out = mod.after_build_response(_chat(), None, None, ret, 0)
    assert json.loads(out.model_dump_json())["sglext"] == {"kvplane": [{"i": 0}, None, {"i": 2}]}
    assert json.loads(out.model_dump_json())["object"] == "chat.completion"


CHUNK = 'data: {"id":"r1","choices":[{"index":0,"text":"a"}]}\n\n'
DONE = "data: [DONE]\n\n"


async def _collect(source: AsyncIterator[str]) -> list[str]:
    return [line async for line in source]


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_that_asked_ends_with_one_sglext_chunk_before_done(mod, chat):
    """The handler's lines pass unchanged; the sink the main process filled becomes one
    ``{"choices": [], "sglext": {"kvplane": ...}}`` chunk, right before ``[DONE]``."""
    from sglang_ext.placement_response import SINK_PARAM
    from sglang_ext.request_placement import PARAM

    custom: dict = {PARAM: True}
    adapted = SimpleNamespace(rid="r1", sampling_params={"custom_params": custom})
    request = SimpleNamespace(model="m", custom_params=custom)

    async def handler(serving: Any, adapted_request: Any, req: Any, raw: Any) -> AsyncIterator[str]:
        yield CHUNK
        custom[SINK_PARAM]["r1"] = RECORD  # what the main process does when the record arrives
        yield DONE

    out = asyncio.run(_collect(mod.around_stream(chat)(handler, None, adapted, request, None)))
    assert out[0] == CHUNK and out[-1] == DONE and len(out) == 3
    extension = json.loads(out[1].removeprefix("data: "))
    assert extension["choices"] == [] and extension["sglext"] == {"kvplane": RECORD}
    assert extension["id"] == "r1" and extension["model"] == "m"
    assert extension["object"] == ("chat.completion.chunk" if chat else "text_completion")


def test_a_stream_that_did_not_ask_is_the_handlers_own(mod):
    """Negative control: no opt-in, no sink, the very generator SGLang's handler returned."""
    adapted = SimpleNamespace(rid="r1", sampling_params={"custom_params": {"kvplane_slo_tbt_ms": 100}})
    marker = object()
    assert mod.around_stream(False)(lambda *a: marker, None, adapted, SimpleNamespace(model="m"), None) is marker
    assert adapted.sampling_params["custom_params"] == {"kvplane_slo_tbt_ms": 100}
