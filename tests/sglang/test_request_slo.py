"""custom_params.kvplane_slo_tbt_ms is checked where a request enters (sglang_ext/request_slo.py).

No server here (``test_request_slo_server.py`` and ``test_pacing_e2e.py`` send every request kind
to real ones): the value rule, the two hooks, and the plugin's dispatch with the flag and pacing
on or off.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sglang_ext.args import LayeredKVArgs
from sglang_ext.context import PluginContext
from sglang_ext.plugin import KvplanePlugin
from sglang_ext.request_slo import (
    KVPLANE_PARAMS,
    SLO_PARAM,
    after_generate_contract_error,
    around_generate_request,
    body_error,
    request_slo_tbt_ms,
    sampling_params_error,
)

BAD = (-5, 0, "NaN", "fast", True, [150], {"ms": 150}, math.nan, math.inf, -math.inf, 1e7 + 1, 10**400, -(10**400))
"""Issue 17's values, plus non-finite floats, just above the bound, and ints past a float's range
(``math.isfinite`` raised OverflowError on them: HTTP 500, plugin review of session 77)."""
GOOD = (150, 150.5, 1e-3, 1e7)


def params(value: Any) -> dict:
    return {"max_new_tokens": 4, "custom_params": {SLO_PARAM: value}}


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_bad_value_is_refused_naming_field_value_and_range(value: Any) -> None:
    """Each bad value gives one line naming custom_params.kvplane_slo_tbt_ms, the value and (0, 1e+07] ms."""
    message = sampling_params_error(params(value))
    assert message is not None and "\n" not in message
    shown = json.dumps(value)  # the client's spelling (true, "fast"), cut past 200 characters
    assert message.startswith(f"custom_params.{SLO_PARAM}={shown} is " if len(shown) <= 200
                              else f"custom_params.{SLO_PARAM}={shown[:200]}... ({len(shown)} characters) is ")
    assert message.endswith("(allowed (0, 1e+07] ms)")


@pytest.mark.parametrize("value", GOOD)
def test_valid_value_is_accepted(value: Any) -> None:
    """Negative control: numbers in (0, 1e7] pass and are the request's SLO."""
    assert sampling_params_error(params(value)) is None
    assert request_slo_tbt_ms(params(value), 200.0) == float(value)


@pytest.mark.parametrize(
    "sampling_params",
    [None, {}, {"custom_params": None}, {"custom_params": {}}, {"custom_params": {SLO_PARAM: None}},
     [{}, {"custom_params": {SLO_PARAM: 40}}]],
    ids=["none", "empty", "custom-null", "custom-empty", "slo-null", "batch-ok"],
)
def test_absent_override_is_accepted(sampling_params: Any) -> None:
    """No override is not kvplane's to refuse."""
    assert sampling_params_error(sampling_params) is None


@pytest.mark.parametrize("custom", ["kvplane_slo_tbt_ms=-1", [{SLO_PARAM: -1}], 5, True], ids=repr)
def test_custom_params_that_is_not_an_object_is_refused(custom: Any) -> None:
    """SGLang types ``custom_params`` Optional[Dict] but serves anything on /generate, so an
    override written as a string or a list was dropped silently; now refused as on
    /v1/responses, alone or in a batch. Control: the same override as an object is judged on its
    value (refused for -1, accepted for 40)."""
    message = f"custom_params={json.dumps(custom)} is invalid (allowed: an object)"
    assert sampling_params_error({"custom_params": custom}) == message
    assert sampling_params_error([{}, {"custom_params": custom}]) == message
    assert body_error({"text": "x", "sampling_params": {"custom_params": custom}}) == message
    assert sampling_params_error({"custom_params": {SLO_PARAM: -1}}) != message
    assert sampling_params_error({"custom_params": {SLO_PARAM: 40}}) is None


@pytest.mark.parametrize("key", ["kvplane_slo_tbt", "kvplane_slo_tbt_ms ", "kvplane_return_placment",
                                 "kvplane_recompute_ration", "kvplane_"])
def test_a_misspelt_kvplane_key_is_refused_naming_it(key: str) -> None:
    """Scenario: a ``kvplane_*`` key that is not kvplane's (a typo) was ignored: the request was
    served at the default SLO, or without the placement info it asked for (plugin review,
    session 77). Now refused naming the key and the allowed ones, alone, in a batch and in a
    /generate body. Controls: every kvplane key with a valid value, and keys of others, pass."""
    message = f"custom_params.{key} is not a kvplane parameter (allowed: {', '.join(KVPLANE_PARAMS)})"
    assert sampling_params_error({"custom_params": {key: 5}}) == message
    assert sampling_params_error([{}, {"custom_params": {SLO_PARAM: 40, key: True}}]) == message
    assert body_error({"text": "x", "sampling_params": {"custom_params": {key: 1}}}) == message
    valid = {"kvplane_slo_tbt_ms": 40, "kvplane_return_placement": True, "kvplane_recompute_ratio": 0.5,
             "kvplane_recompute_layers": 1, "other_plugin_key": 3, "KVPLANE_slo": 1, 7: "x"}
    assert set(KVPLANE_PARAMS) < set(valid)
    assert sampling_params_error({"custom_params": valid}) is None


def test_batch_with_one_bad_item_is_refused() -> None:
    """A /generate batch (a list of sampling params) is refused when any item is bad."""
    assert sampling_params_error([params(100), params("fast")]) is not None
    assert sampling_params_error([params(100), params(120)]) is None


