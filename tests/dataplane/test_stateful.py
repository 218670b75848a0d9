"""Hypothesis stateful test: random lifecycles keep KV bit-exact and memory exactly accounted.

Scenario: requests arrive (fresh or forked from another's prefix), decode, change placements (including refused ones), prepare and
abort placement changes, pause (their layers are reclaimed under pressure), resume, and finish,
on a deliberately small device pool; installs never hold more blocks than max(before, after). After every step: every request's KV equals the shadow
copy, allocators hold exactly the blocks the tables own (no leaks, no double use), and device use
equals controlplane.model.memory_blocks of the installed placement plus paused requests' blocks.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from controlplane.model import memory_blocks
from sglang_ext.dataplane import DevicePoolFull, HostPoolFull, LayeredKVCache
from tests.dataplane.harness import assert_matches_shadow, empty_shadow, run_step, small_config

LAYERS = 4
rows = st.lists(st.integers(0, 1), min_size=LAYERS, max_size=LAYERS)


class LayeredKVMachine(RuleBasedStateMachine):
    requests = Bundle("requests")
    total_steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.cache = LayeredKVCache(small_config(layers=LAYERS, device_blocks=24, host_blocks=40))
        self.shadow: dict = {}
        self.expected: dict[str, tuple[int, ...]] = {}  # active requests' placements
        self.paused: dict[str, tuple[int, ...]] = {}  # placement before pause
        self.next_id = 0
        self.seed = 0
        alloc = self.cache.device_pool.allocator
        self.peak = 0
        real_alloc = alloc.alloc

        def tracked(n):
            out = real_alloc(n)
            self.peak = max(self.peak, alloc.used_count)
            return out

        alloc.alloc = tracked

    def _seed(self) -> int:
        self.seed += 1
        return self.seed

    @rule(target=requests, tokens=st.integers(1, 12), row=st.none() | rows)
    def new_request(self, tokens, row):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.cache.alloc_request(rid, row)
        self.shadow[rid] = empty_shadow(self.cache.config)
        took = run_step(self.cache, {rid: tokens}, self.shadow, self._seed())
        if not took:  # refused (pool full): nothing was allocated; drop it again
            self.cache.free(rid)
            del self.shadow[rid]
            return multiple()  # nothing to add to the bundle
        self.expected[rid] = tuple(row) if row is not None else (1,) * LAYERS
        return rid

    @rule(target=requests, data=st.data(), row=st.none() | rows)
    def fork(self, data, row):
        sources = sorted(r for r in self.shadow if self.cache.tokens(r))
        if not sources:
            return multiple()
        src = data.draw(st.sampled_from(sources))
        n = data.draw(st.integers(1, self.cache.tokens(src)))
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.cache.alloc_request(rid, row)
        try:
            self.cache.fork_prefix(src, rid, n)
        except (DevicePoolFull, HostPoolFull):
            self.cache.free(rid)
            return multiple()
        self.shadow[rid] = [(k[:n].clone(), v[:n].clone()) for k, v in self.shadow[src]]
        self.expected[rid] = tuple(row) if row is not None else (1,) * LAYERS
        return rid

    @rule(data=st.data(), n=st.integers(1, 3))
    def decode(self, data, n):
        active = sorted(self.expected)
        if not active:
            return
        batch = data.draw(st.lists(st.sampled_from(active), unique=True, max_size=4))
        run_step(self.cache, {r: n for r in batch}, self.shadow, self._seed())

    @rule(data=st.data())
    def change_placement(self, data):
        active = sorted(self.expected)
        if not active:
            return
        chosen = data.draw(st.lists(st.sampled_from(active), unique=True, min_size=1, max_size=3))
        new = {r: tuple(data.draw(rows)) for r in chosen}
        before = self.cache.placements()
        used_before = self.peak = self.cache.device_pool.allocator.used_count
        try:
            self.cache.install_placement(new)
        except DevicePoolFull:
            assert self.cache.placements() == before
            return
        self.expected.update(new)
        # Offloads run first and staging slots move without allocation, so an install never
        # holds more blocks than max(before, after): no transient overshoot of the budget.
        assert self.peak <= max(used_before, self.cache.device_pool.allocator.used_count)

    @rule(data=st.data())
    def prepare_then_abort(self, data):
        active = sorted(self.expected)
        if not active:
            return
        rid = data.draw(st.sampled_from(active))
        before = self.cache.placements()
        op = self.cache.prepare_placement({rid: tuple(data.draw(rows))})
        if op is not None:  # prepare may have reclaimed paused layers: lossless and kept
            self.cache.complete_placement(op, success=False)
        assert self.cache.placements() == before

    @rule(data=st.data())
    def pause(self, data):
        active = sorted(self.expected)
        if not active:
            return
        rid = data.draw(st.sampled_from(active))
        self.cache.pause(rid)
        self.paused[rid] = self.expected.pop(rid)

    @rule(data=st.data(), row=st.none() | rows)
    def resume(self, data, row):
        if not self.paused:
            return
        rid = data.draw(st.sampled_from(sorted(self.paused)))
        try:
            self.cache.resume(rid, row)
        except DevicePoolFull:
            assert self.cache.is_paused(rid)
            return
        self.expected[rid] = tuple(row) if row is not None else self.paused[rid]
        del self.paused[rid]

    @rule(rid=consumes(requests))
    def finish(self, rid):
        if rid not in self.shadow:
            return
        self.cache.free(rid)
        del self.shadow[rid]
        self.expected.pop(rid, None)
        self.paused.pop(rid, None)

    @invariant()
    def kv_exact_and_memory_accounted(self):
        LayeredKVMachine.total_steps += 1
        usage = self.cache.check_invariants()
        assert self.cache.placements() == self.expected
        rids = sorted(self.expected)
        resident, staging = memory_blocks(
            [self.expected[r] for r in rids], [self.cache.blocks(r) for r in rids]
        )
        used = self.cache.device_pool.allocator.used_count
        assert used - usage.removable_blocks == resident + staging <= self.cache.config.device_blocks
        assert_matches_shadow(self.cache, self.shadow)


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
MIN_TOTAL_STEPS = 1000


def test_random_lifecycles_keep_kv_exact_and_memory_accounted():
    """Random lifecycles (>= 1,000 checked steps in all) keep KV exact and memory accounted."""
    LayeredKVMachine.total_steps = 0
    run_state_machine_as_test(LayeredKVMachine, settings=SETTINGS)
    print("stateful steps checked:", LayeredKVMachine.total_steps)
    assert LayeredKVMachine.total_steps >= MIN_TOTAL_STEPS
