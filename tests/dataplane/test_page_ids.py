"""Page ids from SGLang outside the pool change nothing (``sglang_ext/dataplane/page_ids.py``),
and a plan installed after a forward that stopped early reads the tokens it wrote.

Found by the data-plane review of session 64 (each case fails on the code before it, by hand):
a free of page -1 was applied to the pool's last page (NumPy's negative index) and its live
request lost it; a request's slot past the pool raised only after the request was recorded, so
every later boundary raised; ``update_residency`` onloaded a host copy before the parked tokens
of an unfinished forward were written back.
"""

from __future__ import annotations

import pytest
import torch

from tests.dataplane.core_driver import CoreDriver, make_core


def test_a_free_of_an_id_outside_the_pool_is_ignored_and_the_live_page_keeps_its_kv():
    core = make_core(60)
    d = CoreDriver(core, seed=1)
    d.free_pages = [32]  # the allocator hands out the pool's last page (P - 1 = 32)
    d.add("a")
    d.step([("a", 2)])
    core.page_freed([-1, 33])
    core.settle()
    assert "a" in core.residency.requests and core.store.map_np[:, 32].min() >= 0
    d.check_at_rest()  # every layer of a's tokens reads what was written
    core.page_freed([32])  # control: the real id is applied
    core.settle()
    assert core.store.map_np[:, 32].max() < 0


@pytest.mark.parametrize("bad", [67, 66, -2], ids=["past-the-pool", "one-past", "negative"])
def test_a_request_slot_outside_the_pool_is_refused_before_anything_is_recorded(bad):
    core = make_core(60)
    d = CoreDriver(core)
    d.add("a")
    d.step([("a", 4)])
    mirror_before = core.store.mirror.dev.clone()
    with pytest.raises(ValueError, match="a request's slots: page ids"):
        core.prepare_step([("x", torch.tensor([40, 41, bad]))], torch.tensor([bad]), [1])
    assert "x" not in core.residency.requests
    assert torch.equal(core.store.mirror.dev, mirror_before)
    for _ in range(3):  # the core goes on
        d.step([("a", 1)])
    d.check_at_rest()


def test_a_plan_installed_after_a_forward_that_stopped_early_reads_its_tokens():
    """A staged decode step's new token is parked for write-back at the step's end; the forward
    stops after layer 1 of 3 and a plan then brings every layer back to the device. The install
    ends the forward first, so the onload copies the written token (the layer read equals it)."""
    core = make_core(73)
    d = CoreDriver(core, seed=3)
    d.add("a")
    d.step([("a", 5)])
    d.want("a", [True, False, False])  # layers 1 and 2 of a's pages go to the host
    d.step([("a", 1)])
    new = d._grow("a", 1)
    loc = torch.tensor(new)
    core.prepare_step([("a", torch.tensor(d.slots["a"]))], loc, [1])
    assert core.tables.token_writeback is not None
    for layer in range(2):
        core.enter_layer(layer)
        k, v = torch.randn(1, 2, 4), torch.randn(1, 2, 4)
        core.write(layer, loc, k, v)
        d.shadow[(layer, new[0])] = (k[0].clone(), v[0].clone())
        core.exit_layer(layer)
    d.want("a", [True, True, True])
    k1, v1 = core.read_kv(1, loc)
    assert torch.equal(k1[0], d.shadow[(1, new[0])][0]) and torch.equal(v1[0], d.shadow[(1, new[0])][1])
