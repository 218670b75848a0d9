"""``FlashInferLayeredDecode``: FlashInfer's wrappers as serving and the graph probe use them, and
each layer's page table handed to the run. FlashInfer needs CUDA, so the wrapper here is the
tests' stand-in (``FlashInferStandIn``: the 0.7.2 wrapper's constructor's keywords, eager ``plan``
taking the indices tensor as its buffer, a CUDA-graph ``plan`` copying into its own fixed buffers
and refusing another batch size) as a spy whose ``run`` returns whatever indices buffer it finds;
``test_flashinfer_stand_in.py`` and ``test_the_installed_flashinfer_behaves_as_the_stand_in``
pin those to the installed FlashInfer's source. The real kernels are checked against the dense
reference by the gpu tests (``tests/dataplane/test_gpu.py``) and ``kvplane gpu-check``'s
attention figures."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang_ext.dataplane.flashinfer_attention import (
    MAX_WRAPPERS,
    AttentionParams,
    FlashInferLayeredDecode,
    default_tensor_cores,
    reads_indices_at_run,
)
from sglang_ext.dataplane.results import LayerView
from sglang_ext.testing.flashinfer_stand_in import FlashInferStandIn

LAYERS = 6


class _Wrapper(FlashInferStandIn):
    """The stand-in wrapper (:class:`~sglang_ext.testing.flashinfer_stand_in.FlashInferStandIn`:
    FlashInfer 0.7.2's constructor, its eager and CUDA-graph ``plan``) as a spy: every wrapper made
    and every plan's batch and indices are kept, and ``run`` returns the indices buffer it finds
    (what the kernel would read) or raises when ``fail`` is set."""

    made: list[_Wrapper] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        last = self._paged_kv_last_page_len_buf
        self.batch = None if last is None else last.numel()
        self.plan_calls: list[tuple[int, torch.Tensor]] = []
        self.fail = False
        type(self).made.append(self)

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, *args: Any,
             **kwargs: Any) -> None:
        super().plan(indptr, indices, last_page_len, *args, **kwargs)
        self.plan_calls.append((last_page_len.numel(), indices))

    def run(self, q: torch.Tensor, kv: tuple) -> torch.Tensor:  # noqa: ARG002
        if self.fail:
            raise RuntimeError("kernel fault (test)")
        assert self._paged_kv_indices_buf is not None
        return self._paged_kv_indices_buf.clone()  # what the kernel read


def _decode(max_pages: int = 16, **kwargs: Any) -> FlashInferLayeredDecode:
    _Wrapper.made = []
    return FlashInferLayeredDecode("cpu", max_pages, wrapper_class=_Wrapper, workspace_bytes=64, **kwargs)


def _step(batch: int, seed: int, dtype: torch.dtype = torch.int32) -> tuple[LayerView, torch.Tensor]:
    """A step's layer-0 view over ``batch`` requests of 2 pages each, and its ``[L, n]`` table."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 1000, (LAYERS, 2 * batch), generator=g, dtype=torch.int32).to(dtype)
    kv = torch.zeros(8, 4, 2, 16)
    i32 = torch.int32
    view = LayerView(layer=0, k_cache=kv, v_cache=kv, kv_indptr=torch.arange(0, 2 * batch + 1, 2, dtype=i32),
                     kv_indices=table[0], kv_lens=torch.full((batch,), 7, dtype=i32),
                     last_page_len=torch.full((batch,), 3, dtype=i32), rids=())
    return view, table


def _layer(view: LayerView, table: torch.Tensor, layer: int) -> LayerView:
    return LayerView(layer, view.k_cache, view.v_cache, view.kv_indptr, table[layer], view.kv_lens,
                     view.last_page_len, ())


def test_serving_plans_one_eager_fa2_wrapper_per_parameter_set_whatever_the_batch():
    """Steps of 3, 7, 2,000 and 3 requests, two layer parameter sets (global and sliding-window
    layers): two wrappers in all, FlashInfer's eager mode (no CUDA-graph buffers, whose forced
    split and padded partial results overflow the workspace at large batches), the ``fa2``
    backend and SGLang's tensor-core choice; every layer's run reads that layer's row of the
    step's table, never a copy."""
    asked: list[tuple] = []

    def tensor_cores(dtype: torch.dtype, q_heads: int, kv_heads: int) -> bool:
        asked.append((dtype, q_heads, kv_heads))
        return False

    decode = _decode(tensor_cores=tensor_cores)
    plain, windowed = AttentionParams(num_qo_heads=4), AttentionParams(num_qo_heads=4, window_left=5)
    for seed, batch in enumerate((3, 7, 2000, 3)):
        view, table = _step(batch, seed)
        decode.new_step()
        for params in (plain, windowed):
            decode.plan(view, 4, params=params)
        for layer in range(LAYERS):
            params = windowed if layer % 2 else plain
            assert torch.equal(decode.run(torch.zeros(batch, 4, 16), _layer(view, table, layer), params), table[layer])
    assert decode.wrappers == 2 and len(_Wrapper.made) == 2
    assert all(not w.graph and w._backend == "fa2" and w.tensor_cores is False for w in _Wrapper.made)
    assert asked == [(torch.float32, 4, 2)] * 2  # the rule, asked once per wrapper with the pool's KV heads
    assert [len(w.plan_calls) for w in _Wrapper.made] == [4, 4]  # one plan per step, not per layer


def test_eager_rows_of_another_dtype_or_layout_are_converted_and_a_backend_reading_tables_at_plan_is_refused():
    """A layer's rows that are not contiguous int32 are made so (one copy launch; the step's table
    rows never need it); a wrapper whose backend reads page tables made at plan time (here
    ``trtllm-gen``) is refused at plan, naming it, instead of running every layer on the planning
    layer's pages (the control: such a wrapper would read the planned rows)."""
    decode = _decode()
    view, table = _step(3, 0, torch.int64)
    decode.plan(view, 4)
    got = decode.run(torch.zeros(3, 4, 16), _layer(view, table, 4))
    assert got.dtype == torch.int32 and torch.equal(got, table[4].int())
    strided = torch.stack([table[2], table[3]], 1).int()[:, 0]
    assert not strided.is_contiguous()
    assert torch.equal(decode.run(torch.zeros(3, 4, 16), _layer(view, strided[None].expand(LAYERS, -1), 1)),
                       table[2].int())
    real_new = decode._new

    def trtllm(*args: Any, **kwargs: Any) -> Any:
        w = real_new(*args, **kwargs)
        w._backend = "trtllm-gen"
        return w

    decode = _decode()
    decode._new = trtllm  # type: ignore[method-assign]
    view, table = _step(3, 1)
    with pytest.raises(RuntimeError, match="'trtllm-gen' backend does not read"):
        decode.plan(view, 4)


def test_graph_wrappers_are_per_batch_size_read_rows_in_place_and_outlive_the_cache():
    """The CUDA-graph probe's wrappers: one per (batch size, parameters) with fixed buffers, at
    most :data:`MAX_WRAPPERS` in the cache; a wrapper dropped from it -- by the cache's bound or
    when the indices buffers grow -- stays alive (a captured graph replays its buffers); runs
    read each layer's row in place and give the wrapper its buffer back."""
    decode = _decode(max_pages=64)
    for batch in range(1, MAX_WRAPPERS + 3):
        view, table = _step(batch, batch)
        decode.new_step()
        decode.plan(view, 4, graph=True)
        w, own = decode._planned[AttentionParams(num_qo_heads=4)]
        for layer in range(LAYERS):
            assert torch.equal(decode.run(torch.zeros(batch, 4, 16), _layer(view, table, layer)), table[layer])
            assert w._paged_kv_indices_buf is own
    assert all(w.graph and w._backend == "fa2" for w in _Wrapper.made)
    assert decode.wrappers == MAX_WRAPPERS and len(decode._retired) == 2 and decode.max_pages == 64
    made = len(_Wrapper.made)
    view, _ = _step(40, 0)  # 80 pages listed (a shared prefix listed per request): the buffers grow
    decode.plan(view, 4, graph=True)
    assert decode.max_pages == 128 and decode.wrappers == 1 and len(_Wrapper.made) == made + 1
    assert len(decode._retired) == 2 + MAX_WRAPPERS
    assert all(own.numel() == 64 for _, own in decode._retired)  # alive, with their buffers


def test_served_graph_wrappers_are_kept_for_every_captured_size_and_never_re_created():
    """Served decode graphs (``keep_graphs``, ``LayeredFlashInferDecode`` under ``--kv-cuda-graphs
    on``): SGLang captures more sizes than :data:`MAX_WRAPPERS` (its default list, over 30), and a
    replay's plan must reach the wrapper its graph was captured with. Every wrapper made is kept
    and found again; their indices buffers are the graph buffers' row width; a plan listing more
    pages raises rather than re-creating them. Kept again (SGLang's recapture) they are found
    again; kept at another width they are retired and new ones made. Control: without
    ``keep_graphs`` the cache drops the first sizes' wrappers, and a later plan of size 1 gets a
    new one its graph never read."""
    params, sizes = AttentionParams(num_qo_heads=4), range(1, MAX_WRAPPERS + 5)

    def plan_all(decode: FlashInferLayeredDecode) -> dict[int, object]:
        got = {}
        for batch in sizes:
            decode.plan(_step(batch, batch)[0], 4, graph=True)
            got[batch] = decode._planned[params][0]
        return got

    decode = _decode(max_pages=8)
    decode.keep_graphs(64)
    first = plan_all(decode)
    made = len(_Wrapper.made)
    assert plan_all(decode) == first and len(_Wrapper.made) == made == len(sizes)
    assert decode.wrappers == len(sizes) and not decode._retired
    assert all(w._paged_kv_indices_buf.numel() == 64 for w in first.values())
    assert len({id(w._paged_kv_indices_buf) for w in first.values()}) == 1  # one buffer, shared
    with pytest.raises(RuntimeError, match="lists 80 pages, over the 64"):
        decode.plan(_step(40, 0)[0], 4, graph=True)  # 80 pages (a shared prefix listed per request)
    assert decode.wrappers == len(sizes) and decode.max_pages == 64
    decode.keep_graphs(64)  # SGLang's recapture (a weight update): the same wrappers, planned again
    assert plan_all(decode) == first and len(_Wrapper.made) == made and not decode._retired
    decode.keep_graphs(128)  # another width: the wrappers retired (kept alive), new ones made
    again = plan_all(decode)
    assert len(decode._retired) == len(sizes) and not set(map(id, again.values())) & set(map(id, first.values()))
    assert all(w._paged_kv_indices_buf.numel() == 128 for w in again.values())
    control = _decode(max_pages=64)
    kept = plan_all(control)
    assert len({id(w._paged_kv_indices_buf) for w in kept.values()}) == len(kept)  # not kept: one a wrapper
    control.plan(_step(1, 1)[0], 4, graph=True)
    assert control._planned[params][0] is not kept[1]


def own_buffer_decode(backend: str, own: torch.Tensor, fail: bool = False) -> tuple[FlashInferLayeredDecode, Any]:
    """A decode holding one planned graph wrapper of ``backend`` whose own indices buffer is ``own``."""
    decode = _decode()
    w = _Wrapper(torch.zeros(1), "NHD", True, backend, paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32),
                 paged_kv_indices_buffer=own, paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32))
    w.fail = fail
    decode._planned = {AttentionParams(num_qo_heads=4): (w, own)}
    return decode, w


