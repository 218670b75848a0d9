"""The host KV pool: sized to what the store needs, pinned at exactly that size (issue 14 item 4).

PyTorch's pinned allocator (``torch.zeros(..., pin_memory=True)``) rounds every request up to a
power of two and zero-fills it: a 40 GB pool would pin 64 GiB and write all of it at start. The
pool is instead allocated pageable and unfilled (``torch.empty``: the kernel maps zero pages on
first touch) and then page-locked in place with ``cudaHostRegister`` -- exactly its size, no
copy -- and unregistered when the tensor dies. On CPU nothing is pinned (and the pool is zeroed:
the test sizes are small and at-rest reads of never-written pages then read zeros).

:func:`host_pool_limit` is the launch check: without ``--kv-host-pool-gb`` the pool may take up
to :data:`AVAILABLE_SHARE` of the host's available memory (the least of ``MemAvailable`` and the
process's cgroup limits: :func:`~sglang_ext.dataplane.host_memory_share.available_host_bytes`), and the
pools of all the launch's scheduler processes on the host together may take that share of what
the host had when the server was launched (:class:`~sglang_ext.dataplane.host_memory_share.HostMemoryShare`);
either way a pool that cannot hold every layer of every page (what the store keeps on the host)
fails at start with the figures and what to change.
"""

from __future__ import annotations

import ctypes
import time
import weakref
from collections.abc import Callable
from typing import Any

import structlog
import torch

from kernels.pitched_memcpy import device_attribute
from sglang_ext.dataplane.host_memory_share import HostMemoryShare, available_host_bytes

__all__ = ["AVAILABLE_SHARE", "GB", "HostMemoryShare", "allocate_host_pool", "available_host_bytes", "host_pool_limit",
           "registered_host_pointers", "release_registration"]

GB = 1e9
AVAILABLE_SHARE = 0.8
"""Share of the host's available memory a pool sized by default may take."""
log = structlog.get_logger(__name__)
CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
"""``CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`` (``cuda.h``)."""


