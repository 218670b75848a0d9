"""``FlashInferLayeredDecode.run`` hands the wrapper the layer's row of the step's table for the run
(no copy launch per layer) where FlashInfer's backend reads its indices buffer at run time, and
puts the wrapper's own buffer back after it. FlashInfer needs CUDA, so the wrapper here is a
stand-in recording what its ``run`` reads; the real one is checked against the dense reference,
layer by layer, by the gpu tests (``tests/dataplane/test_gpu.py``'s FlashInfer decodes) and by
``kvplane gpu-check``'s attention figures. Controls: the backends that read block tables made at
plan time, and rows FlashInfer could not read in place, get the copy."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.dataplane.flashinfer_attention import (
    AttentionParams,
    FlashInferLayeredDecode,
    reads_indices_at_run,
)
from sglang_ext.dataplane.results import LayerView


class _Wrapper:
    """What ``run`` needs of a planned ``BatchDecodeWithPagedKVCacheWrapper``: the attributes
    :func:`reads_indices_at_run` checks, and a ``run`` that returns the page ids it read."""

    def __init__(self, backend: str, own: torch.Tensor, cudnn: bool = False, fail: bool = False) -> None:
        self._backend, self._uses_cudnn, self._paged_kv_indices_buf = backend, cudnn, own
        self.fail = fail

    def run(self, q: torch.Tensor, kv: tuple) -> torch.Tensor:  # noqa: ARG002
        if self.fail:
            raise RuntimeError("kernel fault (test)")
        return self._paged_kv_indices_buf.clone()


def _decode(wrapper: _Wrapper, own: torch.Tensor) -> tuple[FlashInferLayeredDecode, AttentionParams]:
    decode = object.__new__(FlashInferLayeredDecode)  # no CUDA here: the planned state, set by hand
    params = AttentionParams(num_qo_heads=4)
    decode._planned = {params: (wrapper, own)}
    return decode, params


def _view(rows: torch.Tensor) -> LayerView:
    kv = torch.zeros(8, 4, 2, 16)
    return LayerView(layer=3, k_cache=kv, v_cache=kv, kv_indptr=torch.tensor([0, 2, 5], dtype=torch.int32),
                     kv_indices=rows, kv_lens=torch.tensor([20, 40], dtype=torch.int32),
                     last_page_len=torch.tensor([4, 8], dtype=torch.int32), rids=())


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_the_run_reads_the_layers_row_in_place_and_gets_its_buffer_back(backend):
    own = torch.full((16,), -7, dtype=torch.int32)
    table = torch.arange(5 * 6, dtype=torch.int32).view(6, 5)  # [L, n]: row l is layer l's page ids
    wrapper = _Wrapper(backend, own)
    decode, params = _decode(wrapper, own)
    for layer in range(6):
        got = decode.run(torch.zeros(2, 4, 16), _view(table[layer]), params)
        assert torch.equal(got, table[layer])  # what the kernel read: that layer's row
        assert wrapper._paged_kv_indices_buf is own  # back for the next plan (which writes there)
    assert (own == -7).all()  # never copied into: no launch per layer


@pytest.mark.parametrize("case", ["trtllm-gen", "cudnn", "int64", "strided", "not its buffer"])
def test_control_other_backends_and_rows_get_the_copy(case):
    own = torch.full((16,), -7, dtype=torch.int32)
    table = torch.arange(5 * 6, dtype=torch.int32).view(6, 5)
    rows = table[2]
    wrapper = _Wrapper("fa2", own)
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
    decode, params = _decode(wrapper, own)
    assert not reads_indices_at_run(wrapper, rows, own)
    decode.run(torch.zeros(2, 4, 16), _view(rows), params)
    if case != "not its buffer":
        assert torch.equal(own[: rows.numel()], rows.to(torch.int32))  # the copy into the buffer
        assert wrapper._paged_kv_indices_buf is own


def test_a_failing_run_still_gets_the_buffer_back():
    own = torch.zeros(16, dtype=torch.int32)
    wrapper = _Wrapper("fa3", own, fail=True)
    decode, params = _decode(wrapper, own)
    with pytest.raises(RuntimeError, match="kernel fault"):
        decode.run(torch.zeros(2, 4, 16), _view(torch.arange(5, dtype=torch.int32)), params)
    assert wrapper._paged_kv_indices_buf is own


def test_the_installed_flashinfer_run_reads_the_buffer_at_run_time():
    """The assumption pinned to the installed FlashInfer (requirements/constraints.txt): its
    decode wrapper's ``run`` passes ``self._paged_kv_indices_buf`` as it finds it to both kernel
    paths and branches on ``_backend`` / ``_uses_cudnn``, which a planned wrapper of our kind
    sets. An upgrade that moves the indices elsewhere fails here before it reaches a GPU."""
    import inspect

    flashinfer = pytest.importorskip("flashinfer")
    run = inspect.getsource(flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper.run)
    assert run.count("self._paged_kv_indices_buf,") >= 2  # the tensor-core and CUDA-core argument lists
    assert "self._uses_cudnn" in run and 'self._backend == "trtllm-gen"' in run
    init = inspect.getsource(flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper.__init__)
    assert "self._paged_kv_indices_buf = paged_kv_indices_buffer" in init