@pytest.mark.parametrize("case", ["trtllm-gen", "cudnn", "int64", "strided", "not its buffer"])
def test_control_graph_wrappers_copy_rows_they_cannot_read_in_place(case):
    own = torch.full((16,), -7, dtype=torch.int32)
    table = torch.arange(5 * 6, dtype=torch.int32).view(6, 5)
    rows = table[2]
    decode, wrapper = own_buffer_decode("fa2", own)
    if case == "trtllm-gen":
        wrapper._backend = "trtllm-gen"
    elif case == "cudnn":
        wrapper._uses_cudnn = True
    elif case == "int64":
        rows = rows.long()
    elif case == "strided":
        rows = table[:, 1]  # a column: not contiguous
    else:
        wrapper._paged_kv_indices_buf = own.clone()  # someone else's buffer: do not swap it out
    assert not reads_indices_at_run(wrapper, rows, own)
    view, _ = _step(2, 0)
    decode.run(torch.zeros(2, 4, 16), _layer(view, rows[None].expand(LAYERS, -1), 0))
    if case != "not its buffer":
        assert torch.equal(own[: rows.numel()], rows.to(torch.int32))  # the copy into the buffer
        assert wrapper._paged_kv_indices_buf is own


def test_a_failing_graph_run_still_gets_the_buffer_back():
    own = torch.zeros(16, dtype=torch.int32)
    decode, wrapper = own_buffer_decode("fa3", own, fail=True)
    view, table = _step(2, 0)
    with pytest.raises(RuntimeError, match="kernel fault"):
        decode.run(torch.zeros(2, 4, 16), _layer(view, table, 1))
    assert wrapper._paged_kv_indices_buf is own


