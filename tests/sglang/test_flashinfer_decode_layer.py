"""``LayeredFlashInferDecode.decode_layer`` (the GPU serving backend's per-layer decode), on the CPU:
each layer's attention parameters are made once (not once a step), one plan per step and per
distinct parameters, and every layer reads its own row of the step's page table. The backend
needs CUDA and FlashInfer's kernels, so it is built without its constructor and its FlashInfer
object is a stand-in recording the calls; the real one is checked against the dense reference by
the gpu tests and ``kvplane gpu-check``. Control: a layer with a soft cap gets parameters of its
own (a cache keyed wrongly would hand it another layer's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang


class _FlashInfer:
    def __init__(self) -> None:
        self.plans: list[object] = []
        self.runs: list[tuple[object, torch.Tensor]] = []
        self._planned: set[object] = set()

    def new_step(self) -> None:
        self._planned.clear()

    def planned(self, params: object) -> bool:
        return params in self._planned

    def plan(self, view, num_qo_heads, params=None):  # noqa: ANN001, ANN201
        self._planned.add(params)
        self.plans.append(params)

    def run(self, q, view, params):  # noqa: ANN001, ANN201
        self.runs.append((params, view.kv_indices))
        return torch.zeros_like(q)


def test_params_are_made_once_per_layer_and_each_layer_reads_its_row(monkeypatch):
    from sglang_ext.dataplane import flashinfer_attention
    from sglang_ext.layered_flashinfer_decode import LayeredFlashInferDecode

    made = []
    real = flashinfer_attention.AttentionParams.of_layer.__func__

    def of_layer(cls, layer, heads, dtype=None):  # noqa: ANN001, ANN202
        made.append(layer.layer_id)
        return real(cls, layer, heads, dtype)

    monkeypatch.setattr(flashinfer_attention.AttentionParams, "of_layer", classmethod(of_layer))
    backend = object.__new__(LayeredFlashInferDecode)  # no CUDA here: the state decode_layer reads
    backend.flashinfer, backend._params = _FlashInfer(), {}
    kv = torch.zeros(8, 4, 2, 16)
    tab = torch.arange(3 * 5, dtype=torch.int32).view(3, 5)
    host = SimpleNamespace(kv_indptr=torch.tensor([0, 2, 5], dtype=torch.int32),
                           last_page_len=torch.tensor([4, 4], dtype=torch.int32))
    tables = SimpleNamespace(kv_indptr=host.kv_indptr, tab=tab, kv_lens=torch.tensor([8, 20], dtype=torch.int32),
                             last_page_len=host.last_page_len, plan_view=lambda view: view)
    backend.pool = SimpleNamespace(tables=tables, store=SimpleNamespace(dev=(kv, kv)))
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=4, scaling=0.25, logit_cap=30.0 if i == 2 else 0.0,
                              sliding_window_size=-1) for i in range(3)]
    q = torch.zeros(2, 4, 16)
    for _ in range(4):  # four steps
        backend.flashinfer.new_step()
        for index, layer in enumerate(layers):
            backend.decode_layer(q, layer, index)
    assert sorted(made) == [0, 1, 2]  # once per layer, not once per step
    assert len(backend.flashinfer.plans) == 4 * 2  # per step: plain layers' plan and the capped layer's
    runs = backend.flashinfer.runs
    assert all(torch.equal(rows, tab[i % 3]) for i, (_, rows) in enumerate(runs))
    capped = {params for i, (params, _) in enumerate(runs) if i % 3 == 2}
    plain = {params for i, (params, _) in enumerate(runs) if i % 3 != 2}
    assert len(capped) == len(plain) == 1 and capped != plain
    assert next(iter(capped)).logits_soft_cap == 30.0 and next(iter(plain)).logits_soft_cap == 0.0


def test_decode_layer_over_the_real_decode_plans_once_a_step_and_reads_each_layers_row():
    """The same backend over the real :class:`FlashInferLayeredDecode` (FlashInfer's wrapper a
    stand-in with its 0.7.2 behaviour, ``tests/dataplane/test_flashinfer_indices.py``) and SGLang's
    own tensor-core rule, as ``__init__`` wires them: what each layer's run read is that layer's
    row; one eager wrapper per parameter set, planned once a step, over steps of 2 and 3
    requests. Control: the capped layer's row differs from the plain layers'."""
    from sglang_ext import compat
    from sglang_ext.dataplane.flashinfer_attention import FlashInferLayeredDecode
    from sglang_ext.layered_flashinfer_decode import LayeredFlashInferDecode
    from tests.dataplane.test_flashinfer_indices import _Wrapper

    _Wrapper.made = []
    backend = object.__new__(LayeredFlashInferDecode)
    backend.flashinfer = FlashInferLayeredDecode("cpu", 16, tensor_cores=compat.should_use_tensor_core,
                                                 wrapper_class=_Wrapper, workspace_bytes=64)
    backend._params = {}
    kv = torch.zeros(8, 4, 2, 16, dtype=torch.bfloat16)
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=8, scaling=0.25, logit_cap=30.0 if i == 2 else 0.0,
                              sliding_window_size=-1) for i in range(3)]
    for step, batch in enumerate((2, 3, 2)):
        tab = torch.arange(3 * 2 * batch, dtype=torch.int32).view(3, 2 * batch) + 100 * step
        i32 = torch.int32
        tables = SimpleNamespace(kv_indptr=torch.arange(0, 2 * batch + 1, 2, dtype=i32), tab=tab,
                                 kv_lens=torch.full((batch,), 7, dtype=i32),
                                 last_page_len=torch.full((batch,), 3, dtype=i32), plan_view=lambda view: view)
        backend.pool = SimpleNamespace(tables=tables, store=SimpleNamespace(dev=(kv, kv)))
        backend.new_step()
        q = torch.zeros(batch, 8, 16, dtype=torch.bfloat16)
        for index, layer in enumerate(layers):
            assert torch.equal(backend.decode_layer(q, layer, index), tab[index])
    assert len(_Wrapper.made) == 2 and all(len(w.plan_calls) == 3 for w in _Wrapper.made)
    assert all(not w.graph and w._backend == "fa2" and w.tensor_cores for w in _Wrapper.made)  # group 4, bf16
    assert not torch.equal(tab[2], tab[0])
