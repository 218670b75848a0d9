"""SGLang's warm-up forward through the layered pool: rows of no request shorter than the tokens they write.

On CUDA (sm90+, FP8 / FP4 GEMMs or FlashInfer MoE) SGLang runs FlashInfer's autotune as a dummy
decode forward before any request (``BaseRunner._dummy_run``): every row is anonymous, at row 0
of ``req_to_token``, writes SGLang's padding slot, and its ``seq_lens`` may be 0 (a decode graph
runner's buffers, when it warms up first). The core
refuses a row shorter than its new tokens, by name (before: an ``IndexError`` in the paged
layout, silently nothing in the identity one); the adapter gives such anonymous rows exactly the
slots they write (``_warmup_rows``), and the step then runs in either layout, leaving a real
request's KV as it was. The served start-ups: ``test_triton_server.py`` (rows of 0 tokens) and
``test_layered_offload_server.py`` (the rows as SGLang's eager runner allocates them).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from sglang_ext.dataplane.layered_kv_core import LayeredKVCore  # noqa: E402
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig  # noqa: E402
from sglang_ext.layered_attention import _warmup_rows  # noqa: E402

LAYERS, PS, ROWS = 4, 4, 5


def _core(budget: int | None, paged_reads: bool) -> LayeredKVCore:
    core = LayeredKVCore(SlotStoreConfig(layers=LAYERS, page_size=PS, kv_heads=1, head_dim=8, logical_pages=20,
                                         device_pages=budget or LAYERS * 20, dtype=torch.float32, device="cpu"))
    if paged_reads:
        core.paged_reads, core.token_tables = True, False
    return core


def _dummy(lens: int) -> tuple[list, list[torch.Tensor], list[int], torch.Tensor]:
    """SGLang's dummy decode batch: anonymous rows at req_to_token row 0 (zeros), padding slot 0."""
    return [None] * ROWS, [torch.zeros(lens, dtype=torch.int64) for _ in range(ROWS)], [lens] * ROWS, \
        torch.zeros(ROWS, dtype=torch.int64)


def _step(core: LayeredKVCore, rids: list, slots: list[torch.Tensor], loc: torch.Tensor,
          value: float = 1.0, counts: list[int] | None = None) -> None:
    core.prepare_step(list(zip(rids, slots, strict=True)), loc, counts)
    k = torch.full((loc.numel(), 1, 8), value)
    for layer in range(LAYERS):
        core.enter_layer(layer)
        core.write(layer, loc, k + layer, -(k + layer))
        core.exit_layer(layer)


LAYOUTS = [pytest.param(None, False, id="identity"), pytest.param(40, False, id="paged"),
           pytest.param(40, True, id="paged-reads")]


@pytest.mark.parametrize(("budget", "paged_reads"), LAYOUTS)
def test_the_core_refuses_a_row_shorter_than_its_new_tokens_by_name(budget, paged_reads):
    rids, slots, _, loc = _dummy(0)
    with pytest.raises(ValueError, match=r"request None \(row 0\) writes 1 new token\(s\) but holds 0"):
        _step(_core(budget, paged_reads), rids, slots, loc)
    rids, slots, _, loc = _dummy(1)  # control: rows holding the token they write pass
    _step(_core(budget, paged_reads), rids, slots, loc)


@pytest.mark.parametrize(("budget", "paged_reads"), LAYOUTS)
def test_warm_up_rows_hold_the_slots_they_write_and_the_step_runs(budget, paged_reads):
    rids, slots, lens, loc = _dummy(0)
    loc = torch.arange(ROWS, dtype=torch.int64) % 2  # two padding-page slots, as a row may write either
    got, got_lens = _warmup_rows(rids, slots, lens, [1] * ROWS, loc)
    assert got_lens == [1] * ROWS
    assert [t.tolist() for t in got] == [[s] for s in loc.tolist()]
    assert all(t._base is None and t.dtype == torch.int64 for t in got)  # fresh: the residency keeps them
    core = _core(budget, paged_reads)
    a = torch.arange(4, 8, dtype=torch.int64)  # a real request's page 1, prefilled before the warm-up
    _step(core, ["a"], [a], a, value=5.0, counts=[4])
    _step(core, rids, got, loc)
    _step(core, ["a"], [torch.arange(4, 9, dtype=torch.int64)], torch.tensor([8]), value=7.0)  # its decode
    assert not core.residency.has_anonymous  # the warm-up's rows are gone
    for layer in range(LAYERS):  # and "a" reads back what it wrote, around the warm-up
        k, v = core.read_kv(layer, torch.arange(4, 9))
        want = torch.tensor([5.0] * 4 + [7.0]) + layer
        assert torch.equal(k[:, 0, 0], want) and torch.equal(v[:, 0, 0], -want)


def test_rows_of_requests_and_rows_that_hold_their_tokens_are_left_alone():
    slots = [torch.zeros(0, dtype=torch.int64), torch.tensor([4, 5]), torch.zeros(0, dtype=torch.int64)]
    rids, lens = ["a", None, None], [0, 2, 0]
    got, got_lens = _warmup_rows(rids, slots, lens, [1, 1, 1], torch.tensor([9, 6, 8]))
    assert got[0] is slots[0] and got[1] is slots[1] and got_lens[:2] == [0, 2]  # the core refuses "a" itself
    assert got[2].tolist() == [8] and got_lens[2] == 1
    # several new tokens a row (an extend): the row's own run of out_cache_loc
    got, got_lens = _warmup_rows([None, None], [slots[0], slots[0]], [0, 0], [2, 3], torch.arange(10, 15))
    assert [t.tolist() for t in got] == [[10, 11], [12, 13, 14]] and got_lens == [2, 3]
    assert _warmup_rows([None], [slots[0]], [0], None, torch.tensor([1])) == ([slots[0]], [0])  # counts unknown


def test_a_refused_step_leaves_the_core_as_it_was():
    """The core checks the new tokens before its boundary observes anything: after a refusal
    (a row shorter than its tokens; a count list of the wrong length) no anonymous row is left
    and the next valid step runs; control: the accepted step does observe its anonymous rows."""
    core = _core(40, True)
    rids, slots, _, loc = _dummy(0)
    with pytest.raises(ValueError, match="writes 1 new token"):
        core.prepare_step(list(zip(rids, slots, strict=True)), loc)
    assert not core.residency.has_anonymous
    rids, slots, _, loc = _dummy(1)
    with pytest.raises(ValueError, match="2 new_counts for 5 requests"):
        core.prepare_step(list(zip(rids, slots, strict=True)), loc, [1, 1])
    assert not core.residency.has_anonymous
    core.prepare_step(list(zip(rids, slots, strict=True)), loc)
    assert core.residency.has_anonymous