def test_the_default_tensor_core_rule_is_sglangs():
    """:func:`default_tensor_cores` (the gpu-check's; serving passes SGLang's own) answers as SGLang
    0.5.23's ``should_use_tensor_core`` over dtypes and GQA groups; the control: a group of 4
    and a group of 1 differ."""
    from sglang_ext import compat

    sglang = compat.should_use_tensor_core
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        for q_heads, kv_heads in ((32, 8), (32, 32), (32, 16), (64, 8), (28, 4), (8, 1)):
            assert default_tensor_cores(dtype, q_heads, kv_heads) == sglang(dtype, q_heads, kv_heads), (dtype, q_heads)
    assert default_tensor_cores(torch.bfloat16, 32, 8) != default_tensor_cores(torch.bfloat16, 32, 32)


def test_the_installed_flashinfer_behaves_as_the_stand_in():
    """The stand-in's behaviour, pinned to the installed FlashInfer (requirements/constraints.txt):
    the constructor's keywords; ``run`` passing ``self._paged_kv_indices_buf`` as it finds it to
    both kernel paths and branching on ``_backend`` / ``_uses_cudnn``; an eager ``plan`` taking
    the indices tensor as that buffer, a CUDA-graph one copying into its own and refusing another
    batch size. An upgrade that changes any of it fails here before it reaches a GPU."""
    import inspect

    flashinfer = pytest.importorskip("flashinfer")
    cls = flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper
    params = inspect.signature(cls.__init__).parameters
    assert {"use_cuda_graph", "backend", "use_tensor_cores", "paged_kv_indices_buffer"} <= set(params)
    run = inspect.getsource(cls.run)
    assert run.count("self._paged_kv_indices_buf,") >= 2  # the tensor-core and CUDA-core argument lists
    assert "self._uses_cudnn" in run and 'self._backend == "trtllm-gen"' in run
    init = inspect.getsource(cls.__init__)
    assert "self._paged_kv_indices_buf = paged_kv_indices_buffer" in init
    plan = inspect.getsource(cls._plan_impl)  # what ``plan`` calls
    assert "self._plan_impl(" in inspect.getsource(cls.plan)
    assert "self._paged_kv_indices_buf = indices.to(" in plan  # eager
    assert "self._paged_kv_indices_buf[: len(indices)].copy_(" in plan  # CUDA-graph
    assert "The batch size should be fixed in cudagraph mode" in plan


