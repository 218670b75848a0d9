"""FlashInfer's split schedule while the GPU lags the host, on CUDA (the CPU version, with an
emulated stream: ``test_flashinfer_schedule_ring.py``).

The stream is held behind a sleep kernel; step A's graph plan and run are enqueued behind it, then
step B's plan on the same graph wrapper (the same batch size) rewrites, on the host, whatever
pinned buffer the wrapper holds -- while A's plan copy still waits in the stream. A's run must
still read A's split schedule: with the schedule ring it equals the paged reference (bf16
tolerance). Control: one pinned buffer for the wrapper (FlashInfer's own), and A's run reads B's
schedule (long requests computed over a short request's tiles): far off the reference."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_decode import paged_decode_ref
from sglang_ext.dataplane.results import LayerView

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PAGE, KV_HEADS, Q_HEADS, DIM, PAGES, BATCH = 16, 8, 32, 128, 2048, 4
SLEEP_CYCLES = 500_000_000
"""The sleep kernel's length (~0.3 s at ~1.7 GHz): far longer than the host's two plans."""


def _step(tokens: int, gen: torch.Generator) -> tuple[LayerView, LayerView]:
    """(host view for the plan, device view for the run) of BATCH requests of ``tokens`` each."""
    per = -(-tokens // PAGE)
    pages = torch.randperm(PAGES, generator=gen)[: BATCH * per].to(torch.int32)
    indptr = torch.arange(0, BATCH * per + 1, per, dtype=torch.int32)
    last = torch.full((BATCH,), tokens - (per - 1) * PAGE, dtype=torch.int32)
    lens = torch.full((BATCH,), tokens, dtype=torch.int32)
    cache = torch.empty(0)
    host = LayerView(0, cache, cache, indptr, pages, lens, last, ())
    return host, LayerView(0, cache, cache, indptr.cuda(), pages.cuda(), lens.cuda(), last.cuda(), ())


@pytest.mark.parametrize(("ring", "heads"), [(True, (Q_HEADS, KV_HEADS, DIM)), (True, (4, 2, 64)),
                                             (False, (Q_HEADS, KV_HEADS, DIM))],
                         ids=["ring-tensor-cores", "ring-cuda-cores", "control-one-buffer"])
def test_a_plan_copy_held_behind_the_stream_reads_its_own_schedule(ring, heads):
    """``heads`` (query heads, KV heads, head dim): 32 over 8 at 128, FlashInfer's tensor-core
    (prefill-plan) decode as SGLang picks it for Llama-3-8B (the kernel gpu-check's attention
    figures build); 4 over 2 at 64, its CUDA-core decode plan (the kernel ``test_gpu.py`` builds:
    no JIT build of its own). In CUDA-graph mode both always split the KV, by tiles sized from the
    plan's longest request, so A's run over B's schedule covers a fraction of A's tokens."""
    q_heads, kv_heads, dim = heads
    fia = pytest.importorskip("sglang_ext.dataplane.flashinfer_attention")
    if not fia.HAVE_FLASHINFER:
        pytest.skip("flashinfer not importable")
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(PAGES, PAGE, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    decode = fia.FlashInferLayeredDecode("cuda", max_pages=PAGES)
    if not ring:
        decode.schedule_ring = None
    params = fia.AttentionParams(num_qo_heads=q_heads, q_dtype=torch.bfloat16)
    steps = [_step(4096, gen), _step(20, gen)]  # A: split into many KV tiles; B: one tile a request
    qs = [torch.randn(BATCH, q_heads, dim, generator=gen).to("cuda", torch.bfloat16) for _ in steps]
    def run_both() -> list[torch.Tensor]:
        outs = []
        for (host, dev), q in zip(steps, qs, strict=True):
            decode.plan_graph(_with(host, k, v), (params,))
            outs.append(decode.run(q, _with(dev, k, v), params))
        return outs

    for _ in range(4):  # warm: the kernels built, the graph wrapper made, every ring slot allocated
        run_both()
    torch.cuda.synchronize()
    rings = [r for r in (decode.schedule_ring, decode._csr_ring) if r is not None]
    grown = [r.grown for r in rings]
    behind = torch.cuda.Event()
    torch.cuda._sleep(SLEEP_CYCLES)  # the GPU behind: A's plan copy waits while B plans
    behind.record()
    outs = run_both()
    assert not behind.query()  # the premise: B planned while A's copy still waited in the stream
    assert [r.grown for r in rings] == grown  # no pinned allocation (which might wait for the device)
    torch.cuda.synchronize()
    dev = steps[0][1]
    want = paged_decode_ref(qs[0].float(), k.float(), v.float(), dev.kv_indptr, dev.kv_indices, dev.kv_lens)
    err = float((outs[0].float() - want).abs().max())
    if ring:
        assert err <= 2e-2, err
    else:
        assert err > 0.1, err


def _with(view: LayerView, k: torch.Tensor, v: torch.Tensor) -> LayerView:
    return LayerView(view.layer, k, v, view.kv_indptr, view.kv_indices, view.kv_lens, view.last_page_len, view.rids)
