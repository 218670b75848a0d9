"""The served default, ``--kv-copy-engine dma``, on the CUDA engine's path (simulated streams on
the CPU, ``cuda_simulation.py``): the engine a store builds with ``copy_engine="dma"`` probes the
copy engines at construction and then serves every fetch and write-back on them, or -- where the
probe fails, as it does for real on this host without a CUDA driver -- keeps the Triton kernels,
says why, and serves the same KV bit-exact."""

from __future__ import annotations

import ctypes

import pytest
import torch

from sglang_ext.dataplane import cuda_transfer_engine as cte
from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from tests.dataplane.core_driver import (
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    PAGES,
    CoreDriver,
    offload_scenario,
)
from tests.dataplane.cuda_simulation import install, track_core
from tests.dataplane.pointer_memcpy import PointerMemcpy


def _simulate(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    """The simulated CUDA path; its pools live on the CPU (no device index): ordinal 0 is asked."""
    sim = install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return sim


def _core(copy_engine: str) -> LayeredKVCore:
    return LayeredKVCore(SlotStoreConfig(layers=LAYERS, page_size=PAGE, kv_heads=HEADS, head_dim=DIM,
                                         logical_pages=PAGES, device_pages=PAGES + 6, dtype=torch.float32,
                                         device="cpu", copy_engine=copy_engine))


def _serve(sim, core: LayeredKVCore) -> None:  # noqa: ANN001
    track_core(sim, core)
    with sim.tracer():
        offload_scenario(CoreDriver(core, seed=3))
    assert sim.violations == [], sim.violations[:3]


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_driver_loads(), reason="the probe child finds a CUDA driver on this host")
def test_where_the_probe_fails_the_default_keeps_the_kernels_and_says_why(monkeypatch):
    """The real probe child runs (``python -m kernels.pitched_memcpy``) and finds no driver here:
    the engine keeps the kernels, with the child's reason, and the lifecycle is bit-exact on them."""
    sim = _simulate(monkeypatch)
    core = _core("dma")
    engine = core.store.engine
    assert isinstance(engine, cte.CudaTransferEngine)
    assert engine.impl == "triton" and engine._dma is None
    assert engine.dma_error is not None and "not loadable" in engine.dma_error, engine.dma_error
    _serve(sim, core)
    assert sim.copies["kernel"] > 0


def test_on_rocm_the_default_keeps_the_kernels_without_a_probe(monkeypatch):
    """A ROCm build has none of the CUDA driver calls the copy engines are: ``dma`` keeps the
    Triton kernels and says why without starting the probe child; the lifecycle is bit-exact on
    the kernels. Control: the same build without ``torch.version.hip`` asks the probe."""
    sim = _simulate(monkeypatch)
    asked: list[int] = []
    monkeypatch.setattr(cte, "probe_copy_engines", lambda device: asked.append(device) or ("no driver", "no driver"))
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    core = _core("dma")
    engine = core.store.engine
    assert engine.impl == "triton" and engine._dma is None and asked == []
    assert engine.dma_error == cte.ROCM_NO_COPY_ENGINES
    _serve(sim, core)
    assert sim.copies["kernel"] > 0
    monkeypatch.setattr(torch.version, "hip", None)
    control = _core("dma").store.engine
    assert asked == [0] and control.dma_error == "no driver"


def test_once_probed_the_default_serves_on_the_copy_engines(monkeypatch):
    """With the probes passing (the driver's calls replayed at the pointer level), the engine is on
    the copy engines when construction ends: every copy of the lifecycle goes there, none to the
    kernels, bit-exact. Control: ``copy_engine="triton"`` builds an engine that never asks."""
    sim = _simulate(monkeypatch)
    asked: list[int] = []
    monkeypatch.setattr(cte, "probe_copy_engines", lambda device: asked.append(device) or (None, None))
    monkeypatch.setattr(cte, "BatchedMemcpy", lambda: PointerMemcpy(sim))
    monkeypatch.setattr(cte, "PitchedMemcpy", lambda: PointerMemcpy(sim))
    monkeypatch.setattr(cte, "probe_dma", lambda dma, device, host: None)
    monkeypatch.setattr(cte, "probe_pitched", lambda pitched, device, host: None)
    monkeypatch.setattr(cte, "DMA_MIN_BYTES", 0)  # the toy rows are small: the copy engines take them
    monkeypatch.setattr(PointerMemcpy, "max_pitch", lambda self, ordinal: 1 << 30, raising=False)
    core = _core("dma")
    engine = core.store.engine
    assert engine.impl == "dma" and engine.dma_error is None and engine.pitched_error is None, engine.dma_error
    assert len(asked) == 1
    warmed = sim.copies["kernel"]  # the store's warm-up compile of the token-row copy, at construction
    _serve(sim, core)
    assert engine._dma.copies > 0 and engine._pitched.runs > 0, (engine._dma.copies, engine._pitched.runs)
    assert sim.copies["kernel"] == warmed, sim.copies  # nothing served on the kernels
    control = _core("triton").store.engine
    assert control.impl == "triton" and control._dma is None and len(asked) == 1
