"""Batched segment copy: Triton kernel vs torch reference (interpreter on CPU, real on GPU)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.block_copy import copy_segments, copy_segments_ref, copy_segments_triton, word_view

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
SEGMENT_ELEMS = (1, 6, 128, 1500)  # odd sizes exercise masking and the word view
PAIRS = (0, 1, 7)
SEED = 1234


def _pools(dtype: torch.dtype, seg: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    src = torch.randint(0, 100, (9, seg), generator=g).to(dtype)
    dst = torch.randint(100, 200, (11, seg), generator=g).to(dtype)
    return src.to(device), dst.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seg", SEGMENT_ELEMS)
@pytest.mark.parametrize("n", PAIRS)
def test_triton_copy_matches_reference(triton_device: str, dtype: torch.dtype, seg: int, n: int) -> None:
    """dst after the Triton copy equals dst after the torch reference; src is unchanged."""
    src, dst = _pools(dtype, seg, triton_device)
    g = torch.Generator().manual_seed(SEED + n)
    src_idx = torch.randint(0, src.shape[0], (n,), generator=g)
    dst_idx = torch.randperm(dst.shape[0], generator=g)[:n]  # scatter targets are distinct
    src_before = src.clone()
    expected = dst.clone()
    copy_segments_ref(src, expected, src_idx, dst_idx)
    copy_segments_triton(src, dst, src_idx.to(triton_device), dst_idx.to(triton_device))
    torch.testing.assert_close(dst, expected, rtol=0, atol=0)
    torch.testing.assert_close(src, src_before, rtol=0, atol=0)


class _Views(TorchDispatchMode):
    """Counts the tensor views a call makes (host work per launch on a GPU host)."""

    def __init__(self) -> None:
        super().__init__()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.views += str(func).startswith("aten.view")
        return func(*args, **(kwargs or {}))


def test_kept_word_views_are_not_viewed_again(triton_device: str) -> None:
    """The copy engine keeps its pools' word views (``CudaTransferEngine._words``): ``word_view``
    returns such a view itself, without a new view (negative control: a bf16 pool takes two per
    call), and the copy over the kept views equals the copy over the pools (bit for bit, against
    the reference; the negative control of the equality: other indices give another result)."""
    src, dst = _pools(torch.bfloat16, 1500, triton_device)  # 3000 bytes a row: int64 words
    words = word_view(src)
    assert words.dtype == torch.int64 and words.data_ptr() == src.data_ptr()
    counter = _Views()
    with counter:
        again = word_view(words)
    assert again is words and counter.views == 0
    with counter:
        word_view(src)
    assert counter.views == 2
    idx_s, idx_d = torch.tensor([3, 0, 8]), torch.tensor([1, 10, 4])
    expected = dst.clone()
    copy_segments_ref(src, expected, idx_s, idx_d)
    copy_segments_triton(words, word_view(dst), idx_s.to(triton_device), idx_d.to(triton_device))
    torch.testing.assert_close(dst, expected, rtol=0, atol=0)
    other = _pools(torch.bfloat16, 1500, triton_device)[1]  # the same starting pool, other indices
    copy_segments_triton(words, word_view(other), idx_s.flip(0).to(triton_device), idx_d.to(triton_device))
    assert not torch.equal(other, expected)


def test_reference_is_a_gather_scatter() -> None:
    """The reference does dst[dst_idx[i]] = src[src_idx[i]] and touches no other row."""
    src = torch.arange(12.0).view(4, 3)
    dst = torch.full((3, 3), -1.0)
    copy_segments_ref(src, dst, torch.tensor([3, 0]), torch.tensor([0, 2]))
    assert dst.tolist() == [[9.0, 10.0, 11.0], [-1.0, -1.0, -1.0], [0.0, 1.0, 2.0]]


def test_bad_shapes_are_rejected() -> None:
    """Mismatched segment sizes, dtypes or index lengths raise ValueError naming the problem."""
    a = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="segment sizes"):
        copy_segments(a, torch.zeros(2, 5), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="dtypes"):
        copy_segments(a, torch.zeros(2, 4, dtype=torch.float16), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="equal length"):
        copy_segments(a, torch.zeros(2, 4), torch.tensor([0, 1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="impl"):
        copy_segments(a, a.clone(), torch.tensor([0]), torch.tensor([0]), impl="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_host_to_device_zero_copy() -> None:
    """The Triton kernel reads a pinned host pool directly (UVA) and matches the reference."""
    host = torch.randn(64, 4096).pin_memory()
    dev = torch.zeros(32, 4096, device="cuda")
    src_idx = torch.arange(0, 64, 2)
    dst_idx = torch.randperm(32)
    copy_segments_triton(host, dev, src_idx.cuda(), dst_idx.cuda())
    expected = torch.zeros(32, 4096)
    copy_segments_ref(host, expected, src_idx, dst_idx)
    torch.testing.assert_close(dev.cpu(), expected, rtol=0, atol=0)
    back = torch.zeros(64, 4096).pin_memory()
    copy_segments_triton(dev, back, dst_idx.cuda(), src_idx.cuda())
    torch.cuda.synchronize()
    torch.testing.assert_close(back[src_idx], host[src_idx], rtol=0, atol=0)


def test_reference_row_loop_path_matches_index_path() -> None:
    """Large CPU segments (row-copy path) give the same result as the indexed path."""
    src = torch.randn(6, 8192)  # 32 KiB rows
    a = torch.zeros(4, 8192)
    b = torch.zeros(4, 8192)
    si, di = torch.tensor([5, 0, 3]), torch.tensor([2, 0, 1])
    copy_segments_ref(src, a, si, di)
    b.index_copy_(0, di, src.index_select(0, si))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("programs", [1, 2, None])
def test_a_program_cap_copies_everything(triton_device: str, programs: int | None) -> None:
    """A capped launch (fewer persistent programs than pairs: each program strides over several)
    copies exactly what the reference does; the cap only changes who copies what."""
    src, dst = _pools(torch.float32, 128, triton_device)
    g = torch.Generator().manual_seed(SEED)
    src_idx, dst_idx = torch.randint(0, 9, (7,), generator=g), torch.randperm(11, generator=g)[:7]
    expected = dst.clone()
    copy_segments_ref(src, expected, src_idx, dst_idx)
    copy_segments(src, dst, src_idx.to(triton_device), dst_idx.to(triton_device), impl="triton", programs=programs)
    torch.testing.assert_close(dst, expected, rtol=0, atol=0)


def test_programs_for_caps_and_refuses() -> None:
    from kernels.block_copy import INTERPRETER_PROGRAMS, programs_for

    t = torch.zeros(1)
    assert programs_for(t, 100) == INTERPRETER_PROGRAMS and programs_for(t, 100, 16) == 16
    assert programs_for(t, 5, 16) == 5 and programs_for(t, 0, 16) == 1  # never more programs than work
    with pytest.raises(ValueError, match="programs=0"):
        programs_for(t, 10, 0)


def test_the_cuda_engine_hands_its_kept_word_views_to_the_kernel_between_its_pools() -> None:
    """``CudaTransferEngine._pool_words`` (its mapping only: the engine itself needs CUDA): an H2D or
    D2H between the engine's two pools gets the kept word views, in the copy's direction; any other
    pair (token rows) passes through unchanged, for the kernel to view."""
    from types import SimpleNamespace

    from sglang_ext.dataplane.cuda_transfer_engine import CudaTransferEngine

    host, dev = torch.zeros(4, 1500, dtype=torch.bfloat16), torch.zeros(6, 1500, dtype=torch.bfloat16)
    engine = SimpleNamespace(host=host, dev=dev, _words=(word_view(host), word_view(dev)))
    h2d = CudaTransferEngine._pool_words(engine, host, dev)
    assert h2d[0] is engine._words[0] and h2d[1] is engine._words[1]
    d2h = CudaTransferEngine._pool_words(engine, dev, host)
    assert d2h[0] is engine._words[1] and d2h[1] is engine._words[0]
    rows = torch.zeros(3, 1500, dtype=torch.bfloat16)
    assert CudaTransferEngine._pool_words(engine, rows, host) == (rows, host)
    assert CudaTransferEngine._pool_words(engine, host.clone(), dev)[0] is not engine._words[0]  # another tensor


@pytest.mark.parametrize("count", [0, 2, 4])
def test_a_counted_copy_reads_its_count_on_the_device(triton_device: str, count: int) -> None:
    """A graph's launch (``count``: a device int32) copies the first ``count`` pairs of its lists
    and nothing after them; rewriting the count and running the same call again copies the new
    prefix. Control: the whole lists copy more (the pairs past ``count`` move other segments)."""
    src, dst = _pools(torch.float32, 6, triton_device)
    src_idx = torch.tensor([0, 3, 8, 1, 5, 2], device=triton_device)
    dst_idx = torch.tensor([10, 4, 0, 7, 2, 9], device=triton_device)
    n = torch.tensor([count], dtype=torch.int32, device=triton_device)
    expected = dst.clone()
    copy_segments_ref(src, expected, src_idx[:count].cpu(), dst_idx[:count].cpu())
    got = dst.clone()
    copy_segments_triton(src, got, src_idx, dst_idx, count=n)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    n.fill_(count + 1)  # a replay over a longer list
    copy_segments_ref(src, expected, src_idx[: count + 1].cpu(), dst_idx[: count + 1].cpu())
    copy_segments_triton(src, got, src_idx, dst_idx, count=n)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    whole = dst.clone()
    copy_segments_triton(src, whole, src_idx, dst_idx)
    assert not torch.equal(whole, got)