def host_pool_limit(needed_bytes: int, cap_gb: float | None, available: int | None,
                    *, what: str, device_in_host_bytes: int = 0, share: HostMemoryShare | None = None,
                    host_tier: bool = True) -> None:
    """Raise ValueError, with the figures and the remedy, when the host pool of ``needed_bytes``
    (``what`` says what it holds) exceeds ``--kv-host-pool-gb`` (``cap_gb``) or, without one,
    :data:`AVAILABLE_SHARE` of the host's ``available`` memory -- together with the device pool
    when that lives in host memory too (``device_in_host_bytes``: ``--device cpu``, where a
    launch without ``--max-total-tokens`` sized both pools from the same free memory and the
    scheduler was killed for memory) -- or when the pools of the ``share.ranks`` scheduler
    processes of the launch on this host exceed that share of what it had at launch.
    ``host_tier`` False: every layer is on the device (no host pool, or only the copy engine's
    scratch page), so a smaller device budget would add a host pool, not save memory: the
    combined refusal does not suggest one."""
    need = needed_bytes / GB
    if cap_gb is not None:
        if needed_bytes > cap_gb * GB:
            raise ValueError(
                f"--kv-host-pool-gb={cap_gb}: the host KV pool must hold {what} = {need:.3f} GB; "
                "raise it or lower --max-total-tokens"
            )
        return
    per_rank = needed_bytes + device_in_host_bytes
    if share is not None and share.ranks > 1 and share.available_bytes is not None and (
        share.ranks * per_rank > AVAILABLE_SHARE * share.available_bytes
    ):
        each = f"{what} = {need:.3f} GB" + (
            f" and its device KV pool, host memory on CPU, {device_in_host_bytes / GB:.3f} GB" if device_in_host_bytes
            else "")
        raise ValueError(
            f"the {share.ranks} scheduler processes this launch starts on this host (--tp-size x --pp-size x "
            f"--dp-size / --nnodes) each pin a host KV pool of {each}: {share.ranks * per_rank / GB:.3f} GB in all, "
            f"more than {AVAILABLE_SHARE:.0%} of the host's available memory when the server was launched "
            f"({share.available_bytes / GB:.3f} GB, cgroup memory limits counted); lower --max-total-tokens "
            "(or set --kv-host-pool-gb to override the check)"
        )
    # the host pool alone first: where it does not fit, no device budget helps
    if available is not None and needed_bytes > AVAILABLE_SHARE * available:
        raise ValueError(
            f"the host KV pool must hold {what} = {need:.3f} GB, more than "
            f"{AVAILABLE_SHARE:.0%} of the host's available memory ({available / GB:.3f} GB, cgroup "
            "memory limits counted); lower --max-total-tokens (or set --kv-host-pool-gb to override the check)"
        )
    if available is not None and device_in_host_bytes and (
        needed_bytes + device_in_host_bytes > AVAILABLE_SHARE * available
    ):
        both = (needed_bytes + device_in_host_bytes) / GB
        raise ValueError(
            f"the host KV pool ({what} = {need:.3f} GB) and the device KV pool, which on CPU is "
            f"host memory too ({device_in_host_bytes / GB:.3f} GB), need {both:.3f} GB, more than "
            f"{AVAILABLE_SHARE:.0%} of the host's available memory ({available / GB:.3f} GB); "
            "lower --max-total-tokens" + (" or --kv-gpu-budget-tokens (a smaller device pool)" if host_tier else "")
            + " (or set --kv-host-pool-gb to override the check)"
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
        log.info("host_kv_pool_pinning", gb=round(nbytes / GB, 3),
                 note="page-locking faults in every page: seconds per tens of GB")
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(pool.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the {nbytes / GB:.3f} GB host KV pool failed: {err}")
        weakref.finalize(pool, release_registration, cudart, pool.data_ptr(), torch.cuda.current_device())
        # registering faults in and locks every page: seconds per tens of GB, at start-up
        log.info("host_kv_pool_pinned", gb=round(nbytes / GB, 3), seconds=round(time.perf_counter() - t0, 2))
    return pool


def release_registration(cudart: Any, pointer: int, device: int, synchronize: Callable[[int], None] | None = None) -> None:
    """Finalizer of a pool registered by :func:`allocate_host_pool`: wait for CUDA ``device``'s
    work first (a copy still in flight reads or writes the pool's pages, and unregistering under
    it is undefined), then unregister. A failed wait (CUDA already torn down at interpreter exit)
    does not keep the pages locked. ``synchronize``: ``torch.cuda.synchronize`` (tests pass their own)."""
    try:
        if synchronize is None and torch.cuda.is_current_stream_capturing():
            # collected mid-capture (a tool capturing graphs in the same process): a device-wide
            # sync would invalidate the capture; the graph's own copies cannot read a dead pool
            log.warning("host_kv_pool_release_during_capture")
        else:
            (synchronize or torch.cuda.synchronize)(device)
    except Exception:  # noqa: BLE001 - the unregister below must still run
        log.warning("host_kv_pool_release_without_sync", exc_info=True)
    cudart.cudaHostUnregister(pointer)


def registered_host_pointers(device: torch.device, driver: str = "libcuda.so.1") -> bool | None:
    """Whether kernels on CUDA ``device`` may address registered host memory (the pool:
    :func:`allocate_host_pool`) by its host pointer, as kvplane's Triton copy kernels do
    (``CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``; memory from
    ``cudaHostAlloc`` is not in question); None where the driver cannot say (no ``libcuda``, as
    on ROCm). CUDA must be initialised (the caller holds device tensors)."""
    try:
        lib = ctypes.CDLL(driver)
    except OSError:
        return None
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    value = device_attribute(lib, index, CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM)
    return None if value is None else value != 0
