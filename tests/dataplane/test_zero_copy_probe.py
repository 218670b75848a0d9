"""The Triton copy kernels' probe runs on the host pool's own memory, and never where the device
cannot address registered host memory by its host pointer (transfer review, session 54).

The pool is ``torch.empty`` + ``cudaHostRegister``; the probe used to copy through a fresh
``pin_memory()`` buffer (``cudaHostAlloc``), which every device can address. Where a device
reports ``CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`` = 0 that probe passed and the first real
copy faulted the context. Here the probe runs as the engine calls it, with the CPU reference
copy standing in for the kernel (there is no GPU here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels.block_copy import copy_segments_ref, word_view
from sglang_ext.dataplane import cuda_transfer_engine as cte
from sglang_ext.dataplane.host_pool import registered_host_pointers


def _engine(rows: int = 4) -> SimpleNamespace:
    host = torch.randn(rows, 8, dtype=torch.float32).to(torch.bfloat16)
    return SimpleNamespace(device=torch.device("cpu"), _words=(word_view(host), None), host=host)


@pytest.fixture
def calls(monkeypatch):
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(src, dst, src_idx, dst_idx, impl="auto", programs=None):
        assert impl == "triton"
        seen.append((src, dst))
        copy_segments_ref(src, dst, src_idx, dst_idx)

    monkeypatch.setattr(cte, "copy_segments", copy)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return seen


@pytest.mark.parametrize("answer", [True, None], ids=["device-says-yes", "driver-cannot-say"])
def test_the_probe_round_trips_two_rows_of_the_pool_itself_and_restores_them(monkeypatch, calls, answer):
    monkeypatch.setattr(cte, "registered_host_pointers", lambda device: answer)
    engine = _engine()
    before = engine.host.clone()
    assert cte.CudaTransferEngine._probe_zero_copy(engine) == "triton"
    pool_ptr = engine.host.data_ptr()
    assert [src.data_ptr() == pool_ptr for src, _ in calls] == [True, False]  # H2D from the pool
    assert [dst.data_ptr() == pool_ptr for _, dst in calls] == [False, True]  # D2H into the pool
    assert torch.equal(engine.host, before)  # the probe's rows restored


def test_a_device_that_cannot_address_registered_memory_keeps_the_kernels_off_it(monkeypatch, calls):
    """No kernel touches the pool (it would fault the context): the per-segment memcpy path."""
    monkeypatch.setattr(cte, "registered_host_pointers", lambda device: False)
    assert cte.CudaTransferEngine._probe_zero_copy(_engine()) == "memcpy"
    assert calls == []


def test_a_wrong_round_trip_selects_memcpy_and_still_restores_the_rows(monkeypatch):
    """Negative control: a copy that moves nothing fails the probe's comparison."""
    monkeypatch.setattr(cte, "registered_host_pointers", lambda device: True)
    monkeypatch.setattr(cte, "copy_segments", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    engine = _engine()
    before = engine.host.clone()
    assert cte.CudaTransferEngine._probe_zero_copy(engine) == "memcpy"
    assert torch.equal(engine.host, before)


def test_without_a_cuda_driver_the_attribute_is_unknown():
    assert registered_host_pointers(torch.device("cuda", 0), driver="libcuda-absent.so.1") is None
