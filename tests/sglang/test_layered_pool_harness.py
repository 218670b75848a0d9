"""Negative control of the pool tests' ``Harness.check`` (``test_layered_pool.py``): the at-rest
comparison most of them end with fails on one wrong value, on the device or in the host pool."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")  # the pool tests' harness subclasses SGLang's pool
from tests.sglang.test_layered_pool import MIN_BUDGET, PAGE, Harness, make_pool, wants  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize("where", ["device", "host"])
def test_harness_check_fails_on_one_wrong_value(where):
    """Negative control of ``Harness.check`` (the at-rest comparison most pool tests end with):
    request a holds layer 1 on the host and layers 0 and 2 on the device; one K value changed in
    its first page, on the device at layer 0 or in the host pool at layer 1, fails the check
    naming (a, that layer)."""
    pool = make_pool(budget_tokens=MIN_BUDGET)
    h = Harness(pool, seed=2)
    h.step("a", 5)
    h.step("b", 3)
    pool.update_residency({"a": wants(pool, h, "a", (True, False, True))})
    h.check()
    page, layer = h.slots["a"][0] // PAGE, 0 if where == "device" else 1
    if where == "device":
        row = int(pool.store.map_np[layer, page])
        assert row >= 0
        pool.store.dev[0, row].view(-1)[0] += 1.0
    else:
        assert pool.store.map_np[layer, page] < 0
        pool.store.host[page, layer, 0].view(-1)[0] += 1.0
    with pytest.raises(AssertionError, match=rf"^\('a', {layer}\)\n"):
        h.check()
