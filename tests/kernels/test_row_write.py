"""Row write: the Triton one-launch KV write vs two ``index_copy_`` (interpreter on CPU, real on
GPU), with strided sources (a fused projection's slice), both index dtypes, the shapes it
refuses; and the served core's lifecycle with it as the store's writer."""

import pytest
import torch

from kernels.row_write import write_rows_ref, write_rows_triton
from sglang_ext.dataplane.triton_row_writer import TritonRowWriter
from tests.dataplane.core_driver import PAGES, CoreDriver, make_core, offload_scenario

H, D = 2, 24


def _case(device: str, dtype: torch.dtype, n: int, strided: bool, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    k_dst = torch.randn((40, H, D), generator=g).to(device, dtype)
    v_dst = torch.randn((40, H, D), generator=g).to(device, dtype)
    rows = torch.randperm(40, generator=g)[:n].to(device)
    if strided:  # K and V as slices of one fused [n, 3, H, D] projection: rows 3 * H * D apart
        qkv = torch.randn((n, 3, H, D), generator=g).to(device, dtype)
        k, v = qkv[:, 1], qkv[:, 2]
    else:
        k, v = torch.randn((n, H, D), generator=g).to(device, dtype), torch.randn((n, H, D), generator=g).to(device, dtype)
    return k_dst, v_dst, rows, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 7])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_one_launch_equals_two_index_copies(triton_device, dtype, n, strided, index_dtype):
    k_dst, v_dst, rows, k, v = _case(triton_device, dtype, n, strided)
    want_k, want_v = k_dst.clone(), v_dst.clone()
    write_rows_ref(want_k, want_v, rows, k, v)
    write_rows_triton(k_dst, v_dst, rows.to(index_dtype), k, v)
    assert torch.equal(k_dst, want_k) and torch.equal(v_dst, want_v)


def test_negative_control_other_rows_differ(triton_device):
    """The same write to rows shifted by one lands elsewhere: the comparison sees it."""
    k_dst, v_dst, rows, k, v = _case(triton_device, torch.float32, 5, True)
    want_k, want_v = k_dst.clone(), v_dst.clone()
    write_rows_ref(want_k, want_v, rows, k, v)
    write_rows_triton(k_dst, v_dst, (rows + 1) % 40, k, v)
    assert not torch.equal(k_dst, want_k)


def test_shapes_it_cannot_write_are_refused(triton_device):
    k_dst, v_dst, rows, k, v = _case(triton_device, torch.float32, 3, False)
    with pytest.raises(ValueError, match="one dtype"):
        write_rows_triton(k_dst, v_dst, rows, k.to(torch.float16), v)
    with pytest.raises(ValueError, match="rows, sources"):
        write_rows_triton(k_dst, v_dst, rows[:2], k, v)
    with pytest.raises(ValueError, match="contiguous"):
        write_rows_triton(k_dst, v_dst, rows, k.transpose(1, 2).contiguous().transpose(1, 2), v)


def test_the_writer_falls_back_for_rows_it_cannot_take(triton_device):
    """A source whose rows are not contiguous goes through the two ``index_copy_`` (counted)."""
    writer = TritonRowWriter()
    k_dst, v_dst, rows, k, v = _case(triton_device, torch.float32, 4, True)
    want_k, want_v = k_dst.clone(), v_dst.clone()
    write_rows_ref(want_k, want_v, rows, k, v)
    writer(k_dst, v_dst, rows, k.transpose(1, 2).contiguous().transpose(1, 2), v)
    writer(k_dst, v_dst, rows, k, v)
    assert (writer.fallbacks, writer.calls) == (1, 1)
    assert torch.equal(k_dst, want_k) and torch.equal(v_dst, want_v)


@pytest.mark.parametrize("budget", [None, PAGES + 6])
def test_the_core_writes_every_token_with_it(triton_device, budget):
    """The served lifecycle (prefills, offloaded layers, a pause and a resume) with the Triton
    writer as the store's: every layer's read inside the step and every read at rest equal the
    shadow, and the writes went through the kernel (the park of a staged decode step too)."""
    core = make_core(budget, device=triton_device)
    writer = core.store.row_writer = TritonRowWriter()
    offload_scenario(CoreDriver(core, seed=4))
    assert writer.calls > 0 and writer.fallbacks == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_row_write_at_llama_width_and_the_core_with_it():
    """On a GPU (``kvplane gpu-check`` runs the gpu-marked tests): Llama-3-8B's row (8 KV heads x
    128, bf16) from a fused projection's slices, batch 32, equals two ``index_copy_``; the core's
    lifecycle with the writer on CUDA reads every token bit-exactly."""
    g = torch.Generator().manual_seed(5)
    k_dst = torch.randn((4096, 8, 128), generator=g).to("cuda", torch.bfloat16)
    v_dst = torch.randn((4096, 8, 128), generator=g).to("cuda", torch.bfloat16)
    qkv = torch.randn((32, 6, 8, 128), generator=g).to("cuda", torch.bfloat16)
    k, v, rows = qkv[:, 4], qkv[:, 5], torch.randperm(4096, generator=g)[:32].cuda()
    want_k, want_v = k_dst.clone(), v_dst.clone()
    write_rows_ref(want_k, want_v, rows, k, v)
    write_rows_triton(k_dst, v_dst, rows, k, v)
    assert torch.equal(k_dst, want_k) and torch.equal(v_dst, want_v)
    core = make_core(PAGES + 6, device="cuda")
    writer = core.store.row_writer = TritonRowWriter()
    offload_scenario(CoreDriver(core, seed=6))
    assert writer.calls > 0 and writer.fallbacks == 0
