"""The host KV pool: sized to what the store needs, pinned at exactly that size (issue 14 item 4).

PyTorch's pinned allocator (``torch.zeros(..., pin_memory=True)``) rounds every request up to a
power of two and zero-fills it: a 40 GB pool would pin 64 GiB and write all of it at start. The
pool is instead allocated pageable and unfilled (``torch.empty``: the kernel maps zero pages on
first touch) and then page-locked in place with ``cudaHostRegister`` -- exactly its size, no
copy -- and unregistered when the tensor dies. On CPU nothing is pinned (and the pool is zeroed:
the test sizes are small and at-rest reads of never-written pages then read zeros).

:func:`host_pool_limit` is the launch check: without ``--kv-host-pool-gb`` the pool may take up
to :data:`AVAILABLE_SHARE` of the host's available memory; either way a pool that cannot hold
every layer of every page (what the store keeps on the host) fails at start with the figures
and what to change.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

GB = 1e9
AVAILABLE_SHARE = 0.8
"""Share of the host's available memory a pool sized by default may take."""


def available_host_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of the host in bytes, None where it cannot be read."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_pool_limit(needed_bytes: int, cap_gb: float | None, available: int | None,
                    *, what: str, device_in_host_bytes: int = 0) -> None:
    """Raise ValueError, with the figures and the remedy, when the host pool of ``needed_bytes``
    (``what`` says what it holds) exceeds ``--kv-host-pool-gb`` (``cap_gb``) or, without one,
    :data:`AVAILABLE_SHARE` of the host's ``available`` memory -- together with the device pool
    when that lives in host memory too (``device_in_host_bytes``: ``--device cpu``, where a
    launch without ``--max-total-tokens`` sized both pools from the same free memory and the
    scheduler was killed for memory)."""
    need = needed_bytes / GB
    if cap_gb is not None:
        if needed_bytes > cap_gb * GB:
            raise ValueError(
                f"--kv-host-pool-gb={cap_gb}: the host KV pool must hold {what} = {need:.3f} GB; "
                "raise it or lower --max-total-tokens"
            )
        return
    if available is not None and device_in_host_bytes and (
        needed_bytes + device_in_host_bytes > AVAILABLE_SHARE * available
    ):
        both = (needed_bytes + device_in_host_bytes) / GB
        raise ValueError(
            f"the host KV pool ({what} = {need:.3f} GB) and the device KV pool, which on CPU is "
            f"host memory too ({device_in_host_bytes / GB:.3f} GB), need {both:.3f} GB, more than "
            f"{AVAILABLE_SHARE:.0%} of the host's available memory ({available / GB:.3f} GB); "
            "lower --max-total-tokens or set --kv-gpu-budget-tokens (or set --kv-host-pool-gb to "
            "override the check)"
        )
    if available is not None and needed_bytes > AVAILABLE_SHARE * available:
        raise ValueError(
            f"the host KV pool must hold {what} = {need:.3f} GB, more than "
            f"{AVAILABLE_SHARE:.0%} of the host's available memory ({available / GB:.3f} GB); "
            "lower --max-total-tokens (or set --kv-host-pool-gb to override the check)"
        )


def allocate_host_pool(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """The host pool tensor: on CUDA (``pin``) unfilled and page-locked at exactly its size;
    otherwise zeros in pageable memory."""
    if not pin:
        return torch.zeros(shape, dtype=dtype)
    pool = torch.empty(shape, dtype=dtype)
    nbytes = pool.numel() * pool.element_size()
    if nbytes:
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(pool.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the {nbytes / GB:.3f} GB host KV pool failed: {err}")
        weakref.finalize(pool, cudart.cudaHostUnregister, pool.data_ptr())
    return pool
