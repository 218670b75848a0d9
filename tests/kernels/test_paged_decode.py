"""Layered paged decode attention: Triton kernel (interpreter on CPU, native on CUDA) vs the
dense fp32 torch reference, over scattered, shared and partly filled pages."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kernels.lazy_jit import LazyKernel
from kernels.paged_decode import (
    MAX_KV_SPLITS,
    _merge_splits_kernel,
    decode_launch_options,
    head_blocks,
    kv_lens_from_last_page_len,
    kv_splits,
    paged_decode,
    paged_decode_ref,
    paged_decode_triton,
)

SEED = 11
POOL_SLACK_PAGES = 7
"""Pool pages nobody points at (filled with NaN: a stray read poisons the output)."""
TOLERANCE: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
}
"""Kernel vs reference, per dtype, where the kernel's dots run in fp32 (the interpreter; fp32
caches). Both accumulate in fp32 and round the output once, so 16-bit outputs may differ by one
ulp (bf16: 2^-7 relative; measured max 7.8e-3); fp32 by summation order (measured max 1.3e-6
absolute)."""
GPU_TOLERANCE: dict[torch.dtype, dict[str, Any]] = {
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 5e-3, "rtol": 5e-3},
}
"""On CUDA a 16-bit cache's dots run on the tensor cores in its dtype (q and the probabilities
rounded to it, fp32 accumulation; ``decode_launch_options``): a few ulps of the 16-bit type, the
extend kernel's tolerance (``tests/kernels/test_paged_extend.py``)."""


def _tol(dtype: torch.dtype, device: str) -> dict[str, Any]:
    """The tolerance of a kernel output of ``dtype`` computed on ``device``."""
    return GPU_TOLERANCE[dtype] if device == "cuda" and dtype in GPU_TOLERANCE else TOLERANCE[dtype]


@dataclass(frozen=True)
class Case:
    """One grid point; ``lens`` are tokens per request (0 and 1 included where listed)."""

    page_size: int
    lens: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    soft_cap: float
    window_left: int
    dtype: torch.dtype
    splits: int


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASES = (
    Case(16, (37,), 2, 2, 64, 0.0, -1, F32, 1),
    Case(16, (1, 40, 16, 23), 8, 2, 64, 0.0, -1, F32, 2),
    Case(16, (33, 5), 4, 1, 128, 30.0, -1, F32, 1),
    Case(16, (50, 17, 1), 4, 4, 64, 0.0, 7, F32, 3),
    Case(16, (45, 2), 8, 2, 64, 5.0, 20, BF16, 2),
    Case(16, (31, 64, 1), 4, 1, 64, 0.0, -1, BF16, 1),
    Case(1, (9, 1, 20), 4, 1, 64, 0.0, -1, F32, 1),
    Case(1, (13, 6), 2, 2, 64, 10.0, 3, BF16, 2),
    Case(16, (19, 1), 4, 2, 64, 0.0, 0, F16, 1),
    Case(1, (1,), 4, 1, 128, 0.0, -1, BF16, 1),
    Case(16, (16, 32, 47, 3), 8, 2, 128, 50.0, 31, BF16, 4),
    Case(16, (100,), 4, 4, 64, 0.0, 15, F32, 2),
    Case(1, (40, 7), 8, 2, 64, 20.0, -1, F32, 2),
    Case(16, (21, 40), 64, 2, 256, 0.0, -1, F32, 2),
)
"""Page size 1 and 16; batch 1-4; ragged lengths (mid-page ends, single-token requests, one full
page); GQA 1, 2, 4 and 32 (at head_dim 256: two head blocks of 16 per kv head, as
``MAX_BLOCK_HEADS`` has it); head_dim 64, 128 and 256; soft cap and window on and off (windows of 0, inside one
page, exactly one and two pages, wider than the request); fp32, bf16, fp16; 1-4 KV splits (the
split-merge path and empty splits of short requests)."""


