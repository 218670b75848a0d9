"""Layered paged decode attention: one query token per request, K/V read through a page table.

With a layer-aware page table every layer of a request has its own device pages, but the CSR
shape FlashInfer schedules on is the same for all layers (``StepTables``): ``kv_indptr [B+1]``,
``kv_lens [B]`` and, per layer, ``kv_indices = tables.tab[layer]``. This kernel consumes exactly
that: token ``t`` of request ``b`` lives at ``cache[kv_indices[kv_indptr[b] + t // ps], t % ps]``
of the paged pools ``k_cache, v_cache [num_pages, page_size, kv_heads, head_dim]`` (NHD, the
layout of ``SlotKVStore.dev[0]``/``[1]``).

Semantics (those of FlashInfer's batch decode):

- GQA: q head ``h`` attends with kv head ``h // (q_heads // kv_heads)``.
- ``logits = q . k * sm_scale`` (default ``1 / sqrt(head_dim)``); with ``logits_soft_cap > 0``,
  ``logits = cap * tanh(logits / cap)`` (Gemma-2, Grok).
- ``window_left >= 0``: only the last ``window_left + 1`` tokens are attended (-1: all).
- fp32 accumulation (online softmax); a request with no tokens gets a zero output.

The Triton version is split-KV (flash-decoding): stage 1 runs one program per (request,
kv head, head block, split), the q heads of the kv head together (``tl.dot`` over a ``[BLOCK_H,
D]`` query tile; a group larger than the tile shared memory allows, :data:`MAX_BLOCK_HEADS`, takes
several head blocks), and writes a partial output with its log-sum-exp; stage 2 merges the splits.
On CUDA with a 16-bit cache the dots run on the tensor cores in the cache dtype (q rounded to it,
fp32 accumulation; :func:`decode_launch_options` says why: the fp32 FMA dots spill registers
there); under the interpreter (CI) and for fp32 caches both run in fp32
(``input_precision="ieee"``: the interpreter multiplies bf16 operands as raw bits, Triton 3.8), so
CI tests the kernel's indexing, masking and softmax, and the gpu-marked tests its 16-bit dots, as
for :mod:`kernels.paged_extend`. No host sync: the grid depends on shapes only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kernels.block_copy import HAVE_TRITON, triton_usable
from kernels.lazy_jit import LazyKernel

if HAVE_TRITON:
    import triton.language as tl

    # Reductions through ``tl.reduce`` with Triton's own combine functions: ``tl.max``/``tl.sum``
    # (and ``tl.cdiv``, ``tl.zeros``) are @jit helpers, which the interpreter cannot call when
    # triton was imported before TRITON_INTERPRET=1 was set (LazyKernel's case); ``tl.reduce`` is
    # a builtin the interpreter maps these two combine functions of to NumPy.
    _MAX = tl.standard._elementwise_max
    _SUM = tl.standard._sum_combine

BLOCK_TOKENS = 32
"""Tokens per stage-1 tile (the ``tl.dot`` N dimension; at least 16)."""
FP32_WIDE_BLOCK_TOKENS = 16
"""Tokens per stage-1 tile of an fp32 cache at ``BLOCK_D`` 256 on a GPU: 32 need 67,584 B of LDS on
gfx942 (MI300: 64 KB) and 84,160 B on sm_86; 16 need 33,792 B and 50,368 B (Triton 3.8)."""
MIN_BLOCK_HEADS = 16
"""Least query-head tile of stage 1 (``tl.dot`` needs M >= 16; the GQA group is masked into it)."""
MAX_BLOCK_HEADS = {16: 128, 32: 128, 64: 128, 128: 64, 256: 16}
"""Largest query-head tile of stage 1 per ``BLOCK_D`` (the head dim's power of two), sized for
the fp32 dots (the tensor-core ones need half). Stage 1 keeps its fp32 ``[BLOCK_H, D]`` query
and ``[BLOCK_N, D]`` key and value tiles in shared memory, about
``4 * D * (BLOCK_H + 2 * BLOCK_N) + 136 * BLOCK_H`` bytes; compiled offline with the pinned
Triton 3.8 (``tests/kernels/test_shared_memory.py``), sm_86: 73,856 B at D 128 with 64 heads
(128: 115,328 B, over the 101,376 B a block may use on consumer Ampere, Ada, L4, L40S, RTX 50;
98,816 B on sm_75, over a T4's 64 KB), 66,176 B at D 64 with 128, 50,368 B at D 256 with 16
(:data:`FP32_WIDE_BLOCK_TOKENS`). A GQA group larger than the tile (MQA models) takes several
head blocks, each reading the kv head's K/V."""
MAX_HEAD_DIM = 256
"""Largest head_dim the Triton kernels take: at 512 no tile of either kernel fits a GPU's shared
memory (FlashInfer's decode stops at 256 too)."""
MAX_KV_SPLITS = 16
"""Upper bound of the split count (the merge kernel's tile)."""
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_heads_and_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_layout: str) -> None:
    """The query ``[rows, q_heads, head_dim]`` (``q_layout`` names its first dimension in the
    message) against the paged caches: shapes, head_dim, the GQA ratio, dtypes. ValueError."""
    if q.dim() != 3:
        raise ValueError(f"q must be [{q_layout}, q_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [pages, page_size, kv_heads, head_dim]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim differs: q {head_dim} vs cache {k_cache.shape[3]}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} must be a multiple of kv_heads={kv_heads}")
    # q may be wider than the cache (SGLang keeps q in the model dtype over a narrower KV cache):
    # both are read as fp32 and the output has q's dtype
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype not in SUPPORTED_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"q and the caches must have dtypes of {SUPPORTED_DTYPES}, k_cache and v_cache the same; "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )


