"""MapMirror.pending_within: the small cases' comparisons (Python sets, a 2-D compare) agree with
np.isin, each branch; a sync with the caller's known columns takes them only when they are
provably the sync's; a failed sync leaves its columns due."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ext.dataplane import map_mirror
from sglang_ext.dataplane.map_mirror import MapMirror


@pytest.mark.parametrize(("small_set", "small_isin"), [(0, 0), (0, map_mirror.SMALL_ISIN), (map_mirror.SMALL_SET, 0)],
                         ids=["isin", "2-D compare", "sets"])
def test_pending_within_matches_isin(monkeypatch: pytest.MonkeyPatch, small_set: int, small_isin: int) -> None:
    monkeypatch.setattr(map_mirror, "SMALL_SET", small_set)  # 0: no call compares sets
    monkeypatch.setattr(map_mirror, "SMALL_ISIN", small_isin)  # 0: no call compares in 2-D
    rng = np.random.default_rng(0)
    seen = {True: 0, False: 0}
    for _ in range(300):
        mirror = MapMirror(np.full((4, 64), -1, dtype=np.int32), torch.device("cpu"))
        assert mirror.pending_within(np.zeros(0, dtype=np.int64))  # nothing pending
        for _ in range(int(rng.integers(1, 4))):
            mirror.changed(rng.integers(0, 64, size=int(rng.integers(1, 6))))
        pages = rng.integers(0, 64, size=int(rng.integers(0, 8)))
        if rng.random() < 0.5:  # the logged columns plus others: within, unless one is dropped
            logged = np.unique(np.concatenate(mirror._log))
            pages = np.concatenate([logged[int(rng.random() < 0.3):], pages])
        expect = bool(np.isin(np.concatenate(mirror._log), pages).all())
        assert mirror.pending_within(pages) is expect
        seen[expect] += 1
    assert seen[True] > 10 and seen[False] > 10  # both answers exercised


def test_pending_within_after_sync_is_vacuous() -> None:
    mirror = MapMirror(np.full((2, 8), -1, dtype=np.int32), torch.device("cpu"))
    mirror.changed(np.array([3, 5]))
    assert not mirror.pending_within(np.array([3]))
    assert mirror.pending_within(np.array([5, 3]))
    mirror.sync()
    assert mirror.pending_within(np.array([], dtype=np.int64))


@pytest.mark.parametrize("case", ["used", "no pending_within", "another array", "not within",
                                  "changed after pending_within", "columns read before a change",
                                  "another page changed after pending_within"])
@pytest.mark.parametrize("staged", [False, True], ids=["cpu", "staged"])
def test_sync_takes_known_columns_only_when_they_are_the_syncs(case: str, staged: bool) -> None:
    """``sync(known)`` skips the log's distinct pass and the map read only when the last True
    ``pending_within`` was for this very pages array and nothing changed since (nor since the
    columns were read). The known columns are deliberately wrong (all 99): where they are taken the
    device copy holds 99 (the case "used" -- the control that the path runs), everywhere else the
    sync reads the map and the device copy equals it."""
    map_np = np.full((3, 16), -1, dtype=np.int32)
    mirror = MapMirror(map_np, torch.device("cpu"))
    mirror.staged = staged
    map_np[:, [2, 7]] = [[5, 6], [7, 8], [9, 10]]
    mirror.changed(np.array([2, 7]))
    pages = np.array([7, 2], dtype=np.int64)
    wrong = np.full((3, 2), 99, dtype=np.int32)
    seen = mirror.changes
    if case == "columns read before a change":
        map_np[0, 2] = 11
        mirror.changed(np.array([2]))
    if case == "not within":
        map_np[1, 9] = 12
        mirror.changed(np.array([9]))
    if case != "no pending_within":
        assert mirror.pending_within(pages if case != "another array" else pages.copy()) is (case != "not within")
    if case == "changed after pending_within":
        map_np[2, 7] = 13
        mirror.changed(np.array([7]))
    if case == "another page changed after pending_within":  # the columns read after it: current, not within
        map_np[2, 9] = 14
        mirror.changed(np.array([9]))
        seen = mirror.changes
    syncs = mirror.syncs
    mirror.sync((pages, wrong, seen))
    assert not mirror.pending and mirror.syncs == syncs + 1
    expect = torch.from_numpy(map_np).clone()
    bits = np.packbits(map_np < 0, axis=0, bitorder="little").T
    if case == "used":
        expect[:, [7, 2]] = 99
        bits[[7, 2]] = 0  # 99 >= 0: device-resident at every layer
    assert torch.equal(mirror.dev, expect)
    assert np.array_equal(mirror.host_bits, bits)
    assert mirror.sync((pages, wrong, mirror.changes)) is None and torch.equal(mirror.dev, expect)  # nothing pending


@pytest.mark.parametrize(("route", "where"), [("log", "device"), ("log", "host bits"), ("known", "device"),
                                              ("known", "host bits"), ("within", "host bits")])
@pytest.mark.parametrize("staged", [False, True], ids=["cpu", "staged"])
def test_a_failed_sync_leaves_the_columns_due(monkeypatch: pytest.MonkeyPatch, staged: bool, route: str,
                                              where: str) -> None:
    """A sync whose device side raises (an upload or scatter that fails), or whose host side
    does (the host bits), keeps its columns pending: the next sync uploads them, and the device
    copy and host bits equal the map again. Each route: the log's, the caller's known columns
    (a host-side raise there once emptied the log for good: the review of session 76), and
    ``sync_within``'s host side (its device side is the caller's)."""
    from sglang_ext.dataplane.pinned_upload_ring import PinnedUploadRing

    map_np = np.full((3, 16), -1, dtype=np.int32)
    mirror = MapMirror(map_np, torch.device("cpu"))
    mirror.staged = staged
    map_np[:, [2, 7]] = [[5, 6], [7, 8], [9, 10]]
    mirror.changed(np.array([2, 7]))
    pages = np.array([2, 7])
    assert mirror.pending_within(pages)
    known = (pages, np.take(map_np, pages, axis=1), mirror.changes) if route == "known" else None

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated failure")

    if where == "host bits":
        monkeypatch.setattr(MapMirror, "_bits", staticmethod(fail))
    elif staged:
        monkeypatch.setattr(PinnedUploadRing, "upload", fail)
    else:
        monkeypatch.setattr(mirror, "dev", _FailingCopy(mirror.dev))
    with pytest.raises(RuntimeError, match="simulated"):
        mirror.sync_within(pages) if route == "within" else mirror.sync(known)
    monkeypatch.undo()
    assert mirror.pending and mirror.pending_within(np.array([2, 7]))
    assert not torch.equal(mirror.dev, torch.from_numpy(map_np))  # control: stale after the failure
    mirror.sync()
    assert not mirror.pending and torch.equal(mirror.dev, torch.from_numpy(map_np))
    assert np.array_equal(mirror.host_bits, np.packbits(map_np < 0, axis=0, bitorder="little").T)


class _FailingCopy:
    """Stands in for ``MapMirror.dev`` (CPU path): its ``index_copy_`` raises."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base

    def index_copy_(self, *args: object) -> None:
        raise RuntimeError("simulated device failure")
