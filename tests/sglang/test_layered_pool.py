"""LayeredTokenToKVPool without a server: built with MHATokenToKVPool's kwargs at toy sizes (CPU).

Scenario: SGLang's write path (``set_kv_buffer``) and the layered read path (``layer_kv``)
against a shadow copy of every live token's K/V, while residency changes at step
boundaries (plan wants, pauses, releases, frees, the local fallback).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_ext.args import LayeredKVArgs
from sglang_ext.dataplane.slot_results import RequestResidency
from sglang_ext.hooks import ResidencyEventKind

pytest.importorskip("sglang")  # sglang_ext.layered_pool imports SGLang at module level
from sglang_ext.layered_pool import LayeredTokenToKVPool  # noqa: E402

LAYERS, HEADS, DIM, PAGE, SLOTS = 3, 2, 4, 2, 64
MIN_BUDGET = 66
"""One layer of the slot space (33 pages of 2 tokens): from here on any batch can be staged."""
ROOMY = 196
"""98 device pages, one short of every layer-page (99): the paged layout, with its host tier
(from 198 on the pool is the identity layout, which has none: ``SlotStoreConfig.host_tier``)."""


def make_pool(budget_tokens: int | None = 200, page_size: int = PAGE) -> LayeredTokenToKVPool:
    return LayeredTokenToKVPool(
        size=SLOTS,
        page_size=page_size,
        dtype=torch.float16,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=budget_tokens),
    )


class Harness:
    """Drives the pool like SGLang does (paged slot allocation, writes, reads) with a shadow."""

    def __init__(self, pool: LayeredTokenToKVPool, seed: int = 0, in_place: bool = False) -> None:
        self.pool = pool
        self.in_place = in_place
        """Ask ``readable_in_place`` after ``prepare_step`` like the attention backend (the identity
        layout then writes in place, dirty pages marked once per step)."""
        self.gen = torch.Generator().manual_seed(seed)
        self.free_pages = list(range(SLOTS // PAGE, 0, -1))  # page 0 is SGLang's padding page
        self.slots: dict[str, list[int]] = {}
        self.shadow: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _page_refs(self, page: int) -> int:
        return sum(1 for s in self.slots.values() for x in s if x // PAGE == page and x % PAGE == 0)

    def _new_slots(self, rid: str, n: int) -> list[int]:
        slots = self.slots[rid]
        out = []
        for _ in range(n):
            if slots and (slots[-1] + 1) % PAGE != 0:
                nxt = slots[-1] + 1
            else:
                nxt = self.free_pages.pop() * PAGE
            slots.append(nxt)
            out.append(nxt)
        return out

    def step(self, rid: str, n: int, share_from: str | None = None, share_pages: int = 0) -> None:
        if rid not in self.slots:
            prefix = self.slots[share_from][: share_pages * PAGE] if share_from else []
            self.slots[rid] = list(prefix)
        needed = -(-max(0, n - (PAGE - len(self.slots[rid]) % PAGE) % PAGE) // PAGE)
        if needed > len(self.free_pages):
            return
        new = self._new_slots(rid, n)
        loc = torch.tensor(new, dtype=torch.int64)
        self.pool.prepare_step([(rid, torch.tensor(self.slots[rid]))], loc, [n])
        for layer in range(LAYERS):
            self.pool.enter_layer(layer)
            k = torch.randn((n, HEADS, DIM), generator=self.gen).half()
            v = torch.randn((n, HEADS, DIM), generator=self.gen).half()
            self.pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, k, v)
            for i, slot in enumerate(new):
                self.shadow[(layer, slot)] = (k[i].clone(), v[i].clone())
            got_k, got_v = read_in_step(self.pool, layer, self.slots[rid])
            want = [self.shadow[(layer, s)] for s in self.slots[rid]]
            assert torch.equal(got_k, torch.stack([w[0] for w in want]))
            assert torch.equal(got_v, torch.stack([w[1] for w in want]))
            self.pool.exit_layer(layer)

    def release(self, rid: str) -> None:
        slots = self.slots.pop(rid)
        self.pool.release_request(rid)
        pages = sorted({s // PAGE for s in slots if self._page_refs(s // PAGE) == 0})
        self.pool.residency.page_freed(pages)
        self.free_pages.extend(pages)
        for slot in slots:
            if self._page_refs(slot // PAGE) == 0:
                for layer in range(LAYERS):
                    self.shadow.pop((layer, slot), None)

    def check(self) -> None:
        pool = self.pool
        for rid, slots in self.slots.items():
            for layer in range(LAYERS):
                got_k, got_v = pool.layer_kv(layer, torch.tensor(slots))
                want = [self.shadow[(layer, s)] for s in slots]
                assert torch.equal(got_k, torch.stack([w[0] for w in want])), (rid, layer)
                assert torch.equal(got_v, torch.stack([w[1] for w in want])), (rid, layer)
        check_map(pool)


def read_in_step(pool: LayeredTokenToKVPool, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the step's only request as the served attention reads them inside the layer: the
    identity layout in place by slot id, otherwise the device pool through the layer's row table."""
    if pool.overflow:  # the batch could not be staged inside the budget: the at-rest read
        return pool.layer_kv(layer, torch.tensor(slots))
    if pool.store.identity:
        k_layer, v_layer = pool.layer_in_place(layer)
        idx = torch.tensor(slots)
        return k_layer[idx], v_layer[idx]
    rows = pool.token_rows(layer)[0, : len(slots)]
    k_all, v_all = pool.device_kv()
    return k_all[rows], v_all[rows]


