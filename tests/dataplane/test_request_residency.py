"""RequestResidency refuses malformed pages (the C-level check keeps the old rule)."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_ext.dataplane.slot_results import RequestResidency

LAYERS = (True, False)


@pytest.mark.parametrize(
    "pages",
    [(1, -1), (True, 2), (1.0,), (np.int64(3),), ("4",), (2, None)],
    ids=["negative", "bool", "float", "numpy-int", "str", "none"],
)
def test_bad_pages_refused(pages: tuple) -> None:
    with pytest.raises(ValueError, match="pages must be non-negative ints"):
        RequestResidency(pages=pages, gpu_layers=LAYERS)


@pytest.mark.parametrize("pages", [(), (0,), (5, 3, 9), tuple(range(1000))])
def test_good_pages_accepted(pages: tuple) -> None:
    """Negative control for the refusals above: plain non-negative ints pass."""
    assert RequestResidency(pages=pages, gpu_layers=LAYERS).pages == pages


def test_a_bad_want_installs_nothing() -> None:
    """Every want is checked before any is applied: a bad one (a page out of range) refuses the
    whole install, and the good one before it is not half-installed."""
    from tests.dataplane.core_driver import LAYERS, make_core

    core = make_core(None, pages=16)
    good = RequestResidency(pages=(1, 2), gpu_layers=(True,) * LAYERS)
    bad = RequestResidency(pages=(3, 99), gpu_layers=(True,) * LAYERS)
    with pytest.raises(ValueError, match="out of range"):
        core.update_residency({"good": good, "bad": bad})
    assert core.residency.live_rids() == [] and not core.residency.counts.users.any()
    core.update_residency({"good": good})  # control: alone it installs
    assert core.residency.live_rids() == ["good"] and core.residency.counts.users[[1, 2]].tolist() == [1, 1]
