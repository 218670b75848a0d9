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