def check_map(pool: LayeredTokenToKVPool) -> None:
    """Device map and allocator agree; never more device pages than the budget."""
    pool.core.settle()  # recorded releases and frees first (what every reader does)
    mapped = pool.store.map_cpu[pool.store.map_cpu >= 0].tolist()
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == pool.store.allocator.used_ids()
    stats = pool.residency_stats()
    assert stats.device_pages_used <= stats.device_pages_total


def wants(pool: LayeredTokenToKVPool, h: Harness, rid: str, layers, paused=False) -> RequestResidency:
    pages = tuple(dict.fromkeys(s // PAGE for s in h.slots[rid]))
    return RequestResidency(pages=pages, gpu_layers=tuple(bool(x) for x in layers), paused=paused)


RIDS = ("a", "b", "c")
op = st.one_of(
    st.tuples(st.just("step"), st.sampled_from(RIDS), st.integers(1, 5), st.sampled_from((None, *RIDS)),
              st.integers(0, 2)),
    st.tuples(st.just("want"), st.sampled_from(RIDS), st.lists(st.booleans(), min_size=LAYERS, max_size=LAYERS),
              st.booleans()),
    st.tuples(st.just("release"), st.sampled_from(RIDS)),
)


def apply_op(pool: LayeredTokenToKVPool, h: Harness, item: tuple) -> None:
    """One drawn operation: a step (optionally sharing a prefix), new wants, or a release."""
    kind, rid = item[0], item[1]
    if kind == "step":
        share = item[3] if item[3] in h.slots and rid not in h.slots and item[3] != rid else None
        share_pages = min(item[4], len(h.slots[share]) // PAGE) if share else 0
        h.step(rid, item[2], share, share_pages)
    elif kind == "want" and rid in h.slots:
        pool.update_residency({rid: wants(pool, h, rid, item[2], paused=item[3])})
    elif kind == "release" and rid in h.slots:
        h.release(rid)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=25),
    budget=st.sampled_from([2, 8, 16, MIN_BUDGET, 72, 200, None]),
    in_place=st.booleans(),
)
def test_kv_round_trips_bit_exact_across_random_residency_changes(ops, budget, in_place):
    """Every live token's K/V reads back bit-exact after any sequence of steps, wants, pauses,
    releases -- also when steps write in place (identity layout: offloads after in-place writes
    must find those pages dirty)."""
    pool = make_pool(budget_tokens=budget)
    h = Harness(pool, in_place=in_place)
    for item in ops:
        apply_op(pool, h, item)
        h.check()


def test_copy_programs_flag_reaches_the_store():
    """``--kv-copy-programs``, ``--kv-copy-engine`` and ``--kv-timing-interval`` reach the served
    store's config (the CUDA engine reads it there; the CPU engine copies synchronously and ignores
    it); the default leaves the kernel's programs, and the copy engines (``dma``) by default."""
    pool = LayeredTokenToKVPool(size=SLOTS, page_size=PAGE, dtype=torch.float16, head_num=HEADS, head_dim=DIM,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=200,
                                                           kv_copy_programs=16, kv_timing_interval=3))
    assert pool.store.config.copy_programs == 16 and pool.store.config.timing_interval == 3
    assert make_pool().store.config.copy_programs is None
    assert make_pool().store.config.timing_interval == 8  # --kv-timing-interval's default reaches the store
    kernels = LayeredTokenToKVPool(size=SLOTS, page_size=PAGE, dtype=torch.float16, head_num=HEADS, head_dim=DIM,
                               layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                               layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=200,
                                                          kv_copy_engine="triton"))
    assert kernels.store.config.copy_engine == "triton" and make_pool().store.config.copy_engine == "dma"
    from sglang_ext.dataplane.slot_store_config import SlotStoreConfig

    with pytest.raises(ValueError, match="copy_programs=0 must be None or an int >= 1"):
        SlotStoreConfig(layers=1, page_size=1, kv_heads=1, head_dim=1, logical_pages=1, device_pages=1,
                        dtype=torch.float16, device="cpu", copy_programs=0)
    with pytest.raises(ValueError, match="copy_engine='nvlink' must be 'triton' or 'dma'"):
        SlotStoreConfig(layers=1, page_size=1, kv_heads=1, head_dim=1, logical_pages=1, device_pages=1,
                        dtype=torch.float16, device="cpu", copy_engine="nvlink")
    with pytest.raises(ValueError, match="timing_interval=0 must be an int >= 1"):
        SlotStoreConfig(layers=1, page_size=1, kv_heads=1, head_dim=1, logical_pages=1, device_pages=1,
                        dtype=torch.float16, device="cpu", timing_interval=0)