def test_a_graph_steps_plans_list_no_pages_and_plan_each_parameter_set_once():
    """``plan_graph`` (the served decode's and gpu-check's plans of a captured step): this step's
    earlier plans forgotten, each distinct parameter set planned once on the graph wrapper of the
    view's batch, from the view's CSR, handed no page ids (the runs read each layer's row in
    place), the wrappers' buffers as wide as a row. Control: ``plan`` with the view's pages copies
    them into the wrapper's buffer."""
    decode = _decode(max_pages=4)
    view, table = _step(3, 1)
    plain, windowed = AttentionParams(num_qo_heads=4), AttentionParams(num_qo_heads=4, window_left=8)
    decode.plan(view, 4)  # an eager plan of the step: forgotten
    decode.plan_graph(view, [plain, windowed, plain])
    assert set(decode._planned) == {plain, windowed} and decode.max_pages == 8  # grown to the row (6 pages)
    for params in (plain, windowed):
        w, own = decode._planned[params]
        assert w.graph and w.batch == 3 and [len(i) for _, i in w.plan_calls] == [0] and not own.any()
        assert torch.equal(decode.run(torch.zeros(3, 4, 16), _layer(view, table, 2), params), table[2])
    w, own = decode._planned[plain]
    decode.plan(view, 4, graph=True)  # control: the pages listed are copied in
    assert torch.equal(own[:6], view.kv_indices)