def _build(case: Case, shared_prefix: bool, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Scattered pool: pages in random order, request 1 shares request 0's first page when
    ``shared_prefix``; unreferenced pages and the unused tail of last pages hold NaN."""
    g = torch.Generator().manual_seed(seed)
    ps = case.page_size
    counts = [-(-n // ps) for n in case.lens]
    own = sum(counts) - (1 if shared_prefix else 0)
    num_pages = own + POOL_SLACK_PAGES
    perm = torch.randperm(num_pages, generator=g)
    ids = iter(perm[:own].tolist())
    indices: list[int] = []
    for b, c in enumerate(counts):
        pages = [next(ids) for _ in range(c - (1 if shared_prefix and b == 1 else 0))]
        if shared_prefix and b == 1:
            pages = [indices[0], *pages]
        indices += pages
    shape = (num_pages, ps, case.kv_heads, case.head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    filled = torch.zeros(num_pages, ps, dtype=torch.bool)
    pos = 0
    for n, c in zip(case.lens, counts, strict=True):
        for t in range(n):
            filled[indices[pos + t // ps], t % ps] = True
        pos += c
    k[filled] = torch.randn(int(filled.sum()), case.kv_heads, case.head_dim, generator=g) * 2
    v[filled] = torch.randn(int(filled.sum()), case.kv_heads, case.head_dim, generator=g)
    indptr = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "q": torch.randn(len(case.lens), case.q_heads, case.head_dim, generator=g).to(case.dtype),
        "k_cache": k.to(case.dtype),
        "v_cache": v.to(case.dtype),
        "kv_indptr": indptr,
        "kv_indices": torch.tensor(indices, dtype=torch.int32),
        "kv_lens": torch.tensor(case.lens, dtype=torch.int32),
    }


def _run(t: dict[str, torch.Tensor], case: Case, device: str, **over: object) -> torch.Tensor:
    dev = {name: x.to(device) for name, x in t.items()}
    kwargs = {"logits_soft_cap": case.soft_cap, "window_left": case.window_left, "num_kv_splits": case.splits,
              **over}
    return paged_decode_triton(**dev, **kwargs).cpu()  # type: ignore[arg-type]


def _ref(t: dict[str, torch.Tensor], case: Case) -> torch.Tensor:
    return paged_decode_ref(**t, logits_soft_cap=case.soft_cap, window_left=case.window_left)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ps{c.page_size}-b{len(c.lens)}-g{c.q_heads // c.kv_heads}"
                         f"-d{c.head_dim}-cap{c.soft_cap:g}-w{c.window_left}-{str(c.dtype)[6:]}-s{c.splits}")
def test_triton_matches_reference(triton_device: str, case: Case) -> None:
    """Every request's output equals dense fp32 attention over its own pages (within the dtype's
    tolerance), pages scattered and one shared by two requests; inputs are left unchanged."""
    t = _build(case, shared_prefix=len(case.lens) > 1)
    before = {name: x.clone() for name, x in t.items()}
    expected = _ref(t, case)
    assert torch.isfinite(expected).all()
    got = _run(t, case, triton_device)
    assert got.dtype == case.dtype and got.shape == t["q"].shape
    torch.testing.assert_close(got, expected, **_tol(case.dtype, triton_device))
    for name, x in t.items():
        torch.testing.assert_close(x, before[name], rtol=0, atol=0, equal_nan=True)


NEG_CASE = CASES[1]


def test_negative_control_corrupt_page_fails(triton_device: str) -> None:
    """Corrupting one page the table points to (request 2's only page) makes the kernel's output
    disagree with the reference of the clean pool: the test sees what the kernel reads."""
    t = _build(NEG_CASE, shared_prefix=True)
    expected = _ref(t, NEG_CASE)
    page = int(t["kv_indices"][int(t["kv_indptr"][2])])
    t["k_cache"][page] += 3.0
    t["v_cache"][page] -= 3.0
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_run(t, NEG_CASE, triton_device), expected, **TOLERANCE[NEG_CASE.dtype])


def test_negative_control_wrong_table_entry_fails(triton_device: str) -> None:
    """Pointing one table entry at another request's page (same data shape, other values) makes
    the output disagree with the reference of the true table."""
    t = _build(NEG_CASE, shared_prefix=False)
    expected = _ref(t, NEG_CASE)
    indptr = t["kv_indptr"]
    # request 1's second page -> request 3's first page (both full pages of valid tokens)
    t["kv_indices"][int(indptr[1]) + 1] = t["kv_indices"][int(indptr[3])]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_run(t, NEG_CASE, triton_device), expected, **TOLERANCE[NEG_CASE.dtype])


def test_splits_agree_and_empty_request_is_zero(triton_device: str) -> None:
    """1 and 4 KV splits give the same result (more splits than token tiles leaves splits empty);
    a request with no tokens outputs zeros, in the kernel and the reference."""
    case = Case(4, (0, 11), 2, 1, 64, 0.0, -1, F32, 1)
    t = _build(case, shared_prefix=False)
    expected = _ref(t, case)
    assert expected[0].abs().max() == 0
    one = _run(t, case, triton_device)
    four = _run(t, case, triton_device, num_kv_splits=4)
    torch.testing.assert_close(one, expected, **TOLERANCE[F32])
    torch.testing.assert_close(four, one, **TOLERANCE[F32])


def test_every_split_count_launches_the_same_compiled_kernels(triton_device: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager decode sizes the split count from each step's pages (:func:`kv_splits`, 1 to 16). A
    compile-time argument that depended on it would compile a kernel per count while serving (a
    JIT stall on a request's path each): the two kernels' compile-time (keyword) arguments are
    the same for 1, 2, 3, 7 and 16 splits, the merge kernel does not specialize its split count,
    and the results agree with the reference. The control: the same recording tells two soft-cap
    settings apart (a real compile-time difference)."""
    launched: dict[str, list[dict[str, Any]]] = {}
    real = LazyKernel.__getitem__

    def recording(self: LazyKernel, grid: Any) -> Any:
        launch = real(self, grid)

        def run(*args: Any, **kwargs: Any) -> Any:
            launched.setdefault(self.fn.__name__, []).append(kwargs)
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(LazyKernel, "__getitem__", recording)
    case = Case(4, (0, 5, 70), 4, 2, 32, 0.0, -1, F32, 1)
    t = _build(case, shared_prefix=False)
    expected = _ref(t, case)
    for splits in (1, 2, 3, 7, MAX_KV_SPLITS):
        torch.testing.assert_close(_run(t, case, triton_device, num_kv_splits=splits), expected, **TOLERANCE[F32])
    assert sorted(launched) == ["_decode_split_fn", "_merge_splits_fn"]
    for name, calls in launched.items():
        assert len(calls) == 5 and all(kw == calls[0] for kw in calls), (name, calls)
    assert "splits" in _merge_splits_kernel.jit_options["do_not_specialize"]
    for bad in (0, MAX_KV_SPLITS + 1):
        with pytest.raises(ValueError, match="num_kv_splits"):
            _run(t, case, triton_device, num_kv_splits=bad)
    launched.clear()  # the control
    _run(t, case, triton_device, num_kv_splits=2, logits_soft_cap=30.0)
    _run(t, case, triton_device, num_kv_splits=2)
    first, second = launched["_decode_split_fn"]
    assert first != second and first["USE_CAP"] != second["USE_CAP"]


def test_launch_options_put_16_bit_caches_on_the_tensor_cores_on_cuda_only() -> None:
    """On CUDA a 16-bit cache takes tensor-core dots (4 warps); an fp32 cache keeps the fp32 dots
    (8 warps from BLOCK_D 128); the interpreter always the fp32 dots, without a warp count. Head
    blocks cover the group: 32 q heads per kv head at head_dim 256 take two tiles of 16."""
    for dtype in (BF16, F16):
        low = decode_launch_options(dtype, 4, 128, cuda=True)
        assert low["LOW_PRECISION"] and low["num_warps"] == 4 and low["HEAD_BLOCKS"] == 1
    fp32 = decode_launch_options(F32, 4, 128, cuda=True)
    assert not fp32["LOW_PRECISION"] and fp32["num_warps"] == 8
    assert decode_launch_options(F32, 4, 64, cuda=True)["num_warps"] == 4
    interp = decode_launch_options(BF16, 4, 128, cuda=False)
    assert not interp["LOW_PRECISION"] and "num_warps" not in interp
    wide = decode_launch_options(BF16, 32, 256, cuda=True)
    assert (wide["BLOCK_H"], wide["HEAD_BLOCKS"], wide["BLOCK_D"], wide["BLOCK_N"]) == (16, 2, 256, 32)
    # an fp32 cache at head_dim 256 takes 16-token tiles on a GPU (64 KB GPUs), 32 elsewhere
    assert decode_launch_options(F32, 4, 256, cuda=True)["BLOCK_N"] == 16
    assert decode_launch_options(F32, 4, 128, cuda=True)["BLOCK_N"] == 32 == decode_launch_options(
        F32, 4, 256, cuda=False)["BLOCK_N"]


def test_sixteen_token_tiles_match_the_reference(triton_device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 16-token tiles an fp32 cache takes at head_dim 256 on a GPU, run here (under the
    interpreter the launcher takes 32: forced to 16), match the reference with two splits and
    ragged lengths (a split boundary inside a page)."""
    pd = importlib.import_module("kernels.paged_decode")  # the package's ``paged_decode`` is the function
    real = pd.decode_launch_options
    seen: list[int] = []

    def sixteen(*args: object, **kwargs: object) -> dict:
        options = {**real(*args, **kwargs), "BLOCK_N": pd.FP32_WIDE_BLOCK_TOKENS}  # type: ignore[arg-type]
        seen.append(options["BLOCK_N"])
        return options

    monkeypatch.setattr(pd, "decode_launch_options", sixteen)
    case = CASES[-1]
    assert (case.head_dim, case.dtype, case.splits) == (256, F32, 2)
    t = _build(case, shared_prefix=True)
    torch.testing.assert_close(_run(t, case, triton_device), _ref(t, case), **_tol(case.dtype, triton_device))
    assert seen == [16]


def test_split_count_fills_the_gpu_within_the_tokens_of_the_batch() -> None:
    """About 2 programs per SM (rounded up), capped by the batch's 32-token tiles and by 16; one
    split for short contexts or an empty batch."""
    assert kv_splits(32, 8, 132, 100_000, 16) == 2  # 256 programs of 264 wanted: 2 splits
    assert kv_splits(3, 8, 132, 100_000, 16) == 11
    assert kv_splits(1, 8, 132, 100_000, 16) == MAX_KV_SPLITS
    assert kv_splits(4, 8, 132, 4 * 6, 16) == 3  # 96 tokens a request: 3 tiles
    assert kv_splits(8, 8, 132, 8, 16) == 1  # 16 tokens a request: one tile
    assert kv_splits(0, 8, 132, 0, 16) == 1
    # stage 1's head blocks count as programs: two blocks a kv head (MQA-like groups) halve the want
    assert kv_splits(3, 8, 132, 100_000, 16, 2) == 6 and kv_splits(3, 8, 132, 100_000, 16, 1) == 11
    assert (head_blocks(32, 256), head_blocks(8, 128), head_blocks(128, 128), head_blocks(128, 64)) == (2, 1, 2, 1)
    assert all(1 <= kv_splits(b, h, 132, p, 16) <= MAX_KV_SPLITS
               for b in (1, 2, 5, 64) for h in (1, 8) for p in (1, 9, 700, 50_000))


def test_layer_row_of_step_table(triton_device: str) -> None:
    """``kv_indices`` as one row of an ``[L, n]`` step table (``StepTables.tab[layer]``, a view at
    a non-zero offset) reads that layer's pages only; the other layers' rows point at NaN pages;
    int64 tables work as int32 ones."""
    case = CASES[1]
    t = _build(case, shared_prefix=True)
    expected = _ref(t, case)
    nan_pages = torch.arange(t["k_cache"].shape[0])[~torch.isfinite(t["k_cache"].float()).any(3).any(2).any(1)]
    assert nan_pages.numel() >= 1
    other = nan_pages[torch.zeros_like(t["kv_indices"], dtype=torch.long)].to(torch.int32)
    for dtype in (torch.int32, torch.int64):
        tab = torch.stack([other, t["kv_indices"], other]).to(dtype)
        got = _run({**t, "kv_indices": tab[1], "kv_indptr": t["kv_indptr"].to(dtype),
                    "kv_lens": t["kv_lens"].to(dtype)}, case, triton_device)
        torch.testing.assert_close(got, expected, **_tol(case.dtype, triton_device))


def test_reference_matches_dense_attention() -> None:
    """The reference equals plain softmax attention over the request's tokens in order (checks
    the reference itself: gather order, GQA head mapping, soft cap, window)."""
    case = Case(4, (10,), 4, 2, 8, 3.0, 5, F32, 1)
    t = _build(case, shared_prefix=False)
    pages = t["kv_indices"].long()
    tok = torch.arange(10)
    k = t["k_cache"][pages[tok // 4], tok % 4][4:]  # window_left=5: last 6 tokens
    v = t["v_cache"][pages[tok // 4], tok % 4][4:]
    q = t["q"][0]
    kv_head = torch.arange(4) // 2
    logits = torch.einsum("hd,thd->ht", q, k[:, kv_head]) / 8**0.5
    logits = 3.0 * torch.tanh(logits / 3.0)
    dense = torch.einsum("ht,thd->hd", logits.softmax(-1), v[:, kv_head])
    torch.testing.assert_close(_ref(t, case)[0], dense, rtol=1e-5, atol=1e-5)


def test_dispatcher_and_last_page_len(monkeypatch: pytest.MonkeyPatch) -> None:
    """``impl="torch"`` is the reference; ``auto`` off CUDA without the interpreter too; kv_lens
    rebuilt from FlashInfer's last_page_len equal the true lengths."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = CASES[1]
    t = _build(case, shared_prefix=True)
    expected = _ref(t, case)
    torch.testing.assert_close(paged_decode(**t, impl="torch"), expected, rtol=0, atol=0)  # type: ignore[arg-type]
    torch.testing.assert_close(paged_decode(**t), expected, rtol=0, atol=0)  # type: ignore[arg-type]
    last = t["kv_lens"] - (t["kv_indptr"][1:] - t["kv_indptr"][:-1] - 1) * case.page_size
    assert kv_lens_from_last_page_len(t["kv_indptr"], last, case.page_size).tolist() == list(case.lens)


def test_validation_messages() -> None:
    """Bad shapes, dtypes, GQA ratios, windows and impl names are ValueErrors naming the problem."""
    case = CASES[0]
    t = _build(case, shared_prefix=False)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_decode(**{**t, "q": torch.zeros(1, 3, 64)}, impl="torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k_cache and v_cache the same"):
        paged_decode(**{**t, "v_cache": t["v_cache"].half()}, impl="torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must have dtypes of"):
        paged_decode(**{**t, "q": t["q"].double()}, impl="torch")  # type: ignore[arg-type]


def test_query_wider_than_the_cache(triton_device) -> None:
    """SGLang keeps q in the model dtype over a narrower KV cache: under the interpreter's fp32 dots
    an fp32 query over a bf16 cache is read as is (no rounding of q to bf16) and the output has q's
    dtype; rounding q first changes the result (negative control). (On CUDA the tensor-core dots
    round q to the cache dtype, as SGLang's Triton decode casts it: the gpu test below.)"""
    case = CASES[0]
    t = _build(case, shared_prefix=False)
    k16, v16 = t["k_cache"].bfloat16(), t["v_cache"].bfloat16()
    q = t["q"].float()
    want = paged_decode_ref(**{**t, "q": q, "k_cache": k16.float(), "v_cache": v16.float()})  # type: ignore[arg-type]
    got = paged_decode(**{**t, "q": q, "k_cache": k16, "v_cache": v16})  # type: ignore[arg-type]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    rounded = paged_decode(**{**t, "q": q.bfloat16(), "k_cache": k16, "v_cache": v16}).float()  # type: ignore[arg-type]
    assert (rounded - want).abs().max() > 1e-4
    with pytest.raises(ValueError, match="window_left"):
        paged_decode(**t, window_left=-2, impl="torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logits_soft_cap"):
        paged_decode(**t, logits_soft_cap=-1.0, impl="torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="impl"):
        paged_decode(**t, impl="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot hold"):
        paged_decode(**{**t, "kv_lens": torch.tensor([33], dtype=torch.int32) + 16}, impl="torch")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_gpu_llama_shapes(dtype: torch.dtype) -> None:
    """Llama-3-8B decode shapes (32 q / 8 kv heads x 128, page 16, contexts to 2K, default
    splits) on CUDA match the reference."""
    lens = (2048, 1, 777, 1500, 16, 1023, 64, 300)
    case = Case(16, lens, 32, 8, 128, 0.0, -1, dtype, 1)
    t = _build(case, shared_prefix=True)
    dev = {name: x.cuda() for name, x in t.items()}
    got = paged_decode(**dev)  # type: ignore[arg-type]
    torch.testing.assert_close(got.cpu(), _ref(t, case), **GPU_TOLERANCE[dtype])
    capped = paged_decode(**dev, logits_soft_cap=30.0, window_left=255)  # type: ignore[arg-type]
    expected = paged_decode_ref(**t, logits_soft_cap=30.0, window_left=255)
    torch.testing.assert_close(capped.cpu(), expected, **GPU_TOLERANCE[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_gpu_head_blocks_on_the_tensor_cores(dtype: torch.dtype) -> None:
    """Gemma-like head_dim 256 with 32 q heads per kv head (two head blocks of 16 on the tensor
    cores), soft cap and window, match the reference; so does an fp32 query over the 16-bit cache
    (rounded to the cache dtype on the tensor cores, as SGLang's Triton decode casts q)."""
    case = Case(16, (600, 1, 77, 300), 64, 2, 256, 30.0, 127, dtype, 2)
    t = _build(case, shared_prefix=True)
    assert decode_launch_options(dtype, 32, 256, cuda=True)["HEAD_BLOCKS"] == 2
    got = _run(t, case, "cuda")
    torch.testing.assert_close(got, _ref(t, case), **GPU_TOLERANCE[dtype])
    wide_q = {**t, "q": t["q"].float()}
    torch.testing.assert_close(_run(wide_q, case, "cuda"), _ref(wide_q, case), **GPU_TOLERANCE[dtype])


def test_a_permuted_query_gives_the_references_output_in_a_dense_tensor(triton_device: str) -> None:
    """A dense query whose head_dim is not its innermost dimension is made contiguous for the
    kernel, and the output is allocated dense, as the kernel stores it (head_dim at stride 1):
    equal to the reference. The premise, the control: ``empty_like`` of the permuted query would
    not have head_dim at stride 1."""
    case = CASES[0]
    t = _build(case, shared_prefix=False)
    permuted = t["q"].permute(2, 0, 1).contiguous().permute(1, 2, 0)
    assert torch.equal(permuted, t["q"]) and permuted.stride(2) != 1
    assert torch.empty_like(permuted).stride(2) != 1
    got = _run({**t, "q": permuted}, case, triton_device)
    assert got.stride(2) == 1
    torch.testing.assert_close(got, _ref(t, case), **_tol(case.dtype, triton_device))