def test_shared_pages_resident_iff_some_live_request_wants_them():
    """A shared prefix page is on device at layer l iff a live, unpaused user wants layer l."""
    pool = make_pool(budget_tokens=ROOMY)
    h = Harness(pool)
    h.step("a", 4)
    h.step("b", 2, share_from="a", share_pages=2)
    shared = sorted({s // PAGE for s in h.slots["a"]})
    pool.update_residency({"a": wants(pool, h, "a", [1, 0, 0]), "b": wants(pool, h, "b", [0, 1, 0])})
    resident = pool.store.resident_mask()
    assert resident[0, shared].all() and resident[1, shared].all() and not resident[2, shared].any()
    own_b = sorted({s // PAGE for s in h.slots["b"]} - set(shared))
    assert not resident[0, own_b].any() and resident[1, own_b].all()
    pool.release_request("a")
    pool.update_residency({})
    resident = pool.store.resident_mask()
    assert not resident[0, shared].any() and resident[1, shared].all()
    h.slots.pop("a")
    h.check()


def test_full_device_pool_never_crashes_and_loses_nothing():
    """Wants beyond the budget leave the excess on host (reported as shortfall); KV stays exact."""
    pool = make_pool(budget_tokens=MIN_BUDGET)  # 33 device pages
    h = Harness(pool)
    h.step("a", 30)  # 15 pages x 3 layers; the local fallback offloads to fit (staging kept free)
    delta = pool.update_residency({"a": wants(pool, h, "a", [1, 1, 1])})
    # planned all-resident does not fit: one layer of "a" (15 pages) stays free for its staging
    assert delta.shortfall_layer_pages == 15 * LAYERS - (33 - 15)
    assert pool.residency_stats().device_pages_used == 33 - 15
    h.step("a", 3)
    h.check()


def test_kv_is_preserved_on_host_after_offload():
    """Offloading drops the device copy only after the host copy is current (device garbage is harmless)."""
    pool = make_pool(budget_tokens=ROOMY)
    h = Harness(pool)
    h.step("a", 6)
    assert pool.store.resident_mask().sum() == 3 * LAYERS
    delta = pool.update_residency({"a": wants(pool, h, "a", [0, 0, 0])})
    assert delta.offloaded_layer_pages == 3 * LAYERS
    pool.store.dev.fill_(float("nan"))
    h.check()
    pool.update_residency({"a": wants(pool, h, "a", [1, 1, 1])})
    h.check()


@pytest.mark.parametrize("offloaded", [False, True])
def test_move_kv_cache_copies_every_layer_at_rest(offloaded):
    """SGLang's ``move_kv_cache``: the target slots read back the source slots' K/V at every
    layer (resident or offloaded), and the moved page is marked written so an offload keeps it.
    Negative control: before the move the target slots read something else."""
    pool = make_pool(budget_tokens=ROOMY)
    h = Harness(pool)
    h.step("a", 4)
    h.step("b", 4)
    if offloaded:
        pool.update_residency({"a": wants(pool, h, "a", [1, 0, 1])})
    src, tgt = torch.tensor(h.slots["a"][:2]), torch.tensor(h.slots["b"][2:4])
    want = [pool.layer_kv(layer, src) for layer in range(LAYERS)]
    assert not all(torch.equal(pool.layer_kv(layer, tgt)[0], want[layer][0]) for layer in range(LAYERS))
    pool.move_kv_cache(tgt, src)
    for layer in range(LAYERS):
        got = pool.layer_kv(layer, tgt)
        assert torch.equal(got[0], want[layer][0]) and torch.equal(got[1], want[layer][1]), layer
    pool.update_residency({"b": wants(pool, h, "b", [0, 0, 0])})  # the moved page must reach host
    pool.store.dev.fill_(float("nan"))
    for layer in range(LAYERS):
        assert torch.equal(pool.layer_kv(layer, tgt)[0], want[layer][0]), layer


def test_paused_layers_are_dropped_lazily_highest_layer_first():
    """A paused request keeps its device layers until space is needed, then gives up the top layer first."""
    pool = make_pool(budget_tokens=MIN_BUDGET + 12)  # 39 device pages
    h = Harness(pool)
    h.step("a", 6)  # 3 pages x 3 layers = 9 device pages
    pool.update_residency({"a": wants(pool, h, "a", [1, 1, 1], paused=True)})
    assert pool.store.resident_mask().sum() == 9  # nothing needed the space yet
    h.step("b", 22)  # 11 pages x 3 layers = 33 wanted: 30 free, 3 taken from "a"
    resident = pool.store.resident_mask()
    a_pages = sorted({s // PAGE for s in h.slots["a"]})
    assert resident[0, a_pages].all() and resident[1, a_pages].all() and not resident[2, a_pages].any()
    h.check()


def test_local_fallback_offloads_highest_layers_of_the_largest_request():
    """Without a plan, a tight budget switches the largest request's highest layers to host first."""
    pool = make_pool(budget_tokens=90)  # 45 device pages
    h = Harness(pool)
    h.step("small", 2)  # 1 page x 3 layers
    h.step("big", 40)  # 20 pages x 3 layers: 60 + 3 > 45; each offloaded layer also needs staging
    assert pool.residency.gpu_layers("small") == (True, True, True)
    assert pool.residency.gpu_layers("big") == (True, False, False)  # 3 + 20 resident + 20 staging
    stats = pool.residency_stats()
    assert stats.device_pages_used == 3 + 20
    assert stats.host_layer_pages == 40 and stats.live_layer_pages == 63
    h.check()


def test_freed_pages_return_their_device_pages():
    """Pages SGLang frees give their device pages back; offload/load events reach subscribers."""
    pool = make_pool(budget_tokens=ROOMY)
    events = []
    pool.residency_hooks.subscribe(events.append)
    h = Harness(pool)
    h.step("a", 4)
    pool.update_residency({"a": wants(pool, h, "a", [1, 0, 1])})
    pool.update_residency({"a": wants(pool, h, "a", [1, 1, 1])})
    kinds = [e.kind for e in events]
    assert kinds == [ResidencyEventKind.OFFLOADED, ResidencyEventKind.LOADED]
    assert events[0].layers == (1,) and events[1].layers == (1,)
    h.release("a")
    assert pool.residency_stats().device_pages_used == 0
    check_map(pool)


def test_invalid_wants_and_budget_are_rejected_by_name():
    """Bad wants / budgets fail with a message naming the field and the allowed range."""
    pool = make_pool()
    with pytest.raises(ValueError, match="gpu_layers has 2 entries"):
        pool.update_residency({"x": RequestResidency(pages=(1,), gpu_layers=(True, False))})
    with pytest.raises(ValueError, match="pages"):
        pool.update_residency({"x": RequestResidency(pages=(10_000,), gpu_layers=(True,) * LAYERS)})
    with pytest.raises(ValueError, match="below one page"):
        make_pool(budget_tokens=1)
    with pytest.raises(ValueError, match="kv-gpu-budget-tokens"):
        LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=0)
    assert pool.residency_stats().device_pages_used == 0


def test_pool_allocates_no_full_per_layer_device_buffers():
    """The device holds only the budget: no per-layer buffers; flat-buffer readers get a clear error."""
    pool = make_pool(budget_tokens=70)
    assert pool.k_buffer is None and pool.v_buffer is None
    assert pool.store.dev.shape == (2, 35, PAGE, HEADS, DIM)
    with pytest.raises(RuntimeError, match="layer_kv"):
        pool.get_key_buffer(0)


def test_freed_pages_leave_live_requests():
    """Pages SGLang frees leave every request's page set; a request left with none is forgotten."""
    pool = make_pool(budget_tokens=200)
    h = Harness(pool)
    h.step("a", 4)
    h.step("b", 2)
    pool.residency.page_freed(sorted({s // PAGE for s in h.slots["a"]}))
    assert pool.residency.live_rids() == ["b"]
    assert pool.residency_stats().live_layer_pages == LAYERS * 1


def test_budget_flag_parses_and_travels_in_the_environment():
    """--kv-gpu-budget-tokens reaches the pool through KVPLANE_LAYERED_KV_ARGS; bad values name the flag."""
    import argparse

    from sglang_ext import args as kv_args
    from sglang_ext import layered_kv_cli

    layered_kv_cli.add_arguments(parser := argparse.ArgumentParser())
    ns = parser.parse_args(["--enable-layered-kv", "--kv-gpu-budget-tokens", "24"])
    parsed = LayeredKVArgs.from_namespace(ns)
    assert LayeredKVArgs.from_env({kv_args.ENV_VAR: parsed.to_json()}).kv_gpu_budget_tokens == 24
    with pytest.raises(ValueError, match=r"--kv-gpu-budget-tokens=-3 is out of range"):
        LayeredKVArgs.from_namespace(parser.parse_args(["--kv-gpu-budget-tokens", "-3"]))


def test_unplanned_wants_leave_the_decision_to_the_local_fallback():
    """A want marked planned=False keeps the local fallback's layers; a planned one overrides them."""
    pool = make_pool(budget_tokens=100)  # 50 device pages
    h = Harness(pool)
    # 21 pages x 3 layers = 63 > 50; one offloaded layer saves nothing (its pages become the
    # staging slot), two do: 21 resident + 21 staging
    h.step("big", 42)
    assert pool.residency.gpu_layers("big") == (True, False, False)
    pages = tuple(dict.fromkeys(s // PAGE for s in h.slots["big"]))
    pool.update_residency({"big": RequestResidency(pages=pages, gpu_layers=(True,) * LAYERS, planned=False)})
    assert pool.residency.gpu_layers("big") == (True, False, False)
    h.step("big", 10)  # 26 pages: 26 + 26 staging > 50, so the fallback switches layer 0 too
    assert pool.residency.gpu_layers("big") == (False, False, False)
    pool.update_residency({"big": RequestResidency(pages=pages, gpu_layers=(False, True, False))})
    assert pool.residency.gpu_layers("big") == (False, True, False)
    h.check()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(ops=st.lists(op, min_size=1, max_size=25), budget=st.sampled_from([4, 8, 12, MIN_BUDGET, 72, 200, None]))
def test_append_fast_path_places_exactly_what_the_full_pass_would(ops, budget):
    """Residency after every step is the same with and without the append-only fast path (the
    tiny budgets: ``test_layered_pool_fast_path.py``'s staging-reserve case; 400 random draws
    at 4-30 tokens found no other difference, session 49)."""
    fast, full = make_pool(budget_tokens=budget), make_pool(budget_tokens=budget)
    full.residency._reconcile_appended = lambda: None
    hf, hs = Harness(fast), Harness(full)
    for item in ops:
        for h, pool in ((hf, fast), (hs, full)):
            apply_op(pool, h, item)
        assert torch.equal(fast.store.resident_mask(), full.store.resident_mask())
    hf.check()


def test_cached_pages_stay_resident_until_space_is_needed():
    """A finished request's pages kept by the prefix cache stay on the device while there is room
    (a prefix hit needs no reload), count as free capacity, and go first, top layer first."""
    pool = make_pool(budget_tokens=MIN_BUDGET + 12)  # 39 device pages
    h = Harness(pool)
    h.step("a", 6)  # 3 pages x 3 layers = 9 device pages
    a_pages = sorted({s // PAGE for s in h.slots["a"]})
    pool.release_request("a")  # finished; SGLang's tree keeps its pages
    pool.update_residency({})
    assert pool.store.resident_mask()[:, a_pages].all()
    assert pool.free_device_pages() == 39
    h.slots.pop("a")
    h.step("b", 22)  # 11 pages x 3 layers: 30 free, 3 taken from the cached pages
    resident = pool.store.resident_mask()
    assert resident[0, a_pages].all() and resident[1, a_pages].all() and not resident[2, a_pages].any()
    h.check()


def test_a_batch_that_cannot_be_staged_overflows_correctly_and_is_counted():
    """Scenario: a 3-page device budget cannot stage a 4-page request: the step is served through
    the at-rest path (exact KV, counted in ``overflow_steps``); with room again the next step
    runs the staged pipeline."""
    pool = make_pool(budget_tokens=6)  # 3 device pages
    h = Harness(pool)
    h.step("a", 8)  # 4 pages: one layer alone does not fit
    assert pool.overflow and pool.overflow_steps >= 1
    h.check()
    small = make_pool(budget_tokens=MIN_BUDGET)
    hs = Harness(small)
    hs.step("a", 8)
    hs.step("a", 1)
    assert not small.overflow and small.overflow_steps == 0
    hs.check()
