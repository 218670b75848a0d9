"""Staged decode steps in CUDA graphs on a GPU: :class:`GraphStaging`'s launches on the engine's
real side streams (forks, per-layer events, joins), eagerly in the driver's lifecycle (bit-exact
reads) and captured in ``torch.cuda.CUDAGraph`` (replays vs eager twins; ``kvplane gpu-check``'s
staged probe at toy shapes). The CPU versions: ``test_graph_staging.py``,
``test_graph_staging_streams.py``, ``test_gpu_check_staged_graph.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_graph import CudaGraph
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.gpu_check_report import PASS
from sglang_ext.tools.gpu_check_staged_graph import StagedGraphProbe
from tests.dataplane import test_graph_staging as twins
from tests.dataplane.test_graph_staging_streams import _driver, _scenario

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_graphed_staged_lifecycle_bit_exact():
    """The driver's scenario (shared prefix, plan changes, a pause) with every decode step's layers
    run through the graph buffers on CUDA: the launches fork to the engine's streams and join back;
    every layer reads exactly the KV written, and the at-rest check finds every token."""
    d = _driver(device="cuda")
    got = _scenario(d)
    assert got["graphed"] >= 7 and got["fetched"] >= 5, (got, dict(d.graph_declined))


def test_cuda_replayed_staged_steps_equal_eager_twins():
    """Two identical batches, one eager, one boundary + admit + ``CUDAGraph`` replay: every layer's
    attention within float32 rounding (the replay's decode reads the buffers' wider page table,
    which may split the KV otherwise), the host pools equal bit for bit (the parked write-back in
    the graph), and the next eager steps equal. The capture timed the start lists' launches and
    the write-back on the side streams (``copy_marks``), and the replayed steps' bookings reached
    the engine's clock as measured H2D bytes."""
    eager, graphed, facts = twins._run(device="cuda", graph=CudaGraph)
    assert facts["copy_marks"] and facts["h2d_timed"] > 0, facts
    for a, b in zip(eager, graphed, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
    assert facts["host_equal"] and facts["replays"] == facts["graphed"] == twins.STEPS
    assert min(facts["fetches"]) > 0 and facts["kinds"] == {twins.START, twins.TRIG}


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_cuda_staged_graph_probe_passes(monkeypatch, backend):
    """``kvplane gpu-check``'s staged probe at toy shapes on CUDA, on FlashInfer's graph wrappers
    (planned before each replay: what serves by default) and on the Triton decode: the
    scrambled-staging replay and the eager step after the replays within tolerance of the dense
    reference, the replay equal to its layers rerun eagerly; a sampled replay's per-layer times
    come from the events its graph records (``GraphLayerMarks``), one positive time per layer."""
    ch = CoreCheck(dataclasses.replace(SMALL, layers=3, requests=2, repeat=2), "cuda", "torch")
    if backend not in ch.backends.available:
        pytest.skip(f"{backend} is not importable here")
    if backend == "triton":  # the probe takes FlashInfer's first where it is available
        monkeypatch.setattr(ch.backends, "available", tuple(n for n in ch.backends.available if n != "flashinfer"))
    ch.step()
    figures = {f.key: f for f in StagedGraphProbe(ch).run()}
    assert ch.details["graph_staged"]["backend"] == backend, ch.details["graph_staged"]["backends_failed"]
    for key in ("graph.staged.replay_vs_dense_err", "graph.staged.attention_err"):
        assert figures[key].status == PASS, figures[key]
    assert figures["graph.staged.replay_max_abs_diff"].value <= 1e-5, figures["graph.staged.replay_max_abs_diff"]
    layer_ms = ch.details["graph_staged"]["replay_layer_ms"]
    assert layer_ms is not None and len(layer_ms) == 3 and all(ms > 0 for ms in layer_ms), layer_ms
