"""IdentityPages: counting and the double-use / double-free / range checks of the identity layout."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.dataplane.identity_pages import IdentityPages


def test_take_and_free_count_and_reject_misuse_without_changing_anything():
    pages = IdentityPages(8, "dev")
    pages.take(torch.tensor([1, 5]))
    assert (pages.free_count, pages.used_count, pages.used_ids()) == (6, 2, {1, 5})
    with pytest.raises(ValueError, match="already in use"):
        pages.take([5, 6])
    with pytest.raises(ValueError, match="repeated"):
        pages.take([6, 6])
    with pytest.raises(ValueError, match="out of range"):
        pages.take([8])
    with pytest.raises(ValueError, match="double free"):
        pages.free([1, 2])
    assert pages.used_ids() == {1, 5} and pages.free_count == 6
    pages.free([1, 5])
    assert pages.free_count == 8


def test_alloc_hands_out_free_ids_for_staging_or_none():
    pages = IdentityPages(4, "dev")
    pages.take([0, 2])
    assert sorted(pages.alloc(2)) == [1, 3]
    assert pages.alloc(1) is None and pages.free_count == 0
