"""Decode steps whose batch changed (a request finished, a prefilled one joined) continue what each
request held (:class:`DecodeContinuity`) instead of reading every request's slots -- and a row
SGLang rewrote (its prefix dedupe frees the request's own copy) is read again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.decode_continuity import DecodeContinuity
from sglang_ext.dataplane.ended_requests import EndedRequests
from tests.dataplane.core_driver import KV_MISMATCH, PAGES, CoreDriver, make_core

LAYOUTS = {
    "identity": dict(budget=None, paged_reads=False),
    "identity-paged-reads": dict(budget=None, paged_reads=True),
    "paged": dict(budget=3 * PAGES - 9, paged_reads=True),
    "paged-offload": dict(budget=PAGES + 6, paged_reads=True),
}


def _driver(layout: str, seed: int = 0) -> CoreDriver:
    spec = LAYOUTS[layout]
    return CoreDriver(make_core(spec["budget"]), seed=seed, fast_decode=True, paged_reads=spec["paged_reads"])


def _decode(d: CoreDriver, rids: list[str]) -> bool:
    """One decode step of ``rids`` (the driver checks every layer's reads); True when the core's
    decode path took it (no slot read)."""
    before = d.fast_steps
    assert d.step([(rid, 1) for rid in rids])
    return d.fast_steps == before + 1


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_finishes_and_joins_continue_without_reading_slots(layout):
    d = _driver(layout)
    for rid, n in (("a", 5), ("b", 3), ("c", 4)):
        d.add(rid)
        d.step([(rid, n)])
    if layout == "paged-offload":  # a layer of b's on host: its steps stage
        d.want("b", [True, False, True])
    core = d.core
    assert _decode(d, ["a", "b", "c"])  # the first decode after their prefills: a turnover already
    assert _decode(d, ["a", "b", "c"])
    d.finish("b")
    assert _decode(d, ["a", "c"]) and _decode(d, ["a", "c"])  # b left
    d.add("d")
    d.step([("d", 3)])
    assert _decode(d, ["a", "c", "d"])  # d joined after its prefill
    assert _decode(d, ["c", "d"])  # a left the batch without finishing (paused elsewhere), then
    assert _decode(d, ["a", "c", "d"])  # came back: one token more than when it left
    assert core.continuity.turnovers >= 5
    d.check_at_rest()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_request_not_continued_is_refused_and_nothing_changes(layout):
    d = _driver(layout)
    for rid, n in (("a", 5), ("b", 3)):
        d.add(rid)
        d.step([(rid, n)])
    assert _decode(d, ["a", "b"])
    core, ps = d.core, d.ps
    a, b = d.slots["a"], d.slots["b"]
    nxt_a = a[-1] + 1 if (a[-1] + 1) % ps else None
    # a request the core never saw; one a token ahead; a slot off its request's last page
    assert not core.prepare_decode_step(["a", "b", "c"], [len(a) + 1, len(b) + 1, 3], torch.tensor([0, 0, 0]))
    assert not core.prepare_decode_step(["a", "b"], [len(a) + 2, len(b) + 1], torch.tensor([0, 0]))
    if nxt_a is not None:
        assert not core.prepare_decode_step(["a"], [len(a) + 1], torch.tensor([nxt_a + ps]))
    assert _decode(d, ["a", "b"])  # nothing was done by the refusals: the reads are exact
    d.check_at_rest()


def _rewritten(layout: str) -> CoreDriver:
    """a and b prefilled and decoded once, then b's row rewritten to a's first page (b's copy freed)."""
    d = _driver(layout)
    for rid, n in (("a", 5), ("b", 5)):
        d.add(rid)
        d.step([(rid, n)])
    assert _decode(d, ["a", "b"])
    assert d.rewrite_prefix("b", "a")
    return d


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_rewritten_row_is_read_again(layout):
    """SGLang's prefix dedupe rewrites b's row to a's first page and frees b's copy: the core
    forgets what b held (the free cut it), so b's next step reads its row again and reads a's page."""
    d = _rewritten(layout)
    assert not _decode(d, ["a", "b"])  # the general path: b's rewritten row (reads checked)
    assert _decode(d, ["a", "b"])
    d.check_at_rest()


@pytest.mark.parametrize("layout", ["identity-paged-reads", "paged", "paged-offload"])
def test_the_reads_fail_when_a_rewritten_row_is_not_forgotten(monkeypatch, layout):
    """Negative control: with the frees' cut requests not reported, b's decode continues its old
    page list and the driver's per-layer read check fails (b reads its freed copy). The layouts
    read through page tables; the in-place identity layout reads by slot and has no list to go stale."""
    monkeypatch.setattr(EndedRequests, "take_rewritten", lambda self: set())
    d = _rewritten(layout)
    with pytest.raises(AssertionError, match=KV_MISMATCH):
        _decode(d, ["a", "b"])


class _Residency:
    """What :class:`DecodeContinuity` reads of a residency: its ended records."""

    def __init__(self) -> None:
        self.ended = type("Ended", (), {"pending": False, "take_rewritten": lambda self: set()})()

    def settle(self) -> None:
        raise AssertionError("nothing pending: no settle")


def test_continued_checks_each_request():
    c = DecodeContinuity(_Residency(), page_size=4)  # type: ignore[arg-type]
    c.record(["a", "b", None], [6, 4, 2], [np.array([3, 7]), np.array([9]), np.array([11])])
    # a: token 7 at slot 7*4+2 = 30 (page 7, offset 2); b: token 5 opens page 12 (slot 48)
    got = c.continued(["a", "b"], [7, 5], [30, 48], lists=True)
    assert got is not None
    opens, lists = got
    assert opens == [1] and [x.tolist() for x in lists] == [[3, 7], [9, 12]]
    assert c.continued(["b", "a"], [5, 7], [48, 30], lists=False) == ([0], None)
    assert c.continued(["a"], [8], [31], lists=True) is None  # one token too many
    assert c.continued(["a"], [7], [34], lists=True) is None  # a slot in another page
    assert c.continued(["a"], [7], [29], lists=True) is None  # a slot at another offset
    assert c.continued(["a", "a"], [7, 7], [30, 30], lists=True) is None  # a request twice
    assert c.continued(["a", "x"], [7, 1], [30, 0], lists=True) is None  # unknown request
    assert c.advanced(["a", "b"], [7, 5], [30, 48], lists) is True  # a new batch
    assert c.advanced(["a", "b"], [8, 6], [31, 49], lists) is False and c.turnovers == 1
    c.forget("a")
    assert c.continued(["a"], [9], [32], lists=True) is None
    c.advanced(["b"], [7], [50], None)  # a step that kept no list: b's needs a build again
    assert c.continued(["b"], [8], [51], lists=True) is None
    assert c.continued(["b"], [8], [51], lists=False) == ([], None)