def check_head_dim(head_dim: int) -> None:
    """A Triton launch's ``head_dim`` is at most :data:`MAX_HEAD_DIM`. ValueError."""
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is over {MAX_HEAD_DIM}, the largest the layered Triton kernels "
                         "take (their tiles would not fit a GPU's shared memory)")


def block_dim(head_dim: int) -> int:
    """The kernels' ``BLOCK_D``: ``head_dim``'s power of two, at least 16 (``tl.dot``'s least K)."""
    return max(16, 1 << (head_dim - 1).bit_length())


def sm_count(device: torch.device) -> int:
    """The SMs of CUDA ``device`` (the decode's split count fills them)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_block_heads(group: int, block_d: int) -> int:
    """Stage 1's query-head tile for a GQA group of ``group`` q heads per kv head: the group's power
    of two, at least :data:`MIN_BLOCK_HEADS`, at most :data:`MAX_BLOCK_HEADS` of ``block_d``."""
    return min(max(MIN_BLOCK_HEADS, 1 << (group - 1).bit_length()), MAX_BLOCK_HEADS.get(block_d, MIN_BLOCK_HEADS))


def decode_launch_options(cache_dtype: torch.dtype, group: int, head_dim: int, *, cuda: bool) -> dict[str, Any]:
    """Stage 1's tiles (``BLOCK_H``, ``BLOCK_N``, ``BLOCK_D``), head blocks, dot precision and, on
    CUDA, ``num_warps``, for a cache of ``cache_dtype`` with ``group`` q heads per kv head, on CUDA
    or under the interpreter.

    ``LOW_PRECISION`` (CUDA, a 16-bit cache): both dots on the tensor cores in the cache dtype --
    the query (whatever its dtype) and the probabilities rounded to it, fp32 accumulation -- as
    SGLang's Triton decode (which casts q to K's dtype) and FlashAttention do. Compiled offline
    (Triton 3.8, 4 warps) the fp32 FMA dots need 255 registers and spill at Llama's shapes (head_dim
    128, 16-head tile) and fall to 32-40 registers with 3-7 KB of stack a thread at head_dim 256 or
    64-head tiles (a query of another dtype, fp32 or fp16 over bf16, spilled too); the
    tensor-core dots need 72 and 142 registers there, no spill, half the shared memory. Otherwise
    (the interpreter, fp32 caches) fp32 dots, with 8 warps from ``BLOCK_D`` 128 on CUDA (no spill
    at 16-head tiles; 168 B of stack at 64) and, at ``BLOCK_D`` 256 on CUDA, 16-token tiles
    (:data:`FP32_WIDE_BLOCK_TOKENS`: 64 KB GPUs)."""
    block_d = block_dim(head_dim)
    block_h = decode_block_heads(group, block_d)
    low = cuda and cache_dtype in (torch.float16, torch.bfloat16)
    block_n = FP32_WIDE_BLOCK_TOKENS if cuda and not low and block_d >= 256 else BLOCK_TOKENS
    options: dict[str, Any] = {"BLOCK_H": block_h, "BLOCK_N": block_n, "BLOCK_D": block_d,
                               "HEAD_BLOCKS": head_blocks(group, head_dim), "LOW_PRECISION": low}
    if cuda:
        options["num_warps"] = 8 if block_d >= 128 and not low else 4
    return options


def check_cap_window(logits_soft_cap: float, window_left: int) -> None:
    """``window_left >= -1`` (an int) and a finite ``logits_soft_cap >= 0``. ValueError."""
    if not (isinstance(window_left, int) and window_left >= -1):
        raise ValueError(f"window_left must be an int >= -1 (-1: no window), got {window_left!r}")
    if not (logits_soft_cap >= 0.0 and math.isfinite(logits_soft_cap)):
        raise ValueError(f"logits_soft_cap must be finite and >= 0 (0: off), got {logits_soft_cap!r}")


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    logits_soft_cap: float,
    window_left: int,
) -> None:
    check_heads_and_caches(q, k_cache, v_cache, "batch")
    batch = q.shape[0]
    if kv_indptr.dim() != 1 or kv_lens.dim() != 1 or kv_indices.dim() != 1:
        raise ValueError("kv_indptr, kv_indices and kv_lens must be 1-D")
    if kv_indptr.numel() != batch + 1 or kv_lens.numel() != batch:
        raise ValueError(
            f"batch={batch} needs kv_indptr [B+1] and kv_lens [B]; got {tuple(kv_indptr.shape)} "
            f"and {tuple(kv_lens.shape)}"
        )
    check_cap_window(logits_soft_cap, window_left)


def _scale(sm_scale: float | None, head_dim: int) -> float:
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    if not (scale > 0.0 and math.isfinite(scale)):
        raise ValueError(f"sm_scale must be finite and > 0, got {sm_scale!r}")
    return scale


def kv_lens_from_last_page_len(
    kv_indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int
) -> torch.Tensor:
    """``kv_lens [B]`` from FlashInfer's ``last_page_len``: ``(pages - 1) * page_size + last``."""
    pages = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
    return ((pages - 1).clamp_min(0) * page_size + last_page_len.to(torch.int32)).where(
        pages > 0, torch.zeros_like(pages)
    )


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float = 0.0,
    window_left: int = -1,
) -> torch.Tensor:
    """Torch reference of :func:`paged_decode`: dense gather per request, softmax in fp32."""
    _check(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, logits_soft_cap, window_left)
    batch, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    scale = _scale(sm_scale, head_dim)
    indptr, lens = kv_indptr.tolist(), kv_lens.tolist()
    out = torch.zeros((batch, q_heads, head_dim), dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(lens[b])
        pages = kv_indices[int(indptr[b]) : int(indptr[b + 1])].to(device=k_cache.device, dtype=torch.long)
        if n < 0 or pages.numel() * page_size < n:
            raise ValueError(f"request {b}: {pages.numel()} pages of {page_size} cannot hold {n} tokens")
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
            raise ValueError(f"request {b}: page ids must lie in [0, {num_pages}), got {pages.tolist()}")
        start = 0 if window_left < 0 else max(0, n - 1 - window_left)
        if n - start <= 0:
            continue
        t = torch.arange(start, n, device=k_cache.device)
        page, slot = pages[t // page_size], t % page_size
        k = k_cache[page, slot].float().repeat_interleave(group, dim=1)  # [T, Hq, D]
        v = v_cache[page, slot].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,thd->ht", q[b].float(), k.to(q.device)) * scale
        if logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(logits, dim=-1), v.to(q.device))
    return out.to(q.dtype)


if HAVE_TRITON:

    def _decode_split_fn(
        q_ptr,
        k_ptr,
        v_ptr,
        indptr_ptr,
        indices_ptr,
        lens_ptr,
        mid_o_ptr,
        mid_lse_ptr,
        sm_scale,
        soft_cap,
        stride_qb,
        stride_qh,
        stride_kp,
        stride_ks,
        stride_kh,
        stride_vp,
        stride_vs,
        stride_vh,
        window_left,
        GROUP: tl.constexpr,
        PAGE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HEAD_BLOCKS: tl.constexpr,
        USE_CAP: tl.constexpr,
        LOW_PRECISION: tl.constexpr,
    ):
        b = tl.program_id(0)
        kv_head = tl.program_id(1) // HEAD_BLOCKS
        head_block = tl.program_id(1) % HEAD_BLOCKS
        split = tl.program_id(2)
        splits = tl.num_programs(2)  # a launch's grid, not a constexpr: one kernel for every split count
        n = tl.load(lens_ptr + b)
        page_base = tl.load(indptr_ptr + b).to(tl.int64)
        start = n * 0
        if window_left >= 0:
            start = tl.maximum(n - 1 - window_left, 0)
        per_split = ((n - start + splits - 1) // splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = start + split * per_split
        hi = tl.minimum(lo + per_split, n)

        offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # the block's q heads within the group
        offs_d = tl.arange(0, BLOCK_D)
        h_mask = offs_h < GROUP
        d_mask = offs_d < HEAD_DIM
        q_head = kv_head * GROUP + offs_h
        q = tl.load(
            q_ptr + b * stride_qb + q_head[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if LOW_PRECISION:
            q = q.to(k_ptr.dtype.element_ty)
        else:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_H], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_H, BLOCK_D], 0.0, dtype=tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_mask = t < hi
            page = tl.load(indices_ptr + page_base + t // PAGE, mask=t_mask, other=0).to(tl.int64)
            slot = (t % PAGE).to(tl.int64)
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(
                k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh
                + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if LOW_PRECISION:
                qk = tl.dot(q, tl.trans(k)) * sm_scale
            else:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * sm_scale
            if USE_CAP:
                # cap * tanh(x / cap); tanh through exp(-2|x|) (no overflow; no libdevice under
                # the interpreter)
                e = tl.exp(-2.0 * tl.abs(qk) / soft_cap)
                th = (1.0 - e) / (1.0 + e)
                qk = soft_cap * tl.where(qk < 0, -th, th)
            qk = tl.where(t_mask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(qk, 1, _MAX))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
            v = tl.load(
                v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh
                + offs_d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            if LOW_PRECISION:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            m_i = m_new

        # partials: o = acc / l and lse = m + log(l); an empty split has lse = -inf
        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        row = (b * (GROUP * (tl.num_programs(1) // HEAD_BLOCKS)) + q_head).to(tl.int64) * splits + split
        tl.store(mid_lse_ptr + row, lse, mask=h_mask)
        tl.store(
            mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=h_mask[:, None] & d_mask[None, :]
        )

    def _merge_splits_fn(
        mid_o_ptr,
        mid_lse_ptr,
        out_ptr,
        stride_ob,
        stride_oh,
        splits,
        Q_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < splits
        d_mask = offs_d < HEAD_DIM
        row = (b * Q_HEADS + h).to(tl.int64) * splits + offs_s
        lse = tl.load(mid_lse_ptr + row, mask=s_mask, other=float("-inf"))
        m = tl.reduce(lse, 0, _MAX)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m)
        o = tl.load(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0)
        den = tl.reduce(w, 0, _SUM)
        out = tl.reduce(w[:, None] * o, 0, _SUM) / tl.where(den > 0.0, den, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)

    # the tables are views into a step's metadata upload (kv_indices a layer's row), their
    # alignment varies from step to step: specialising on it would compile kernels mid-serving
    _decode_split_kernel = LazyKernel(
        _decode_split_fn, do_not_specialize_on_alignment=["indptr_ptr", "indices_ptr", "lens_ptr"])
    _merge_splits_kernel = LazyKernel(_merge_splits_fn, do_not_specialize=["splits"])


def default_kv_splits(q: torch.Tensor, kv_heads: int, num_pages_in_batch: int, page_size: int) -> int:
    """Splits per (request, kv head) for a step on ``q``'s device (:func:`kv_splits`); 1 off CUDA
    (the interpreter pays per program)."""
    if not q.is_cuda:
        return 1
    _, q_heads, head_dim = q.shape
    return kv_splits(q.shape[0], kv_heads, sm_count(q.device), num_pages_in_batch, page_size,
                     head_blocks(q_heads // kv_heads, head_dim))


def head_blocks(group: int, head_dim: int) -> int:
    """Stage 1's head blocks per kv head for a GQA group of ``group`` at ``head_dim`` (MQA-like: > 1)."""
    return -(-group // decode_block_heads(group, block_dim(head_dim)))


def kv_splits(batch: int, kv_heads: int, sms: int, num_pages_in_batch: int, page_size: int,
              blocks: int = 1) -> int:
    """Enough programs to fill a GPU of ``sms`` SMs (about 2 per SM) -- stage 1 runs ``batch x
    kv_heads x blocks`` (:func:`head_blocks`) programs a split -- never more than the batch's
    token tiles allow, at most :data:`MAX_KV_SPLITS`. Eager decode sizes it from every step's
    pages; the kernels take it at launch (stage 1's grid, stage 2's unspecialized argument), so
    no value compiles a kernel of its own while serving."""
    batch = max(batch, 1)
    want = -(-2 * sms // (batch * kv_heads * max(blocks, 1)))
    # upper bound from the average tokens per request (num_pages_in_batch is known on the host)
    tiles = max(1, (num_pages_in_batch * page_size) // (batch * BLOCK_TOKENS))
    return max(1, min(want, tiles, MAX_KV_SPLITS))


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float = 0.0,
    window_left: int = -1,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Triton split-KV decode (two launches, no host sync). Page ids are not range-checked."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable; use paged_decode_ref")
    _check(q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, logits_soft_cap, window_left)
    batch, q_heads, head_dim = q.shape
    check_head_dim(head_dim)
    _, page_size, kv_heads, _ = k_cache.shape
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head_dim (stride 1)")
    if num_kv_splits is None:
        num_kv_splits = default_kv_splits(q, kv_heads, kv_indices.numel(), page_size)
    if not 1 <= num_kv_splits <= MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits must be in [1, {MAX_KV_SPLITS}], got {num_kv_splits}")
    scale = _scale(sm_scale, head_dim)
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense: the kernel stores head_dim at stride 1
    if batch == 0:
        return out
    kv_indices = kv_indices.contiguous()
    group = q_heads // kv_heads
    mid_o = torch.empty((batch, q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, q_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    options = decode_launch_options(k_cache.dtype, group, head_dim, cuda=q.is_cuda)
    block_d = options["BLOCK_D"]
    _decode_split_kernel[(batch, kv_heads * options["HEAD_BLOCKS"], num_kv_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens, mid_o, mid_lse,
        scale, float(logits_soft_cap),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        window_left,
        GROUP=group, PAGE=page_size, HEAD_DIM=head_dim,
        USE_CAP=logits_soft_cap > 0, **options,
    )
    _merge_splits_kernel[(batch, q_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), num_kv_splits,
        Q_HEADS=q_heads, HEAD_DIM=head_dim, BLOCK_S=MAX_KV_SPLITS, BLOCK_D=block_d,
    )
    return out


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    logits_soft_cap: float = 0.0,
    window_left: int = -1,
    num_kv_splits: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Decode attention ``[B, q_heads, head_dim]`` of one layer through its page table.

    ``q [B, Hq, D]``; ``k_cache, v_cache [pages, page_size, Hkv, D]``; ``kv_indptr [B+1]``,
    ``kv_indices`` (this layer's pages), ``kv_lens [B]`` (int32 or int64, on the cache's device).
    impl ``auto`` (Triton on CUDA or under TRITON_INTERPRET=1, else the reference) | ``triton``
    | ``torch``; ``num_kv_splits`` is Triton's split-KV count (None: :func:`default_kv_splits`).
    """
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be one of auto, triton, torch; got {impl!r}")
    args = (q, k_cache, v_cache, kv_indptr, kv_indices, kv_lens)
    if impl == "torch" or (impl == "auto" and not triton_usable(q, k_cache)):
        return paged_decode_ref(
            *args, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left
        )
    return paged_decode_triton(
        *args, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left,
        num_kv_splits=num_kv_splits,
    )
