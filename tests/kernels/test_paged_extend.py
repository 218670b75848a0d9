"""Layered paged extend (prefill) attention: Triton kernel (interpreter on CPU, native on CUDA)
vs the dense fp32 torch reference; the reference vs torch's own SDPA; causality, window and
table controls that fail when the kernel reads the wrong keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_extend import paged_extend, paged_extend_ref, paged_extend_triton

SEED = 5
POOL_SLACK_PAGES = 5
"""Pool pages nobody points at (NaN: a stray read poisons the output)."""
TOLERANCE: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
}
"""Kernel vs reference where both dots run in fp32 (the interpreter; fp32 caches): 16-bit outputs
round once (one ulp), fp32 differs by summation order."""
GPU_TOLERANCE: dict[torch.dtype, dict[str, Any]] = {
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
}
"""On CUDA the dots run on the tensor cores in the cache dtype (q and the probabilities rounded
to it, fp32 accumulation), as FlashAttention does: a few ulps of the 16-bit type."""


@dataclass(frozen=True)
class Case:
    """``lens[b] = (prefix, new)``: tokens already cached and tokens this forward adds."""

    page_size: int
    lens: tuple[tuple[int, int], ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    soft_cap: float
    window_left: int
    dtype: torch.dtype


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = (
    Case(16, ((0, 37),), 2, 2, 64, 0.0, -1, F32),
    Case(16, ((0, 20), (13, 1), (32, 17), (5, 40)), 8, 2, 64, 0.0, -1, F32),
    Case(4, ((9, 23), (0, 1)), 4, 1, 128, 30.0, -1, F32),
    Case(16, ((20, 30), (0, 9)), 4, 4, 64, 0.0, 7, F32),
    Case(16, ((3, 45), (16, 16)), 8, 2, 64, 5.0, 20, BF16),
    Case(1, ((7, 12), (0, 20)), 4, 1, 64, 0.0, -1, BF16),
    Case(1, ((4, 9),), 2, 2, 64, 10.0, 0, F16),
    Case(16, ((40, 0), (0, 33)), 4, 2, 64, 0.0, -1, F32),
)
"""Page sizes 1, 4, 16; no prefix, a prefix ending mid-page and on a page boundary; one new token
(a decode row of a mixed batch); more new tokens than one block (16 under the interpreter); a
request with no new tokens; GQA 1, 2, 4; head_dim 64 and 128; soft cap; windows of 0, inside a
page, wider than a page; fp32, bf16, fp16."""


def _build(case: Case, shared_prefix: bool = False, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Scattered pool (pages in random order; request 1 shares request 0's first page when
    ``shared_prefix``), q rows in SGLang's extend layout; unreferenced pages and the unused tail
    of last pages are NaN."""
    g = torch.Generator().manual_seed(seed)
    ps = case.page_size
    seq = [p + e for p, e in case.lens]
    counts = [-(-n // ps) for n in seq]
    own = sum(counts) - (1 if shared_prefix else 0)
    num_pages = own + POOL_SLACK_PAGES
    ids = iter(torch.randperm(num_pages, generator=g)[:own].tolist())
    indices: list[int] = []
    for b, c in enumerate(counts):
        pages = [next(ids) for _ in range(c - (1 if shared_prefix and b == 1 else 0))]
        indices += [indices[0], *pages] if shared_prefix and b == 1 else pages
    shape = (num_pages, ps, case.kv_heads, case.head_dim)
    k, v = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    filled = torch.zeros(num_pages, ps, dtype=torch.bool)
    base = 0
    for n, c in zip(seq, counts, strict=True):
        for t in range(n):
            filled[indices[base + t // ps], t % ps] = True
        base += c
    k[filled] = torch.randn(int(filled.sum()), case.kv_heads, case.head_dim, generator=g) * 2
    v[filled] = torch.randn(int(filled.sum()), case.kv_heads, case.head_dim, generator=g)
    new = [e for _, e in case.lens]
    starts = torch.tensor(new).cumsum(0) - torch.tensor(new)
    return {
        "q": torch.randn(sum(new), case.q_heads, case.head_dim, generator=g).to(case.dtype),
        "k_cache": k.to(case.dtype),
        "v_cache": v.to(case.dtype),
        "q_start": starts.to(torch.int32),
        "q_lens": torch.tensor(new, dtype=torch.int32),
        "kv_indptr": torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32),
        "kv_indices": torch.tensor(indices, dtype=torch.int32),
        "kv_lens": torch.tensor(seq, dtype=torch.int32),
    }


def _max_new(t: dict[str, torch.Tensor]) -> int:
    return int(t["q_lens"].max()) if t["q_lens"].numel() else 0


def _run(t: dict[str, torch.Tensor], case: Case, device: str, **over: object) -> torch.Tensor:
    dev = {name: x.to(device) for name, x in t.items()}
    kwargs = {"logits_soft_cap": case.soft_cap, "window_left": case.window_left, **over}
    return paged_extend_triton(**dev, max_q_len=_max_new(t), **kwargs).cpu()  # type: ignore[arg-type]


def _ref(t: dict[str, torch.Tensor], case: Case, **over: object) -> torch.Tensor:
    kwargs = {"logits_soft_cap": case.soft_cap, "window_left": case.window_left, **over}
    return paged_extend_ref(**t, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ps{c.page_size}-b{len(c.lens)}-g{c.q_heads // c.kv_heads}"
                         f"-d{c.head_dim}-cap{c.soft_cap:g}-w{c.window_left}-{str(c.dtype)[6:]}")
def test_triton_matches_reference(triton_device: str, case: Case) -> None:
    """Every new token's output equals dense fp32 causal attention over its request's pages (within
    the dtype's tolerance), pages scattered and shared; inputs are left unchanged."""
    t = _build(case, shared_prefix=len(case.lens) > 1 and all(p + e > case.page_size for p, e in case.lens[:2]))
    before = {name: x.clone() for name, x in t.items()}
    expected = _ref(t, case)
    assert torch.isfinite(expected).all()
    got = _run(t, case, triton_device)
    assert got.dtype == case.dtype and got.shape == t["q"].shape
    on_tensor_cores = triton_device == "cuda" and case.dtype in GPU_TOLERANCE
    torch.testing.assert_close(got, expected, **(GPU_TOLERANCE if on_tensor_cores else TOLERANCE)[case.dtype])
    for name, x in t.items():
        torch.testing.assert_close(x, before[name], rtol=0, atol=0, equal_nan=True)


VARIANTS = {"pack": {"PACK_GQA": True}, "mask-every-tile": {"SPLIT_MASK": False},
            "pack-mask-every-tile": {"PACK_GQA": True, "SPLIT_MASK": False},
            "pack-wide-rows": {"PACK_GQA": True, "BLOCK_M": 32, "BLOCK_N": 16}}
"""The kernel's other launch forms (the tuning probe's, ``benchmarks/results/gpu/probes/extend_probe.py``):
the q heads of a kv head packed into the rows, every tile masked (no unmasked tiles below the
diagonal), packed rows over a block that spans several tokens' heads and a key tile smaller than
it."""


ODD_GROUP = Case(16, ((5, 30), (40, 11)), 7, 1, 64, 0.0, -1, F32)
"""Seven q heads a kv head (Qwen2-7B's 28 / 4): packed rows of a block end inside a token's group."""


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", (*CASES[1:6], ODD_GROUP), ids=lambda c: f"b{len(c.lens)}-g{c.q_heads // c.kv_heads}"
                         f"-ps{c.page_size}-cap{c.soft_cap:g}-w{c.window_left}")
def test_launch_variants_match_reference(triton_device: str, case: Case, variant: str) -> None:
    """Each launch form equals the reference on the cases with GQA, soft caps, windows and page 1."""
    t = _build(case, shared_prefix=all(p + e > case.page_size for p, e in case.lens[:2]))
    got = _run(t, case, triton_device, launch=VARIANTS[variant])
    tol = GPU_TOLERANCE if triton_device == "cuda" and case.dtype in GPU_TOLERANCE else TOLERANCE
    torch.testing.assert_close(got, _ref(t, case), **tol[case.dtype])


def test_negative_control_packed_rows_read_by_the_wrong_head_fail(triton_device: str) -> None:
    """Control: the packed launch told the group is 1 (each row's q head read as the kv head's
    first) disagrees with the reference; the premise, the same launch at its true group, agrees."""
    import kernels.paged_extend as pe

    case = CASES[1]  # 8 q heads over 2 kv heads
    t = _build(case)
    dev = {name: x.to(triton_device) for name, x in t.items()}
    good = pe.paged_extend_triton(**dev, max_q_len=_max_new(t), launch={"PACK_GQA": True}).cpu()
    torch.testing.assert_close(good, _ref(t, case), **TOLERANCE[case.dtype])
    bad = pe.paged_extend_triton(**{**dev, "k_cache": dev["k_cache"].repeat(1, 1, 4, 1),
                                    "v_cache": dev["v_cache"].repeat(1, 1, 4, 1)},
                                 max_q_len=_max_new(t), launch={"PACK_GQA": True}).cpu()
    assert not torch.allclose(bad, _ref(t, case), **TOLERANCE[case.dtype])


def test_a_packed_grid_past_cudas_limit_launches_unpacked() -> None:
    """Packing multiplies the row blocks by the group: an MQA prefill of 200K new tokens at group
    71 (Falcon-7B) would need 110,938 blocks of 128 rows, past CUDA's 65,535; the launch goes
    unpacked (1,563 blocks). Control: at 100K tokens the packed grid fits (55,469) and stays."""
    import kernels.paged_extend as pe

    packed = {"BLOCK_M": 128, "PACK_GQA": True}
    options, grid = pe.extend_grid(packed, 2, 71, 1, 200_000)
    assert not options["PACK_GQA"] and grid == (2, 71, 1563)
    options, grid = pe.extend_grid(packed, 2, 71, 1, 100_000)
    assert options["PACK_GQA"] and grid == (2, 1, 55_469) and grid[2] <= pe.MAX_GRID_Z
    assert pe.extend_grid({"BLOCK_M": 64, "PACK_GQA": False}, 3, 8, 2, 100) == ({"BLOCK_M": 64, "PACK_GQA": False},
                                                                                (3, 8, 2))


NEG_CASE = CASES[1]


def test_negative_control_corrupt_prefix_page_fails(triton_device: str) -> None:
    """Corrupting one cached-prefix page of request 2 makes the output disagree with the clean
    reference: the kernel reads the prefix through the table."""
    t = _build(NEG_CASE)
    expected = _ref(t, NEG_CASE)
    page = int(t["kv_indices"][int(t["kv_indptr"][2])])
    t["k_cache"][page] += 3.0
    t["v_cache"][page] -= 3.0
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_run(t, NEG_CASE, triton_device), expected, **TOLERANCE[F32])


def test_negative_control_wrong_table_entry_fails(triton_device: str) -> None:
    """One table entry pointing at another request's page breaks the comparison."""
    t = _build(NEG_CASE)
    expected = _ref(t, NEG_CASE)
    indptr = t["kv_indptr"]
    t["kv_indices"][int(indptr[2]) + 1] = t["kv_indices"][int(indptr[3])]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_run(t, NEG_CASE, triton_device), expected, **TOLERANCE[F32])


def test_causal_a_later_key_changes_only_later_queries(triton_device: str) -> None:
    """Changing the K/V at position ``p`` (a new token of request 0, past the first block) leaves
    every query before ``p`` unchanged, bit for bit, and changes the query at ``p`` and after:
    the kernel masks the future and attends the present (either violation fails here)."""
    case = Case(4, ((5, 30),), 2, 1, 64, 0.0, -1, F32)
    t = _build(case)
    before = _run(t, case, triton_device)
    pos = 5 + 20  # new token 20: the second interpreter block of 16
    page = int(t["kv_indices"][pos // 4])
    t["k_cache"][page, pos % 4] += 1.0
    t["v_cache"][page, pos % 4] += 1.0
    after = _run(t, case, triton_device)
    torch.testing.assert_close(after[:20], before[:20], rtol=0, atol=0)
    assert ((after[20:] - before[20:]).abs().amax(dim=(1, 2)) > 1e-4).all()
    torch.testing.assert_close(after, _ref(t, case), **TOLERANCE[F32])


def test_window_drops_keys_behind_it(triton_device: str) -> None:
    """With ``window_left=3`` a key 4 positions behind every query of a block is not read
    (changing it changes nothing), while the same key changes outputs with no window."""
    case = Case(4, ((8, 8),), 2, 2, 64, 0.0, 3, F32)
    t = _build(case)
    windowed, full = _run(t, case, triton_device), _run(t, case, triton_device, window_left=-1)
    t["k_cache"][int(t["kv_indices"][0]), 3] += 2.0  # position 3: more than 3 behind positions >= 8
    torch.testing.assert_close(_run(t, case, triton_device), windowed, rtol=0, atol=0)
    assert (_run(t, case, triton_device, window_left=-1) - full).abs().max() > 1e-4


def test_reference_matches_torch_sdpa() -> None:
    """The reference equals torch's SDPA over the request's contiguous K/V with the causal mask
    offset by the prefix (checks gather order, GQA mapping and the prefix offset of the mask)."""
    case = Case(4, ((6, 10),), 4, 2, 16, 0.0, -1, F32)
    t = _build(case)
    tok = torch.arange(16)
    pages = t["kv_indices"].long()
    k = t["k_cache"][pages[tok // 4], tok % 4].repeat_interleave(2, dim=1)  # [16, Hq, D]
    v = t["v_cache"][pages[tok // 4], tok % 4].repeat_interleave(2, dim=1)
    mask = tok[None, :] <= (6 + torch.arange(10))[:, None]
    dense = F.scaled_dot_product_attention(t["q"].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(_ref(t, case), dense, rtol=1e-5, atol=1e-5)


def test_dispatcher_and_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` off CUDA without the interpreter is the reference; bad arguments are ValueErrors
    naming the problem."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = CASES[1]
    t = _build(case)
    torch.testing.assert_close(paged_extend(**t, max_q_len=_max_new(t)), _ref(t, case), rtol=0, atol=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_indptr \\[B\\+1\\]"):
        paged_extend(**{**t, "kv_indptr": t["kv_indptr"][:-1]}, max_q_len=40, impl="torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_extend(**{**t, "q": torch.zeros(t["q"].shape[0], 3, 64)}, max_q_len=40, impl="torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_left"):
        paged_extend(**t, max_q_len=40, window_left=-2, impl="torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="new of"):
        paged_extend(**{**t, "q_lens": t["q_lens"] + 100}, max_q_len=140, impl="torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="impl"):
        paged_extend(**t, max_q_len=40, impl="cuda")  # type: ignore[arg-type]


def test_max_q_len_is_checked(triton_device: str) -> None:
    case = CASES[0]
    t = {name: x.to(triton_device) for name, x in _build(case).items()}
    with pytest.raises(ValueError, match="max_q_len"):
        paged_extend_triton(**t, max_q_len=-1)  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_gpu_llama_shapes(dtype: torch.dtype) -> None:
    """Llama-3-8B prefill shapes (32 q / 8 kv heads x 128, page 16): a 1.5K prompt, a chunk of 512
    after a 1K cached prefix, short prompts and a decode row, on the tensor-core path; capped and
    windowed too."""
    lens = ((0, 1500), (1024, 512), (0, 7), (300, 1), (16, 64))
    case = Case(16, lens, 32, 8, 128, 0.0, -1, dtype)
    t = _build(case, shared_prefix=True)
    dev = {name: x.cuda() for name, x in t.items()}
    got = paged_extend(**dev, max_q_len=_max_new(t))  # type: ignore[arg-type]
    torch.testing.assert_close(got.cpu(), _ref(t, case), **GPU_TOLERANCE[dtype])
    capped = paged_extend(**dev, max_q_len=_max_new(t), logits_soft_cap=30.0, window_left=255)  # type: ignore[arg-type]
    torch.testing.assert_close(capped.cpu(), _ref(t, case, logits_soft_cap=30.0, window_left=255),
                               **GPU_TOLERANCE[dtype])


GPU_CASES = (
    Case(16, ((0, 300), (200, 77)), 8, 4, 256, 50.0, 4095, BF16),  # Gemma-2's head_dim 256, cap, window
    Case(1, ((0, 130), (64, 1)), 8, 2, 128, 0.0, -1, F16),  # page size 1
    Case(16, ((0, 200), (100, 50)), 8, 2, 128, 0.0, 63, F32),  # fp32 caches: the fp32 dots, smaller tiles
    Case(16, ((0, 150), (40, 90)), 8, 4, 256, 0.0, -1, F32),  # fp32 at head_dim 256: 32 x 16 tiles
    Case(16, ((0, 100),), 4, 4, 80, 0.0, -1, BF16),  # a head_dim that is not a power of two
)
"""The CUDA launch settings beyond Llama's shapes: 8 warps at head_dim 256, fp32 tiles (both
sizes), page 1."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"ps{c.page_size}-d{c.head_dim}-{str(c.dtype)[6:]}")
def test_gpu_launch_settings(case: Case) -> None:
    t = _build(case, shared_prefix=False)
    got = _run(t, case, "cuda")
    tol = TOLERANCE[F32] if case.dtype == F32 else GPU_TOLERANCE[case.dtype]
    torch.testing.assert_close(got, _ref(t, case), **tol)


def test_the_extend_tiles_follow_the_gpus_shared_memory() -> None:
    """16-bit caches: 128 GQA-packed rows x 64 keys up to head_dim 128 on 227 KB GPUs (H100, H200,
    B200), 64 x 64 on any other GPU (the 64 KB ones included), and at
    head_dim 256 by the block's limit -- 64 x 64 on A100 / H100 / B200, 64 x 32 on 99 KB GPUs, 32 x
    32 on 64 KB ones (T4, MI300); fp32 caches 32 x 32, 32 x 16 at 256; the interpreter its own.
    ``tests/kernels/test_shared_memory.py`` compiles each for those GPUs."""
    import kernels.paged_extend as pe

    def tiles(dtype: torch.dtype, head_dim: int, limit: int | None) -> tuple[object, object]:
        options = pe.extend_launch_options(dtype, head_dim, shared_per_block=limit)
        return options["BLOCK_M"], options["BLOCK_N"]

    for dtype in (torch.bfloat16, torch.float16):
        assert tiles(dtype, 128, 65_536) == pe.CUDA_BLOCKS == tiles(dtype, 128, 166_912)  # A100 included
        for head_dim in (64, 80, 128):  # H100 / H200 / B200: GQA-packed 128-row blocks (run 22, H200)
            options = pe.extend_launch_options(dtype, head_dim, shared_per_block=232_448)
            assert (options["BLOCK_M"], options["BLOCK_N"]) == pe.CUDA_WIDE_ROW_BLOCKS
            assert options["PACK_GQA"] and options["num_stages"] == 2 and options["num_warps"] == 8
        assert not pe.extend_launch_options(dtype, 128, shared_per_block=166_912)["PACK_GQA"]
        assert [tiles(dtype, 256, limit) for limit in (232_448, 166_912, 163_840, 101_376, 65_536)] == [
            pe.CUDA_BLOCKS, pe.CUDA_BLOCKS, pe.CUDA_NARROW_BLOCKS, pe.CUDA_NARROW_BLOCKS, pe.CUDA_SMALL_BLOCKS]
        assert tiles(dtype, 256, pe.NARROW_TILES_SHARED - 1) == pe.CUDA_SMALL_BLOCKS
    assert tiles(torch.float32, 256, 232_448) == pe.CUDA_FP32_WIDE_BLOCKS == tiles(torch.float32, 256, 65_536)
    assert tiles(torch.float32, 128, 65_536) == pe.CUDA_FP32_BLOCKS
    assert tiles(torch.bfloat16, 256, None) == pe.INTERPRETER_BLOCKS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("limit", (101_376, 65_536))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_gpu_narrow_tiles_of_99_kb_gpus_at_head_dim_256(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                        limit: int) -> None:
    """The tiles a 16-bit head_dim-256 extend takes on GPUs with 99 KB of shared memory a block (L4,
    A10, RTX: 64 x 32) and with 64 KB (T4, MI300: 32 x 32) decode right here too: the launcher is
    told this GPU allows ``limit`` bytes."""
    import kernels.paged_extend as pe

    expected = pe.CUDA_NARROW_BLOCKS if limit >= pe.NARROW_TILES_SHARED else pe.CUDA_SMALL_BLOCKS
    options = pe.extend_launch_options(dtype, 256, shared_per_block=limit)
    assert (options["BLOCK_M"], options["BLOCK_N"]) == expected
    monkeypatch.setattr(pe, "shared_per_block_of", lambda device: limit)
    case = Case(16, ((0, 300), (200, 77)), 8, 4, 256, 50.0, 4095, dtype)
    t = _build(case, shared_prefix=False)
    torch.testing.assert_close(_run(t, case, "cuda"), _ref(t, case), **GPU_TOLERANCE[dtype])


def test_a_permuted_query_gives_the_references_output_in_a_dense_tensor(triton_device: str) -> None:
    """A dense query whose head_dim is not its innermost dimension (a permuted view) is made
    contiguous for the kernel, and the output is allocated dense, as the kernel stores it (head_dim
    at stride 1): equal to the reference. The premise, the control: an output shaped like the
    permuted query (``empty_like``) would not have head_dim at stride 1."""
    case = CASES[0]
    t = _build(case)
    q = t["q"]
    permuted = q.permute(2, 0, 1).contiguous().permute(1, 2, 0)  # same values, head_dim outermost
    assert torch.equal(permuted, q) and permuted.stride(2) != 1
    assert torch.empty_like(permuted).stride(2) != 1
    got = _run({**t, "q": permuted}, case, triton_device)
    assert got.stride(2) == 1
    torch.testing.assert_close(got, _ref(t, case), **TOLERANCE[case.dtype])

