"""Host KV pool sizing and allocation (issue 14 item 4): the launch check's figures and remedies,
exact-size pinning (GPU), zeros on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.dataplane.host_pool import (
    AVAILABLE_SHARE,
    GB,
    allocate_host_pool,
    available_host_bytes,
    host_pool_limit,
)


def test_explicit_cap_refuses_a_pool_it_cannot_hold_and_names_the_remedy():
    host_pool_limit(int(1.9 * GB), 2.0, None, what="every layer")  # fits: no error
    with pytest.raises(ValueError) as err:
        host_pool_limit(int(2.5 * GB), 2.0, 10**15, what="every layer of 100 pages")
    assert str(err.value) == (
        "--kv-host-pool-gb=2.0: the host KV pool must hold every layer of 100 pages = 2.500 GB; "
        "raise it or lower --max-total-tokens"
    )


def test_default_is_checked_against_available_memory():
    host_pool_limit(int(7 * GB), None, int(10 * GB), what="x")  # 7 <= 0.8 * 10
    with pytest.raises(ValueError, match=r"more than 80% of the host's available memory \(10.000 GB\)"):
        host_pool_limit(int(8.5 * GB), None, int(10 * GB), what="x")
    host_pool_limit(int(8.5 * GB), 9.0, int(10 * GB), what="x")  # an explicit cap overrides the check
    host_pool_limit(int(1e15), None, None, what="x")  # unknown availability: SGLang's own limits apply
    assert AVAILABLE_SHARE == 0.8


def test_on_cpu_the_device_pool_counts_against_available_memory_too():
    """--device cpu: the device KV pool is host memory as well. A launch without
    --max-total-tokens had SGLang size 30 M tokens on a 23 GB host: 15.4 GB of host pool passed
    the check alone, and the scheduler was killed for memory once the device pool (as large)
    was allocated too. Control: the same host pool alone passes; an explicit cap overrides."""
    host_pool_limit(int(5 * GB), None, int(10 * GB), what="x")  # alone: 5 <= 8
    with pytest.raises(ValueError) as err:
        host_pool_limit(int(5 * GB), None, int(10 * GB), what="x", device_in_host_bytes=int(5 * GB))
    message = str(err.value)
    assert "device KV pool, which on CPU is host memory too (5.000 GB), need 10.000 GB" in message
    assert "--kv-gpu-budget-tokens" in message and "--max-total-tokens" in message
    host_pool_limit(int(5 * GB), None, int(10 * GB), what="x", device_in_host_bytes=int(2 * GB))
    host_pool_limit(int(5 * GB), 6.0, int(10 * GB), what="x", device_in_host_bytes=int(5 * GB))


def test_available_memory_is_read_from_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemAvailable:   12000000 kB\n")
    assert available_host_bytes(f) == 12_000_000 * 1024
    f.write_text("MemTotal: 1 kB\n")
    assert available_host_bytes(f) is None
    assert available_host_bytes(tmp_path / "missing") is None
    real = available_host_bytes()
    assert real is None or real > 0


def test_cpu_pool_is_zeroed_and_unpinned():
    pool = allocate_host_pool((3, 4, 2), torch.float32, pin=False)
    assert pool.shape == (3, 4, 2) and not pool.is_pinned() and torch.count_nonzero(pool) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_is_pinned_at_exactly_its_size():
    """An odd size (not a power of two) is pinned as is and is a valid DMA source."""
    shape = (3 * 1024 * 1024 + 7,)
    pool = allocate_host_pool(shape, torch.float16, pin=True)
    assert pool.is_pinned() and pool.numel() == shape[0]
    pool[:16] = 1.0
    dev = pool[:16].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert bool((dev == 1.0).all())
