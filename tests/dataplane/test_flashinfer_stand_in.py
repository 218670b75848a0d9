"""``FlashInferStandIn`` (the tests' FlashInfer decode wrapper on the CPU, which the graph server
test serves through): its attention equals the paged-decode reference (soft cap and sliding
window included), a CUDA-graph wrapper's run reads the lengths of its last plan (so a replay
planned for another step reads that step's), and the FlashInfer behaviour it stands in for is
pinned to the installed FlashInfer's source. Controls: a plan of another step's lengths gives
another output; a wrong batch size or too many indices are refused as FlashInfer refuses them."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels.paged_decode import paged_decode_ref
from sglang_ext.testing.flashinfer_stand_in import FlashInferStandIn

PAGE, KV_HEADS, Q_HEADS, DIM, PAGES = 4, 2, 4, 16, 12


def _caches(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(PAGES, PAGE, KV_HEADS, DIM, generator=g) for _ in range(2))  # type: ignore[return-value]


def _csr(lens: list[int], order: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """indptr, indices (pages in ``order``), last_page_len and kv_lens of requests of ``lens`` tokens."""
    counts = [-(-n // PAGE) for n in lens]
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    indices = torch.tensor(order[: sum(counts)], dtype=torch.int32)
    last = torch.tensor([n - (c - 1) * PAGE for n, c in zip(lens, counts, strict=True)], dtype=torch.int32)
    return indptr, indices, last, torch.tensor(lens, dtype=torch.int32)


def _graph_wrapper(batch: int, width: int) -> FlashInferStandIn:
    i32 = torch.int32
    return FlashInferStandIn(torch.zeros(8), "NHD", use_cuda_graph=True, backend="fa2",
                             paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=i32),
                             paged_kv_indices_buffer=torch.zeros(width, dtype=i32),
                             paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=i32))


@pytest.mark.parametrize(("cap", "window"), [(0.0, -1), (5.0, -1), (0.0, 6), (3.0, 2)])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_attention_equals_the_reference(cap: float, window: int, graph: bool):
    k, v = _caches()
    lens, order = [9, 1, 16], [7, 2, 11, 0, 5, 3, 9, 1, 4, 6]
    indptr, indices, last, kv_lens = _csr(lens, order)
    q = torch.randn(len(lens), Q_HEADS, DIM, generator=torch.Generator().manual_seed(1))
    w = _graph_wrapper(len(lens), 10) if graph else FlashInferStandIn(torch.zeros(8), "NHD", backend="fa2")
    w.plan(indptr, indices, last, Q_HEADS, KV_HEADS, DIM, PAGE, window_left=window, logits_soft_cap=cap or None,
           sm_scale=0.3)
    got = w.run(q, (k, v))
    want = paged_decode_ref(q, k, v, indptr, indices, kv_lens, sm_scale=0.3, logits_soft_cap=cap, window_left=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if graph:  # control: planned for another step's lengths, the same run reads those
        w.plan(*_csr([8, 1, 16], order)[:3], Q_HEADS, KV_HEADS, DIM, PAGE, window_left=window,
               logits_soft_cap=cap or None, sm_scale=0.3)
        assert not torch.allclose(w.run(q, (k, v)), want, atol=1e-3)


def test_a_graph_wrapper_refuses_what_flashinfer_refuses():
    w = _graph_wrapper(2, 3)
    indptr, indices, last, _ = _csr([9, 1, 16], list(range(10)))
    with pytest.raises(ValueError, match="batch size should be fixed"):
        w.plan(indptr, indices, last, Q_HEADS, KV_HEADS, DIM, PAGE)
    indptr, indices, last, _ = _csr([9, 8], list(range(10)))
    with pytest.raises(ValueError, match="size of indices"):
        w.plan(indptr, indices, last, Q_HEADS, KV_HEADS, DIM, PAGE)
    w.plan(*_csr([5, 4], list(range(10)))[:3], Q_HEADS, KV_HEADS, DIM, PAGE)  # control: it fits


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(Q_HEADS // 2, KV_HEADS // 2), (Q_HEADS, KV_HEADS // 2)])
def test_a_run_of_other_heads_than_the_plans_is_refused(q_heads: int, kv_heads: int):
    """A plan made with the whole model's heads and run on one TP rank's (half of each), or with
    other KV heads than the caches': FlashInfer would decode from a schedule sized for other heads,
    so the stand-in refuses. Control: planned with the run's own heads, the same run passes."""
    k, v = (c[:, :, :kv_heads] for c in _caches())
    indptr, indices, last, _ = _csr([9, 1], list(range(10)))
    q = torch.randn(2, q_heads, DIM)
    w = FlashInferStandIn(torch.zeros(8), "NHD", backend="fa2")
    w.plan(indptr, indices, last, Q_HEADS, KV_HEADS, DIM, PAGE)
    with pytest.raises(ValueError, match="wrong schedule"):
        w.run(q, (k, v))
    w.plan(indptr, indices, last, q_heads, kv_heads, DIM, PAGE)
    assert w.run(q, (k, v)).shape == (2, q_heads, DIM)


def test_the_installed_flashinfer_plans_and_runs_as_the_stand_in():
    """What the stand-in assumes of FlashInfer 0.7.2's decode wrapper: ``plan`` takes its keywords
    (``window_left``, ``logits_soft_cap``, ``q_data_type``, ``kv_data_type``, ``sm_scale``); in
    CUDA-graph mode it copies ``indptr`` and ``last_page_len`` into the wrapper's fixed buffers and
    keeps the scalars; ``run`` reads those buffers and scalars as it finds them."""
    flashinfer = pytest.importorskip("flashinfer")
    cls = flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper
    plan = inspect.getsource(cls._plan_impl)
    for keyword in ("window_left", "logits_soft_cap", "q_data_type", "kv_data_type", "sm_scale"):
        assert keyword in inspect.signature(cls._plan_impl).parameters, keyword
    assert "self._paged_kv_indptr_buf.copy_(" in plan and "self._paged_kv_last_page_len_buf.copy_(" in plan
    assert all(f"self._{name}" in plan for name in ("sm_scale", "window_left", "logits_soft_cap"))
    run = inspect.getsource(cls.run)
    assert "self._paged_kv_indptr_buf" in run and "self._paged_kv_last_page_len_buf" in run
    assert "self._sm_scale" in run and "window_left" in run


def test_the_installed_flashinfer_fixes_a_graph_plans_schedule_per_batch_size():
    """What lets a graph captured over one plan replay after another plan of the same wrapper (the
    stand-in does not model it): in CUDA-graph mode FlashInfer 0.7.2's decode scheduler always
    splits the KV and pads the batch to a size fixed by the batch size and heads, so the values a
    plan bakes into the kernels' arguments do not change between plans (``scheduler.cuh``); the
    per-step schedule lives in the int workspace the plan rewrites."""
    flashinfer = pytest.importorskip("flashinfer")
    from pathlib import Path

    path = Path(flashinfer.__file__).parent / "data" / "include" / "flashinfer" / "attention" / "scheduler.cuh"
    if not path.exists():
        pytest.skip("FlashInfer's headers are not shipped with this install")
    source = path.read_text()
    assert "if (new_batch_size == batch_size && !enable_cuda_graph) {" in source  # CUDA-core decode: split
    assert "(enable_cuda_graph) ? (split_kv ? max_grid_size / gdy : batch_size) : new_batch_size" in source
    assert "return std::make_tuple(enable_cuda_graph || low < max_kv_len, low);" in source  # tensor cores
