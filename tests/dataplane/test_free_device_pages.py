"""The step report's free device pages (``LayeredKVCore.free_device_pages``: free pages plus the
resident layer-pages only the prefix cache holds) equal the pool's truth after every operation.

The cached-orphan part was a figure of the last full reconciliation; a prefix hit's append-only
fast path, a free of cached pages and a staging give-up left it stale (data-plane review, session
64: a prefix hit reported 12 pages free for 8 steady steps while none was; a free reported 69 on
a 60-page pool; 95 over- and 273 undercounts in 3,750 random operations). The planner places
layers on that figure. Negative control, run by hand: the old cached figure fails both tests.
"""

from __future__ import annotations

import random

import pytest

from tests.dataplane.core_driver import CoreDriver, make_core
from tests.dataplane.test_live_pages import TreeDriver, random_op


def truth(core) -> int:  # noqa: ANN001
    """Free device pages plus resident layer-pages no live request uses, recounted from the map."""
    core.settle()
    used = core.residency.counts.users > 0
    return core.store.allocator.free_count + int((core.store.map_np[:, ~used] >= 0).sum())


def test_a_prefix_hit_makes_cached_pages_live_and_the_report_says_so():
    core = make_core(45)
    d = CoreDriver(core)
    d.add("a")
    d.step([("a", 8)])
    d.add("b")
    d.step([("b", 3)])
    core.release_request("a")
    cached = d.slots.pop("a")  # a finished; the radix tree keeps its pages
    d.step([("b", 1)])
    assert core.residency.reclaimable_pages > 0 and core.free_device_pages() == truth(core)
    d.slots["c"] = list(cached)  # a prefix hit: c starts on a's cached pages
    d.step([("c", 1)])
    for _ in range(10):
        assert core.free_device_pages() == truth(core)
        d.step([("c", 1), ("b", 1)])
    assert core.free_device_pages() == truth(core)


@pytest.mark.parametrize("seed", range(8))
def test_the_figure_is_the_truth_after_every_random_operation(seed):
    """Prefix hits, steps, plans and pauses, caching, evictions and finishes on a tight paged
    budget (``test_live_pages.random_op``)."""
    rng = random.Random(seed)
    core = make_core(45)
    d = TreeDriver(core, seed=seed)
    n = 0
    for i in range(150):
        n = random_op(d, rng, n)
        assert core.free_device_pages() == truth(core), f"seed {seed}, operation {i}"
