"""kernels.batched_memcpy on the CPU: the pointer arithmetic a batched memcpy is given (replayed
here with ``ctypes.memmove``, row for row as the copy engines would) equals the torch reference
``dst[dst_idx] = src[src_idx]``, and a shifted pointer is caught; without a CUDA driver the
binding refuses with a message naming it, and the subprocess probe reports why instead of
crashing. The copies on the copy engines themselves are ``gpu`` tests (tests/dataplane/test_gpu.py)."""

import ctypes

import numpy as np
import pytest
import torch

from kernels.batched_memcpy import BatchedMemcpy, probe_in_subprocess, segment_pointers


def _replay(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_pointers_replayed_equal_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    src = (torch.rand((12, 48), generator=gen) * 100).to(dtype)
    dst = torch.zeros((9, 48), dtype=dtype)
    src_idx, dst_idx = np.array([3, 0, 11, 7, 7]), np.array([8, 1, 0, 4, 2])
    want = dst.clone()
    want[torch.from_numpy(dst_idx)] = src[torch.from_numpy(src_idx)]
    dsts, srcs, sizes = segment_pointers(src, dst, src_idx, dst_idx)
    assert dsts.dtype == srcs.dtype == sizes.dtype == np.uint64 and set(sizes.tolist()) == {48 * src.element_size()}
    _replay(dsts, srcs, sizes)
    assert torch.equal(dst, want)


def test_a_shifted_pointer_is_caught():
    """Negative control: one row off in the source gives a different result."""
    src = torch.arange(40, dtype=torch.float32).view(10, 4)
    dst = torch.zeros(3, 4)
    want = src[[2, 5, 9]]
    dsts, srcs, sizes = segment_pointers(src, dst, np.array([2, 5, 9]), np.array([0, 1, 2]))
    _replay(dsts, srcs + np.uint64(4 * 4), sizes)
    assert not torch.equal(dst, want)


def test_views_of_a_pool_address_their_own_rows():
    """Token rows of a block-first pool view (the host pool as ``[rows, H * D]``) and a device-side
    buffer of another shape but the same row bytes: the pointers address the right rows."""
    pool = torch.arange(2 * 3 * 2 * 4 * 8, dtype=torch.float32).view(2, 3, 2, 4, 8)  # [P, L, 2, ps, H*D]
    rows = pool.view(-1, 8)
    buf = torch.full((2, 2, 3, 2, 4), -1.0)  # [S, 2, m, H, D] -> rows of 8 floats
    src_rows = buf.view(-1, 8)
    src_rows[torch.arange(src_rows.shape[0])] = torch.arange(src_rows.shape[0], dtype=torch.float32)[:, None]
    dst_idx = np.array([5, 17, 40])
    _replay(*segment_pointers(src_rows, rows, np.array([0, 3, 11]), dst_idx))
    assert rows[5].eq(0).all() and rows[17].eq(3).all() and rows[40].eq(11).all()


def test_bad_tensors_are_refused():
    with pytest.raises(ValueError, match="equal row bytes"):
        segment_pointers(torch.zeros(2, 4), torch.zeros(2, 3), np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="contiguous"):
        segment_pointers(torch.zeros(4, 2).t(), torch.zeros(2, 4), np.array([0]), np.array([0]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host has the driver")
def test_without_a_driver_the_binding_and_the_probe_say_why():
    with pytest.raises(RuntimeError, match="CUDA driver library is not loadable"):
        BatchedMemcpy()
    why = probe_in_subprocess()
    assert why is not None and "not loadable" in why


def test_the_probes_registered_pages_are_locked_while_used_and_released_after():
    """``registered_pages`` (both probes' registered pageable memory): an anonymous mapping of
    ``PROBE_BYTES``, page-aligned, registered with the driver for the block and unregistered
    after, also when the block raises (a recording registrar stands in for the driver)."""
    from kernels.batched_memcpy import PROBE_BYTES, registered_pages

    calls: list[tuple] = []
    registrar = type("Registrar", (), {"register": lambda self, p, n: calls.append(("register", p, n)),
                                       "unregister": lambda self, p: calls.append(("unregister", p))})()
    with pytest.raises(KeyError), registered_pages(registrar) as whole:
        assert whole.numel() * 4 == PROBE_BYTES and whole.data_ptr() % 4096 == 0
        assert calls == [("register", whole.data_ptr(), PROBE_BYTES)]
        raise KeyError("the block fails")
    assert calls[-1] == ("unregister", calls[0][1]) and len(calls) == 2


def test_the_probes_registered_pages_make_the_device_current_before_registering(monkeypatch):
    """Given a device, ``registered_pages`` makes its context current BEFORE the driver registers
    (a fresh probe child has no context: ``cuMemHostRegister`` failed with CUresult 3 on an H200,
    gpu-check run 17). Control: without a device nothing is made current (the caller's is)."""
    import kernels.batched_memcpy as bm

    calls: list[tuple] = []
    monkeypatch.setattr(bm, "make_current", lambda device: calls.append(("current", device)))  # returns None
    registrar = type("Registrar", (), {"register": lambda self, p, n: calls.append(("register",)),
                                       "unregister": lambda self, p: calls.append(("unregister",))})()
    with bm.registered_pages(registrar, "cuda:1"):
        assert calls == [("current", "cuda:1"), ("register",)]
    calls.clear()
    with bm.registered_pages(registrar):
        assert calls == [("register",)]


def test_the_probes_sources_hold_known_rows(monkeypatch):
    """``probe_sources``: known rows in ``pin_memory()`` memory (a copy here: no CUDA) and other
    known rows in the registered buffer, then the pool's first three rows; a probe compares what
    comes back with these bytes."""
    from kernels.batched_memcpy import probe_sources

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self.clone())
    whole, pool = torch.zeros(64), torch.arange(12, dtype=torch.float32).view(3, 4)
    pinned, registered, first = probe_sources(whole, 3, pool)
    assert torch.equal(pinned + 10, registered) and registered.data_ptr() == whole.data_ptr()
    assert registered[2].tolist() == [18.0, 19.0, 20.0, 21.0] and torch.equal(first, pool[:3])
    assert len(probe_sources(whole, 2, None)) == 2
