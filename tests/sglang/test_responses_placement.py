"""``/v1/responses`` pieces of the placement info without a server (the server-level check is
``tests/sglang/test_request_placement_server.py``): which ``custom_params`` keys kvplane takes from
a Responses body and how it refuses bad ones, the ``sglext.kvplane`` it adds to SGLang's real
``ResponsesResponse`` and to a stream's terminal event, and the engine ``sampling_params`` it
extends without touching a shared default.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

from sglang_ext.placement_param import KEY, PARAM  # noqa: E402
from sglang_ext.placement_response import SINK_PARAM  # noqa: E402
from sglang_ext.request_slo import SLO_PARAM  # noqa: E402
from sglang_ext.responses_placement import (  # noqa: E402
    STATE_ATTR,
    around_generate,
    body_custom_params,
    placement_event,
    with_placement,
)

RECORD = {"layers": 4, "layers_offloaded": 1}


def test_only_kvplane_keys_are_taken_and_bad_ones_refused_by_name() -> None:
    """Other keys stay ignored as SGLang ignores them here; absent, ``null`` or kvplane-free
    ``custom_params`` mean nothing to do; a bad value or a non-object is refused naming the field."""
    assert body_custom_params({"input": "x"}) == (None, None)
    assert body_custom_params({"custom_params": None}) == (None, None)
    assert body_custom_params({"custom_params": {"other": 1}}) == (None, None)
    assert body_custom_params({"custom_params": {PARAM: True, SLO_PARAM: 50, "other": 1}}) == \
        ({PARAM: True, SLO_PARAM: 50}, None)
    assert body_custom_params({"custom_params": {PARAM: "yes"}}) == \
        (None, f'custom_params.{PARAM}="yes" is invalid (allowed: true or false)')
    _, message = body_custom_params({"custom_params": {SLO_PARAM: 0}})
    assert message is not None and message.startswith(f"custom_params.{SLO_PARAM}=0 is out of range")
    assert body_custom_params({"custom_params": [1]}) == (None, "custom_params=[1] is invalid (allowed: an object)")


def _response() -> Any:
    from sglang.srt.entrypoints.openai.protocol import ResponsesResponse

    return ResponsesResponse(id="resp_1", model="m", status="completed", output=[])


def test_the_response_gets_sglext_kvplane_and_keeps_sglangs_fields() -> None:
    """SGLang's response serialised with ``sglext.kvplane`` added and every other field as before;
    no record (or not a Responses object, e.g. an error response): returned unchanged."""
    plain = _response()
    extended = with_placement(plain, [RECORD])
    dumped, before = json.loads(extended.model_dump_json()), json.loads(plain.model_dump_json())
    assert dumped.pop("sglext") == {KEY: RECORD} and dumped == before
    assert with_placement(plain, []) is plain and "sglext" not in before
    error = SimpleNamespace(status_code=400)
    assert with_placement(error, [RECORD]) is error


def test_only_the_terminal_event_of_a_stream_is_extended() -> None:
    """``response.completed`` / ``.incomplete`` get ``response.sglext.kvplane`` (SGLang's SSE framing
    kept); a delta event, or any event without a record, is passed through byte for byte."""
    final: dict[str, Any] = {"type": "response.incomplete", "response": {"id": "resp_1", "status": "incomplete"}}
    event = f"event: response.incomplete\ndata: {json.dumps(final)}\n\n"
    out = placement_event(event, [RECORD])
    head, _, data = out.partition("data: ")
    assert head == "event: response.incomplete\n" and out.endswith("\n\n")
    assert json.loads(data) == {**final, "response": {**final["response"], "sglext": {KEY: RECORD}}}
    delta = 'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n'
    assert placement_event(delta, [RECORD]) == delta
    assert placement_event(event, []) == event


def test_the_engine_sampling_params_get_the_keys_in_a_new_dict() -> None:
    """The keys checked at entry (on ``raw_request.state``) join ``sampling_params["custom_params"]``
    -- the sink included, by identity -- in a new dict: a ``--preferred-sampling-params`` default
    dict shared by every request is not mutated. A request without any keeps its params."""
    shared_default = {"from_server": 1}
    sink: dict = {}
    sampling = {"max_new_tokens": 4, "custom_params": shared_default}
    adapted = SimpleNamespace(sampling_params=sampling)
    raw = SimpleNamespace(state=SimpleNamespace(**{STATE_ATTR: {PARAM: True, SINK_PARAM: sink}}))
    seen: list[tuple] = []

    def original(serving: Any, *args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return "generator"

    assert around_generate(original, "serving", "rid", "prompt", adapted, sampling, "ctx", raw_request=raw) == "generator"
    assert sampling["custom_params"] == {"from_server": 1, PARAM: True, SINK_PARAM: sink}
    assert sampling["custom_params"][SINK_PARAM] is sink and shared_default == {"from_server": 1}
    untouched = {"max_new_tokens": 4}
    around_generate(original, "serving", "rid", "prompt", SimpleNamespace(sampling_params=untouched), untouched,
                    "ctx", raw_request=SimpleNamespace(state=SimpleNamespace()))
    assert untouched == {"max_new_tokens": 4} and len(seen) == 2
