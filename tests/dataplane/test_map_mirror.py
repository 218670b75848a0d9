"""MapMirror.pending_within: the small-case comparison agrees with np.isin, both branches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ext.dataplane import map_mirror
from sglang_ext.dataplane.map_mirror import MapMirror


@pytest.mark.parametrize("small_isin", [0, map_mirror.SMALL_ISIN])
def test_pending_within_matches_isin(monkeypatch: pytest.MonkeyPatch, small_isin: int) -> None:
    monkeypatch.setattr(map_mirror, "SMALL_ISIN", small_isin)  # 0: every call takes np.isin
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
