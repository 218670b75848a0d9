"""The layered radix cache attributes a decode batch's new slots with one host read of the
batch (``out_cache_loc.tolist()``): at page size > 1 a slot at offset 0 opens its page and is
reported to its request, the others are not -- the same reports as reading each request's slot
on its own (which on CUDA is one device read per request per step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang


def _reports(cache, batch, loc, per_request: bool) -> list[tuple[str, list[int]]]:  # noqa: ANN001
    got: list[tuple[str, list[int]]] = []
    cache._allocated = lambda req, blocks: got.append((req.rid, list(blocks))) if blocks else None
    if per_request:  # the reference: each request's slot read on its own
        for i, req in enumerate(batch.reqs):
            cache._report_allocated(req, loc[i : i + 1])
    else:
        cache._on_alloc_decode(batch, loc, 1)
    return got


@pytest.mark.parametrize("page_size", [4, 16])
def test_batched_decode_reports_equal_per_request_reads(page_size):
    from sglang_ext.radix_cache import LayeredRadixCache

    cache = object.__new__(LayeredRadixCache)  # only the attribution logic runs
    cache.page_size = page_size
    cache.decode_slots_sink = None
    reqs = [SimpleNamespace(rid=f"r{i}", kv=SimpleNamespace(req_pool_idx=i)) for i in range(6)]
    batch = SimpleNamespace(reqs=reqs)
    loc = torch.tensor([0, 5, 2 * page_size, 3 * page_size + 1, 7 * page_size, 9 * page_size + page_size - 1])
    want = _reports(cache, batch, loc, per_request=True)
    assert want == [("r0", [0]), ("r2", [2]), ("r4", [7])]  # offsets 0 open their pages
    assert _reports(cache, batch, loc, per_request=False) == want
    shifted = (loc // page_size) * page_size + 1  # control: every slot at offset 1, nothing opens
    assert _reports(cache, batch, shifted, per_request=False) == [] != want


def test_the_decode_slots_read_here_are_published_for_the_boundary():
    """The batch's host list goes to the layered pool's sink with the step it was allocated for
    (requests, lengths with the new token: ``seq_lens_cpu`` is the length before it), so the
    boundary reads nothing back (``HostSlots``); a step of several tokens a request publishes
    nothing (the steady boundary serves one token a request)."""
    from sglang_ext.dataplane.host_slots import HostSlots
    from sglang_ext.radix_cache import LayeredRadixCache

    cache = object.__new__(LayeredRadixCache)
    cache.page_size = 4
    cache._allocated = lambda req, blocks: None
    cache._report_allocated = lambda req, loc: None
    slots = HostSlots()
    cache.decode_slots_sink = slots.publish
    reqs = [SimpleNamespace(rid=f"r{i}", kv=SimpleNamespace(req_pool_idx=i)) for i in range(3)]
    batch = SimpleNamespace(reqs=reqs, seq_lens_cpu=torch.tensor([4, 9, 2]))
    loc = torch.tensor([16, 41, 10])
    cache._on_alloc_decode(batch, loc, 1)
    forward_copy = loc.clone()  # SGLang's forward holds a copy
    assert slots.read(["r0", "r1", "r2"], [5, 10, 3], forward_copy) == [16, 41, 10]
    assert (slots.handoffs, slots.readbacks) == (1, 0)
    # negative control: the lengths before the new token are another step
    cache._on_alloc_decode(batch, loc, 1)
    assert slots.read(["r0", "r1", "r2"], [4, 9, 2], forward_copy) == [16, 41, 10]
    assert (slots.handoffs, slots.readbacks) == (1, 1)
    # two tokens a request (speculative steps): nothing published
    cache._on_alloc_decode(batch, torch.tensor([16, 17, 41, 42, 10, 11]), 2)
    slots.read(["r0", "r1", "r2"], [6, 11, 4], torch.tensor([18, 43, 12]))
    assert (slots.handoffs, slots.readbacks) == (1, 2)
