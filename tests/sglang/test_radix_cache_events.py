"""The layered radix cache on a real SGLang ``RadixCache`` (no server): tree events are built only
for their subscribers, and ownership is kept around a checkpoint."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from sglang_ext.hooks import ResidencyEventKind  # noqa: E402
from sglang_ext.radix_cache import LayeredRadixCache  # noqa: E402

SLOTS = 64


def _cache() -> tuple[LayeredRadixCache, list[int]]:
    """A layered radix cache over a real token allocator; the list counts block reads."""
    kv = MHATokenToKVPool(size=SLOTS, page_size=1, dtype=torch.float32, head_num=1, head_dim=4, layer_num=1,
                          device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(SLOTS, torch.float32, "cpu", kv, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(4, 32, "cpu", False),
                             token_to_kv_pool_allocator=allocator, page_size=1)
    cache = LayeredRadixCache(params)
    reads: list[int] = []
    original = cache._blocks_of_slots

    def counted(slots: torch.Tensor) -> list[int]:
        reads.append(1)
        return original(slots)

    cache._blocks_of_slots = counted  # type: ignore[method-assign]
    return cache, reads


def _insert(cache: LayeredRadixCache, tokens: list[int], slots: list[int]) -> None:
    cache.insert(InsertParams(key=RadixKey(tokens), value=torch.tensor(slots, dtype=torch.int64)))


def test_checkpoint_and_eviction_events_are_built_only_for_a_subscriber() -> None:
    """SGLang inserts a running request's KV into the tree every few steps: with nobody
    subscribed to CHECKPOINTED / EVICTED the event's blocks are never read (the negative
    control: a subscriber gets both events with the new node's blocks and the owner)."""
    cache, reads = _cache()
    cache._owner_rid = "a"  # as inside checkpoint(req a)
    _insert(cache, [1, 2, 3, 4], [5, 6, 7, 8])
    cache._owner_rid = None
    assert cache.evict(EvictParams(num_tokens=4)) is not None
    assert reads == [1]  # the allocator's free of the evicted leaf (FREED keeps the pool right)

    cache, reads = _cache()
    got: list[Any] = []
    cache.residency_hooks.subscribe(got.append, kinds=[ResidencyEventKind.CHECKPOINTED, ResidencyEventKind.EVICTED])
    cache._owner_rid = "a"
    _insert(cache, [1, 2, 3, 4], [5, 6, 7, 8])
    _insert(cache, [1, 2, 3, 4, 9, 10], [5, 6, 7, 8, 11, 12])
    cache._owner_rid = None
    cache.evict(EvictParams(num_tokens=6))
    assert [(e.kind, e.blocks, e.rid) for e in got[:2]] == [
        (ResidencyEventKind.CHECKPOINTED, (5, 6, 7, 8), "a"),
        (ResidencyEventKind.CHECKPOINTED, (11, 12), "a"),
    ]
    assert {b for e in got[2:] if e.kind is ResidencyEventKind.EVICTED for b in e.blocks} == {5, 6, 7, 8, 11, 12}
    evicted = sum(e.kind is ResidencyEventKind.EVICTED for e in got)
    assert evicted and len(reads) == 2 + 2 * evicted  # the events, and each evicted leaf's free


def test_checkpoint_sets_the_owner_for_frees_inside_it_and_restores_it() -> None:
    """Frees made while a request is checkpointed carry its id; the owner before it is back
    after it, also when the tree raises."""
    cache, _ = _cache()
    seen: list[str | None] = []

    def fake_checkpoint(self: Any, req: Any, *, up_to: int, **kwargs: Any) -> None:
        seen.append(cache._owner_rid)
        if up_to < 0:
            raise RuntimeError("tree failed")

    parent = LayeredRadixCache.__mro__[1]
    original = parent.checkpoint
    parent.checkpoint = fake_checkpoint  # type: ignore[method-assign]
    try:
        cache._owner_rid = "outer"
        cache.checkpoint(type("Req", (), {"rid": "r1"})(), up_to=3)
        with pytest.raises(RuntimeError, match="tree failed"):
            cache.checkpoint(type("Req", (), {"rid": "r2"})(), up_to=-1)
    finally:
        parent.checkpoint = original  # type: ignore[method-assign]
    assert seen == ["r1", "r2"] and cache._owner_rid == "outer"