def test_generate_body_check() -> None:
    """The raw /generate body: its sampling_params are checked; other bodies are SGLang's."""
    assert body_error({"text": "hi", "sampling_params": params(-5)}) is not None
    assert body_error({"text": "hi", "sampling_params": params(150)}) is None
    assert body_error({"text": "hi"}) is None and body_error([1, 2]) is None


class _Obj:
    def __init__(self, sampling_params: Any) -> None:
        self.sampling_params = sampling_params
        self.stream = False
        self.rid = "r1"


class _Original:
    """Stands in for TokenizerManager.generate_request (an async generator function); counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, tm: Any, obj: Any, request: Any = None) -> AsyncIterator[str]:
        self.calls += 1

        async def gen() -> AsyncIterator[str]:
            yield "served"

        return gen()


def first_item(gen: AsyncIterator[Any]) -> Any:
    async def main() -> Any:
        return await gen.__anext__()

    return asyncio.run(main())


def test_generate_request_hook_refuses_before_sglang_sees_the_request() -> None:
    """A bad override: the generator's first item raises the ValueError and SGLang's
    generate_request is never called; a valid one gets SGLang's generator."""
    original = _Original()
    gen = around_generate_request(original, object(), _Obj(params("fast")), None)
    with pytest.raises(ValueError, match=r'custom_params\.kvplane_slo_tbt_ms="fast" is not a number'):
        first_item(gen)
    assert original.calls == 0
    assert first_item(around_generate_request(original, object(), obj=_Obj(params(150)))) == "served"
    assert original.calls == 1


def test_contract_hook_keeps_sglangs_violation_first() -> None:
    """SGLang's own contract violation wins; otherwise kvplane's refusal, or None."""
    assert after_generate_contract_error("bad text field", {"sampling_params": params(-5)}) == "bad text field"
    assert "kvplane_slo_tbt_ms=-5" in (after_generate_contract_error(None, {"sampling_params": params(-5)}) or "")
    assert after_generate_contract_error(None, {"sampling_params": params(5)}) is None


@pytest.mark.parametrize("pacing", ["on", "off"])
def test_plugin_checks_with_the_flag_on_whatever_the_pacing(pacing: str) -> None:
    """With --enable-layered-kv, both hooks refuse a bad value with pacing on and off."""
    plugin = KvplanePlugin(PluginContext())
    plugin.ctx.layered = LayeredKVArgs(enable_layered_kv=True, kv_pacing=pacing)
    original = _Original()
    with pytest.raises(ValueError, match="kvplane_slo_tbt_ms=0 is out of range"):
        first_item(plugin.around_generate_request(original, object(), _Obj(params(0)), None))
    assert original.calls == 0
    assert plugin.after_generate_contract_error(None, {"sampling_params": params([1])}) is not None


@pytest.mark.parametrize("layered", [None, LayeredKVArgs()], ids=["no-options", "flag-off"])
def test_plugin_passes_everything_through_with_the_flag_off(layered: LayeredKVArgs | None) -> None:
    """Negative control: without --enable-layered-kv the value is not kvplane's business."""
    plugin = KvplanePlugin(PluginContext())
    plugin.ctx.layered = layered
    original = _Original()
    assert first_item(plugin.around_generate_request(original, object(), _Obj(params(-5)), None)) == "served"
    assert plugin.after_generate_contract_error(None, {"sampling_params": params(-5)}) is None


def test_a_rid_past_the_control_planes_id_limit_is_refused() -> None:
    """One, or one of a batch's list; 240 characters (256 less room for SGLang's ``_N`` suffix)
    and SGLang's own (None) pass (the control)."""
    from sglang_ext.request_slo import MAX_RID_CHARS, rid_error

    assert MAX_RID_CHARS == 240
    assert rid_error("r" * 240) is None and rid_error(None) is None and rid_error(["a", "b" * 240]) is None
    assert rid_error("r" * 241) == (
        "rid has 241 characters (allowed at most 240 with --enable-layered-kv: the control plane's request id "
        "limit, 256, less room for the _N suffix SGLang adds to a batch's or a parallel sample's ids)")
    assert rid_error(["a", "b" * 300]) is not None
    assert body_error({"rid": "x" * 241}) is not None and body_error({"rid": "x"}) is None
    original = _Original()
    long_rid = _Obj(params(150))
    long_rid.rid = "x" * 241
    with pytest.raises(ValueError, match="rid has 241 characters"):
        first_item(around_generate_request(original, object(), long_rid, None))
    assert original.calls == 0


@pytest.mark.parametrize("beam", [2, 8, 2.0])
def test_a_beam_search_is_refused_naming_the_field(beam: Any) -> None:
    """A beam search would kill the scheduler at its first decode step (its member rows join the
    step's slots; the layered pool tracks requests): refused where it enters, in a batch too."""
    message = sampling_params_error({"max_new_tokens": 4, "beam_width": beam})
    assert message is not None and f"sampling_params.beam_width={json.dumps(beam)}" in message
    assert "--enable-layered-kv" in message
    assert sampling_params_error([{}, {"beam_width": beam}]) == message


@pytest.mark.parametrize("beam", [None, 1, 0, -1, True, "2"])
def test_no_beam_or_one_beam_is_left_to_sglang(beam: Any) -> None:
    """Control: absent, 1, and what SGLang judges itself (below 1, not a number) pass here."""
    assert sampling_params_error({"max_new_tokens": 4, "beam_width": beam}) is None
