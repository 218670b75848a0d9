"""ResidencyHooks: ordered fan-out, filtering, isolation of failing subscribers, JSONL round trip."""

from __future__ import annotations

import pytest

from sglang_ext.hooks import (
    JsonlEventWriter,
    ResidencyEventKind,
    ResidencyHooks,
    read_jsonl_events,
)
from sglang_ext.testing.residency import check_block_lifecycle

K = ResidencyEventKind


def test_events_delivered_in_order_with_gap_free_seq():
    """Subscribers see every event in emission order; seq counts from 0 without gaps."""
    hooks = ResidencyHooks()
    seen = []
    hooks.subscribe(seen.append)
    hooks.emit(K.ALLOCATED, [1, 2], rid="a")
    hooks.emit(K.OFFLOADED, [1], rid="a", layers=[3, 2])
    hooks.emit(K.FREED, [1, 2])
    assert [e.seq for e in seen] == [0, 1, 2]
    assert [e.kind for e in seen] == [K.ALLOCATED, K.OFFLOADED, K.FREED]
    assert seen[1].layers == (3, 2) and seen[0].layers is None


def test_kind_filter_and_close():
    """A filtered subscription only sees its kinds; after close() it sees nothing."""
    hooks = ResidencyHooks()
    frees = []
    sub = hooks.subscribe(frees.append, kinds=["freed"])
    hooks.emit(K.ALLOCATED, [1], rid="a")
    hooks.emit(K.FREED, [1])
    sub.close()
    hooks.emit(K.FREED, [2])
    assert [e.blocks for e in frees] == [(1,)]
    assert not hooks.has_subscribers


def test_unknown_kind_is_rejected_by_name():
    """Subscribing to an unknown kind names the allowed kinds."""
    with pytest.raises(ValueError, match="allowed: \\['allocated'"):
        ResidencyHooks().subscribe(print, kinds=["teleported"])


def test_failing_subscriber_does_not_break_emit():
    """A raising subscriber is counted and the others still receive the event."""
    hooks = ResidencyHooks()
    got = []

    def boom(_event):
        raise RuntimeError("subscriber bug")

    hooks.subscribe(boom)
    hooks.subscribe(got.append)
    hooks.emit(K.ALLOCATED, [7], rid="r")
    assert hooks.subscriber_errors == 1 and len(got) == 1


def test_jsonl_round_trip(tmp_path):
    """JsonlEventWriter output reads back as the same events."""
    hooks = ResidencyHooks()
    writer = JsonlEventWriter(tmp_path / "ev.jsonl")
    seen = []
    hooks.subscribe(writer)
    hooks.subscribe(seen.append)
    hooks.emit(K.ALLOCATED, [1, 2], rid="a")
    hooks.emit(K.LOADED, [2], rid="a", layers=[0])
    writer.close()
    assert read_jsonl_events(tmp_path / "ev.jsonl") == seen


def test_lifecycle_checker_flags_double_free_and_double_alloc():
    """check_block_lifecycle reports a double free and a re-allocation of a live block."""
    hooks = ResidencyHooks()
    seen = []
    hooks.subscribe(seen.append)
    hooks.emit(K.ALLOCATED, [1, 2], rid="a")
    hooks.emit(K.EXTENDED, [2], rid="a")
    hooks.emit(K.FREED, [1, 2])
    hooks.emit(K.FREED, [1])
    report = check_block_lifecycle(seen)
    assert any("block 2 allocated twice" in e for e in report.errors)
    assert any("block 1 freed but not live" in e for e in report.errors)
    assert check_block_lifecycle(seen[:1] + seen[2:3]).errors == ("seq 2 where 1 was expected",)


def test_lifecycle_checker_accepts_reuse_after_free():
    """A block freed and allocated again is fine; live blocks are those not yet freed."""
    hooks = ResidencyHooks()
    seen = []
    hooks.subscribe(seen.append)
    hooks.emit(K.ALLOCATED, [1, 2], rid="a")
    hooks.emit(K.FREED, [1])
    hooks.emit(K.ALLOCATED, [1], rid="b")
    report = check_block_lifecycle(seen)
    assert report.errors == () and report.live_blocks == frozenset({1, 2})
    assert (report.allocations, report.frees) == (3, 1)
