"""The same correctness checks on a GPU: CUDA transfer engine (two streams, Triton over pinned
host memory) and FlashInfer paged decode over layered tables (bf16 tolerance)."""

import pytest
import torch

from sglang_ext.dataplane import LayeredKVCache, dense_attention, torch_layered_attention
from tests.dataplane.harness import assert_matches_shadow, empty_shadow, run_step, small_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cuda_cache(dtype=torch.float32, **over):
    return LayeredKVCache(small_config(device="cuda", dtype=dtype, device_blocks=96, host_blocks=128, **over))


def test_cuda_lifecycle_bit_exact():
    """Offload, decode through staging, pause, resume and fork keep KV bit-exact on CUDA."""
    cache = _cuda_cache()
    shadow = {}
    for i, rid in enumerate("abc"):
        cache.alloc_request(rid)
        shadow[rid] = empty_shadow(cache.config)
        run_step(cache, {rid: 5 + 3 * i}, shadow, i)
    cache.install_placement({"a": [1, 0, 1, 0], "b": [0, 0, 0, 0], "c": [0, 1, 1, 1]})
    for s in range(6):
        run_step(cache, {"a": 1, "b": 2, "c": 1}, shadow, 10 + s)
    assert_matches_shadow(cache, shadow)
    cache.pause("c")
    cache.install_placement({"a": [1, 1, 1, 1], "b": [1, 1, 1, 0]})
    cache.resume("c")
    cache.alloc_request("d", [1, 0, 1, 0])
    cache.fork_prefix("b", "d", 9)  # D2D, H2D, D2H and H2H copies on CUDA
    shadow["d"] = [(k[:9].clone(), v[:9].clone()) for k, v in shadow["b"]]
    run_step(cache, {"a": 1, "b": 1, "c": 1, "d": 1}, shadow, 99)
    assert_matches_shadow(cache, shadow)
    cache.check_invariants()


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_cuda_layered_decode_matches_dense_bf16(backend):
    """Decode attention over layered tables equals dense attention within bf16 tolerance."""
    if backend == "flashinfer":
        from sglang_ext.dataplane.flashinfer_attention import (
            HAVE_FLASHINFER,
            FlashInferLayeredDecode,
        )

        if not HAVE_FLASHINFER:
            pytest.skip("flashinfer not importable")
    cache = _cuda_cache(dtype=torch.bfloat16, head_dim=64, block_size=16)
    shadow = {}
    rids = ["a", "b", "c"]
    for i, rid in enumerate(rids):
        cache.alloc_request(rid)
        shadow[rid] = empty_shadow(cache.config)
        run_step(cache, {rid: 20 + 17 * i}, shadow, i)
    cache.install_placement({"a": [1, 0, 1, 0], "b": [0, 0, 1, 1], "c": [1, 1, 1, 1]})
    q = torch.randn(4, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    fi = FlashInferLayeredDecode("cuda", max_pages=64) if backend == "flashinfer" else None
    checked = []

    def check(layer, view):
        if fi is not None:
            if layer == 0:
                fi.plan(view, num_qo_heads=4)
            out = fi.run(q[layer], view)
        else:
            qo = torch.arange(4, device="cuda")
            out = torch_layered_attention(q[layer], qo, view.k_cache, view.v_cache, view.kv_indptr, view.kv_indices, view.kv_lens)
        for b, rid in enumerate(rids):
            k, v = shadow[rid][layer]
            ref = dense_attention(q[layer, b : b + 1].float().cpu(), k.float(), v.float())
            torch.testing.assert_close(out[b : b + 1].float().cpu(), ref, rtol=2e-2, atol=2e-2)
        checked.append(layer)

    run_step(cache, {r: 1 for r in rids}, shadow, 7, on_layer=check)
    assert checked == [0, 1, 2, 3]


def test_h2d_and_d2h_streams_are_distinct_and_ordered():
    """The CUDA engine uses two side streams; a fetch waiting on a write-back sees its data."""
    cache = _cuda_cache()
    eng = cache.engine
    assert eng.h2d_stream != eng.d2h_stream
    dev, host = cache.device_pool.segments, cache.host_pool.segments
    dev[0].fill_(3.0)
    ev = eng.d2h([0], [5])
    ev2 = eng.h2d([5], [1], wait=[ev])
    eng.host_wait([ev2])
    assert torch.equal(dev[1].cpu(), torch.full_like(dev[1].cpu(), 3.0))
    assert torch.equal(host[5], torch.full_like(host[5], 3.0))
