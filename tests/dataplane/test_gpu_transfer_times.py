"""Transfer timing on a GPU: the CUDA engine's EventClock with real CUDA events, in the served
core. The CPU tests run the same bookkeeping against fake events
(``tests/dataplane/test_transfer_clock.py``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.event_clock import EventClock
from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from tests.dataplane.core_driver import offloaded_driver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SEGMENTS = 4096
"""Segments per launch: 4096 x 32 KiB (16 tokens x 8 heads x 128 bf16) = 128 MiB."""
REPEAT = 5
PLAUSIBLE_GBPS = (1.0, 100.0)
"""A PCIe / C2C host link, one direction (an H100 on PCIe 5: ~50 GB/s)."""


def _link_core() -> LayeredKVCore:
    """Llama-like page shapes (page 16, 8 KV heads x 128, bf16), 2 layers, 1025 pages: 134 MB of
    pinned host pool and as much device pool."""
    return LayeredKVCore(SlotStoreConfig(layers=2, page_size=16, kv_heads=8, head_dim=128, logical_pages=1025,
                                         device_pages=2 * 1025, dtype=torch.bfloat16, device="cuda"))


def test_cuda_events_time_copies_and_the_compute_streams_wait():
    """Scenario: 6 batched H2D and 5 batched D2H launches of 128 MiB. The compute stream then
    waits on the last H2D. Once the GPU is done, closing the step (no sync in the data plane:
    sync debug mode is ``error`` around the launches and the harvest) books every pair. H2D and D2H
    seconds are > 0 and give a plausible link bandwidth (1-100 GB/s). The step's one stall
    observation equals the account's stall, and it is at least half of one H2D copy (the compute
    stream had nothing else to do) and at most the wall time of the whole scenario."""
    core = _link_core()
    eng = core.store.engine
    assert isinstance(eng.clock, EventClock)
    idx = eng.index_tensor(np.arange(SEGMENTS))
    host_idx = (np.arange(SEGMENTS), np.arange(SEGMENTS))
    eng.h2d(idx, idx, host_idx=host_idx)  # warm-up: Triton compiles the kernel for this segment size
    eng.d2h(idx, idx, host_idx=host_idx)
    torch.cuda.synchronize()
    core.close_transfer_step()
    times = core.transfer_times
    h0, d0, s0 = times.h2d_s, times.d2h_s, times.stall_s
    hb0, db0 = times.h2d_bytes, times.d2h_bytes
    t0 = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(REPEAT):
            eng.h2d(idx, idx, host_idx=host_idx)
            eng.d2h(idx, idx, host_idx=host_idx)
        last = eng.h2d(idx, idx, host_idx=host_idx)
        eng.stream_wait([last])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()  # the test waits for the GPU; the data plane never does
    wall_s = time.perf_counter() - t0
    torch.cuda.set_sync_debug_mode("error")
    try:
        observed = core.close_transfer_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    h2d_s, d2h_s, stall_s = times.h2d_s - h0, times.d2h_s - d0, times.stall_s - s0
    nbytes = SEGMENTS * eng.segment_bytes
    assert h2d_s > 0 and d2h_s > 0
    h2d_gbps, d2h_gbps = (REPEAT + 1) * nbytes / h2d_s / 1e9, REPEAT * nbytes / d2h_s / 1e9
    lo, hi = PLAUSIBLE_GBPS
    assert lo <= h2d_gbps <= hi, f"H2D {h2d_gbps:.2f} GB/s from events ({getattr(eng, 'impl', '?')})"
    assert lo <= d2h_gbps <= hi, f"D2H {d2h_gbps:.2f} GB/s from events ({getattr(eng, 'impl', '?')})"
    assert len(observed) == 1 and observed[0] == pytest.approx(stall_s)
    assert 0.5 * h2d_s / (REPEAT + 1) <= stall_s <= wall_s, (stall_s, h2d_s, wall_s)
    assert times.untimed == 0 and eng.clock.pending == 0 and eng.clock.pool.in_use == 0
    # the bytes are booked with their seconds: what was launched, once harvested
    assert (times.h2d_bytes - hb0, times.d2h_bytes - db0) == ((REPEAT + 1) * nbytes, REPEAT * nbytes)
    assert core.link_account is times  # the CUDA engine's copies run beside the compute: sampled
    stats = core.stats()
    assert (stats.h2d_seconds_total, stats.d2h_seconds_total, stats.stall_seconds_total) == (
        times.h2d_s, times.d2h_s, times.stall_s)


def test_served_steps_observe_one_stall_each_and_the_pool_stays_small():
    """The core's own steps on CUDA (two requests with layers 1 and 2 on host, so each decode
    step fetches and writes back). After each step (synchronised, as SGLang's result processing
    is) ``close_transfer_step`` observes exactly that step. Nothing goes untimed. The event pool
    holds about one step's pairs, however many steps ran (without reuse, 12 steps would need
    several times the bound). The stats carry the account's totals."""
    d = offloaded_driver(device="cuda")
    core = d.core
    clock = core.store.engine.clock
    assert isinstance(clock, EventClock)
    for _ in range(12):
        assert d.step([("a", 1), ("b", 1)])
        torch.cuda.synchronize()
        observed = core.close_transfer_step()
        assert len(observed) == 1 and observed[0] >= 0.0
    assert core.pipeline.layer_waits > 0 and core.stats().fetched_layer_pages_total > 0
    times = core.transfer_times
    assert times.h2d_s > 0 and times.d2h_s > 0 and times.untimed == 0
    assert clock.pending == 0 and clock.pool.in_use == 0
    assert 0 < clock.pool.created <= 4 * core.layers + 4, clock.pool.created
    stats = core.stats()
    assert (stats.h2d_seconds_total, stats.d2h_seconds_total, stats.stall_seconds_total) == (
        times.h2d_s, times.d2h_s, times.stall_s)
    d.check_at_rest()


def test_sampled_timing_on_cuda_times_one_step_in_n():
    """``--kv-timing-interval 4`` on CUDA (gaps fixed at 4), the core's own placed steps: timing
    events are recorded (pairs taken) on one step in 4 only, the metrics observe exactly those
    steps, the untimed copies and waits are counted as sampled out, and the totals (weighted)
    grow. Negative control: interval 1 observes every step (the test above)."""
    d = offloaded_driver(device="cuda")
    core = d.core
    clock = core.store.engine.clock
    assert isinstance(clock, EventClock)
    clock.set_interval(4, gap=lambda n: n)
    core.close_transfer_step()  # the first decision (untimed: the first timed step is a gap away)
    times = core.transfer_times
    h2d_before = times.h2d_s
    observed, pairs = [], []
    for _ in range(8):
        before = clock.pool.in_use
        assert d.step([("a", 1), ("b", 1)])
        pairs.append(clock.pool.in_use - before)
        torch.cuda.synchronize()
        observed.append(len(core.close_transfer_step()))
    timed = [i for i, n in enumerate(pairs) if n > 0]
    assert len(timed) == 2 and timed == [i for i, n in enumerate(observed) if n], (pairs, observed)
    assert times.sampled_out > 0 and times.untimed == 0 and times.h2d_s > h2d_before
    d.check_at_rest()
