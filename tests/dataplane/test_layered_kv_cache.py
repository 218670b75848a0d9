"""LayeredKVCache on CPU: tables, eager write-back, placement delta, pause/resume, errors."""

import pytest

from controlplane.model import memory_blocks
from sglang_ext.dataplane import (
    DevicePoolFull,
    HostPoolFull,
    LayeredKVCache,
    LayeredKVConfig,
    RequestStateError,
    UnknownRequest,
)
from tests.dataplane.harness import assert_matches_shadow, empty_shadow, run_step, small_config


def _cache(**over: object) -> tuple[LayeredKVCache, dict]:
    cache = LayeredKVCache(small_config(**over))
    return cache, {}


def _new(cache: LayeredKVCache, shadow: dict, rid: str, tokens: int, seed: int = 0, placement=None) -> None:
    cache.alloc_request(rid, placement)
    shadow[rid] = empty_shadow(cache.config)
    run_step(cache, {rid: tokens}, shadow, seed)


def test_append_locations_follow_the_block_table():
    """Write slots of resident layers are their own blocks; offloaded layers share the staging slot."""
    cache, shadow = _cache()
    cache.alloc_request("a", [1, 0, 1, 0])
    res = cache.append_tokens("a", 6)
    t = cache._reqs["a"]
    bs = cache.config.block_size
    for layer in range(4):
        pages = t.dev[layer] if t.dev[layer] is not None else t.staging
        expected = [pages[p // bs] * bs + p % bs for p in range(6)]
        assert res.locs[layer].tolist() == expected
    assert res.locs[1].tolist() == res.locs[3].tolist()
    assert len({tuple(res.locs[layer].tolist()) for layer in range(4)}) == 3


def test_kv_survives_offload_and_onload_bit_exact():
    """KV written through steps reads back identical after offloading and fetching every layer."""
    cache, shadow = _cache()
    _new(cache, shadow, "a", 10, seed=1)
    run_step(cache, {"a": 1}, shadow, 2)
    cache.install_placement({"a": [0, 0, 0, 0]})
    assert_matches_shadow(cache, shadow)
    run_step(cache, {"a": 3}, shadow, 3)  # new tokens of offloaded layers go through staging
    assert_matches_shadow(cache, shadow)
    cache.install_placement({"a": [1, 0, 1, 1]})
    run_step(cache, {"a": 2}, shadow, 4)
    assert_matches_shadow(cache, shadow)
    cache.check_invariants()


def test_offload_writes_back_only_the_dirty_tail():
    """Eager write-back: offloading a layer of a 10-token request (bs 4) moves one block D2H."""
    cache, shadow = _cache()
    _new(cache, shadow, "a", 10, seed=1)
    report = cache.install_placement({"a": [1, 0, 0, 1]})
    assert report.offloaded_layers == 2
    assert report.d2h_blocks == 2  # one dirty tail per layer; the two full blocks were synced
    assert report.h2d_blocks == 0
    assert_matches_shadow(cache, shadow)


def test_device_use_equals_the_model_accounting():
    """Resident + staging blocks equal controlplane.model.memory_blocks of the placement."""
    cache, shadow = _cache()
    _new(cache, shadow, "a", 9)
    _new(cache, shadow, "b", 4)
    cache.install_placement({"a": [1, 0, 1, 0], "b": [1, 1, 1, 1]})
    usage = cache.check_invariants()
    assert (usage.resident_blocks, usage.staging_blocks) == memory_blocks(
        [[1, 0, 1, 0], [1, 1, 1, 1]], [3, 1]
    )
    assert cache.device_pool.allocator.used_count == 3 * 2 + 3 + 4


def test_full_device_pool_is_a_clear_error_and_loses_nothing():
    """A placement that cannot fit raises DevicePoolFull naming the numbers; state is unchanged."""
    cache, shadow = _cache(device_blocks=11)
    _new(cache, shadow, "a", 8)  # 2 blocks x 4 layers
    _new(cache, shadow, "b", 4, placement=[1, 0, 0, 0])  # 1 resident + 1 staging; 1 free
    before = cache.placements()
    with pytest.raises(DevicePoolFull, match=r"needs \d+ more blocks, \d+ free"):
        cache.install_placement({"b": [1, 1, 1, 1]})  # needs 4, holds 2, 1 free
    assert cache.placements() == before
    with pytest.raises(DevicePoolFull):
        cache.append_tokens("a", 9)
    assert cache.tokens("a") == 8
    cache.check_invariants()
    assert_matches_shadow(cache, shadow)


def test_host_pool_full_is_a_clear_error():
    """Exhausting the host pool raises HostPoolFull and leaves the request as it was."""
    cache, shadow = _cache(host_blocks=3)
    _new(cache, shadow, "a", 8)
    with pytest.raises(HostPoolFull, match="host_pool_gb"):
        cache.append_tokens("a", 5)
    assert cache.tokens("a") == 8
    cache.check_invariants()


def test_paused_layers_reclaimed_lazily_highest_first_and_resume_fetches_only_dropped():
    """Pause keeps GPU layers; space pressure drops the highest layers; resume fetches just those."""
    cache, shadow = _cache(device_blocks=12)
    _new(cache, shadow, "a", 8)  # 8 blocks
    cache.pause("a")
    assert cache.placement("a") == (1, 1, 1, 1)
    assert cache.memory_usage().removable_blocks == 8
    _new(cache, shadow, "b", 8)  # needs 8, 4 free -> drop a's layers 3 and 2
    assert cache.placement("a") == (1, 1, 0, 0)
    assert_matches_shadow(cache, shadow)
    cache.free("b")
    del shadow["b"]
    report = cache.resume("a")
    assert report.h2d_blocks == 4 and report.onloaded_layers == 2
    assert cache.placement("a") == (1, 1, 1, 1)
    run_step(cache, {"a": 1}, shadow, 9)
    assert_matches_shadow(cache, shadow)
    cache.check_invariants()


def test_resume_that_cannot_fit_keeps_the_request_paused():
    """resume raises DevicePoolFull and the request stays paused with its KV intact."""
    cache, shadow = _cache(device_blocks=12)
    _new(cache, shadow, "a", 8)
    cache.pause("a")
    _new(cache, shadow, "b", 12)  # 12 blocks: drops all of a's layers
    assert cache.placement("a") == (0, 0, 0, 0)
    with pytest.raises(DevicePoolFull):
        cache.resume("a")
    assert cache.is_paused("a")
    assert_matches_shadow(cache, shadow)
    cache.check_invariants()


def test_two_phase_failure_changes_nothing():
    """prepare_placement + complete_placement(success=False) leaves tables and allocators as before."""
    cache, shadow = _cache()
    _new(cache, shadow, "a", 7)
    cache.install_placement({"a": [0, 1, 0, 1]})
    used = cache.device_pool.allocator.used_count
    op = cache.prepare_placement({"a": [1, 1, 1, 0]})
    assert op is not None and len(op.onloads) == 2 and len(op.offloads) == 1
    with pytest.raises(RequestStateError):
        cache.append_tokens("a", 1)
    cache.complete_placement(op, success=False)
    assert cache.placement("a") == (0, 1, 0, 1)
    assert cache.device_pool.allocator.used_count == used
    assert_matches_shadow(cache, shadow)
    op = cache.prepare_placement({"a": [1, 1, 1, 0]})
    cache.complete_placement(op, success=True)
    assert cache.placement("a") == (1, 1, 1, 0)
    assert_matches_shadow(cache, shadow)
    cache.check_invariants()


def test_bad_input_is_rejected_with_the_field():
    """Wrong lengths, values, unknown ids and out-of-order step calls raise clear errors."""
    cache, shadow = _cache()
    _new(cache, shadow, "a", 3)
    with pytest.raises(ValueError, match=r"placement\['a'\] must have 4 entries"):
        cache.install_placement({"a": [1, 0]})
    with pytest.raises(ValueError, match=r"placement\['a'\]\[1\] = 2"):
        cache.install_placement({"a": [1, 2, 1, 1]})
    with pytest.raises(UnknownRequest, match="'zz'"):
        cache.install_placement({"zz": [1, 1, 1, 1]})
    with pytest.raises(ValueError, match="n = 0"):
        cache.append_tokens("a", 0)
    with pytest.raises(RequestStateError, match="already exists"):
        cache.alloc_request("a")
    cache.append_tokens("a", 1)
    with pytest.raises(RequestStateError, match="not in the step"):
        cache.begin_step([])
    cache.begin_step(["a"])
    with pytest.raises(RequestStateError, match="expected layer 0"):
        cache.end_layer(1)
    with pytest.raises(RequestStateError, match="step is in flight"):
        cache.pause("a")
    with pytest.raises(ValueError, match="device_blocks"):
        LayeredKVConfig(layers=2, block_size=4, kv_heads=1, head_dim=4, device_blocks=0, host_pool_gb=1)
    with pytest.raises(ValueError, match="host_pool_gb"):
        LayeredKVConfig(layers=2, block_size=4, kv_heads=1, head_dim=4, device_blocks=4, host_pool_gb=1e-12)


def test_one_launch_per_direction_per_layer_boundary():
    """A decode step with 3 offloading requests does one H2D at step start and at most one
    D2H + one H2D per layer boundary, however many requests there are."""
    cache, shadow = _cache(device_blocks=60)
    for i, rid in enumerate("abc"):
        _new(cache, shadow, rid, 6 + i)
    cache.install_placement({r: [1, 0, 1, 0] for r in "abc"})
    stats = cache.engine.stats
    h0, d0 = stats.h2d_launches, stats.d2h_launches
    run_step(cache, {r: 1 for r in "abc"}, shadow, 5)
    assert stats.h2d_launches - h0 == 2  # layer 1 at start, layer 3 after layer 1
    assert stats.d2h_launches - d0 <= 2 + 1  # tails after layers 1 and 3, eager write-back
    assert_matches_shadow(cache, shadow)


def test_lifecycle_through_triton_interpreter(monkeypatch):
    """With TRITON_INTERPRET=1 the CPU engine moves blocks with the Triton kernel; KV stays exact."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cache, shadow = _cache()
    _new(cache, shadow, "a", 9, seed=3)
    _new(cache, shadow, "b", 5, seed=4)
    cache.install_placement({"a": [0, 1, 0, 1], "b": [0, 0, 0, 0]})
    run_step(cache, {"a": 2, "b": 1}, shadow, 5)
    cache.pause("b")
    cache.install_placement({"a": [1, 1, 1, 0]})
    cache.resume("b", [1, 0, 1, 1])
    run_step(cache, {"a": 1, "b": 4}, shadow, 6)
    assert_matches_shadow(cache, shadow)
    cache.check_invariants()


def test_fork_prefix_copies_kv_into_the_new_placement():
    """fork_prefix copies src's first n tokens into dst wherever dst's layers live; both stay exact."""
    cache, shadow = _cache()
    _new(cache, shadow, "a", 10, seed=1)
    cache.install_placement({"a": [1, 0, 1, 0]})
    cache.alloc_request("b", [1, 1, 0, 0])  # dd, hd, dh, hh copies
    cache.fork_prefix("a", "b", 7)
    shadow["b"] = [(k[:7].clone(), v[:7].clone()) for k, v in shadow["a"]]
    assert cache.tokens("b") == 7
    assert_matches_shadow(cache, shadow)
    run_step(cache, {"a": 1, "b": 2}, shadow, 11)
    cache.install_placement({"b": [0, 1, 1, 0]})
    assert_matches_shadow(cache, shadow)
    cache.check_invariants()
    with pytest.raises(RequestStateError, match="must be empty"):
        cache.fork_prefix("a", "b", 1)
    cache.alloc_request("c")
    with pytest.raises(ValueError, match=r"tokens = 99 out of range \[1, 11\]"):
        cache.fork_prefix("a", "c", 99)
