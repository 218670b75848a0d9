"""Layered paged extend (prefill) attention: a batch of new tokens per request attends causally to
the request's whole sequence, every K/V read through one layer's page table.

The extend-side twin of :mod:`kernels.paged_decode`, over the same per-step CSR
(``StepTables``): ``kv_indptr [B+1]``, ``kv_lens [B]`` (the sequence length *after* this
forward's tokens) and ``kv_indices = tables.tab[layer]``. The forward writes its new K/V into the
pages first (``set_kv_buffer``), so a cached prefix (radix hit, earlier chunk of a chunked
prefill) and the new tokens are read alike, from wherever the layer's table points: the device
copy, the request's staging slot, or the identity page.

Queries ``q [T, Hq, D]`` are SGLang's extend layout: request ``b``'s ``q_lens[b]`` new tokens are
rows ``q_start[b] ..`` (``forward_batch.extend_start_loc`` / ``extend_seq_lens``, device
tensors: no host read). New token ``i`` of request ``b`` sits at position
``p = kv_lens[b] - q_lens[b] + i`` and attends keys ``j`` with ``j <= p`` (and
``j >= p - window_left`` when ``window_left >= 0``: SGLang's sliding window), with
``logits = q . k * sm_scale``, soft-capped ``cap * tanh(logits / cap)`` when ``logits_soft_cap > 0``.
GQA: q head ``h`` reads kv head ``h // (Hq / Hkv)``. Rows of ``q`` outside every request's range
are not written.

The Triton kernel is flash-attention shaped: one program per (request, q head, block of
``BLOCK_M`` new tokens), an online softmax over key tiles of ``BLOCK_N`` tokens up to the block's
last position (no tile past the diagonal is read). On CUDA with 16-bit K/V its two dots run on
the tensor cores in the cache dtype with fp32 accumulation (prefill is compute bound); under the
interpreter (CI) and for fp32 caches both run in fp32 (``input_precision="ieee"``: the
interpreter multiplies bf16 operands as raw bits, see :mod:`kernels.paged_decode`), so CI tests
the kernel's indexing, masking and softmax, and the gpu-marked tests its 16-bit dots. The grid
depends on shapes and ``max_q_len`` (SGLang's ``extend_seq_lens_cpu``): no host sync.
"""

from __future__ import annotations

import torch

from kernels.block_copy import HAVE_TRITON, triton_usable
from kernels.lazy_jit import LazyKernel
from kernels.paged_decode import (
    _scale,
    block_dim,
    check_cap_window,
    check_head_dim,
    check_heads_and_caches,
)

if HAVE_TRITON:
    import triton.language as tl

    _MAX = tl.standard._elementwise_max  # builtin reductions: see kernels/paged_decode.py
    _SUM = tl.standard._sum_combine

CUDA_BLOCKS = (64, 64)
"""``(BLOCK_M, BLOCK_N)`` on CUDA with 16-bit caches: new tokens per program, keys per tile.
Compiled by the pinned Triton 3.8, 8 warps: 57,600 B of shared memory at head_dim 128 on sm_86
(82,176 B on sm_90, whose ``wgmma`` stages more), 106,752 B at head_dim 256 (164,096 B on sm_90)."""
CUDA_WIDE_ROW_BLOCKS = (128, 64)
"""16-bit caches up to head_dim 128 on a GPU whose block may use :data:`WIDE_ROWS_SHARED` (H100,
H200, B200): 128 rows of a kv head's GQA-packed q heads (``PACK_GQA``), 64 keys a tile, 8 warps,
2 stages. Measured on an H200 (session 65, run 22, ``benchmarks/results/gpu/probes/extend-probe-run22-*``):
gpu-check's mixed batch 1.36 ms against 1.83 ms at 64 x 64 (8 warps, 3 stages) and SGLang's
torch-native loop's 1.55 ms; four 4K prompts 2.06 against 2.72 ms. Compiled offline: 98,304 B on
sm_90, 99,360 B on sm_100, no register spill; on sm_86 the same launch spills (40 B), so GPUs with
less shared memory keep :data:`CUDA_BLOCKS`."""
WIDE_ROWS_SHARED = 232_448
"""The per-block shared memory of H100 / H200 / B200 (227 KB): where :data:`CUDA_WIDE_ROW_BLOCKS` serve."""
WIDE_ROW_LAUNCH = {"PACK_GQA": True, "num_warps": 8, "num_stages": 2}
"""The rest of :data:`CUDA_WIDE_ROW_BLOCKS`' launch."""
CUDA_NARROW_BLOCKS = (64, 32)
"""16-bit caches at head_dim 256 on a GPU whose block may use less than :data:`WIDE_TILES_SHARED`
but at least :data:`NARROW_TILES_SHARED` (consumer Ampere, A10, A40, Ada, L4, L40S, RTX 50:
99 KB): 69,760 B on sm_86 and sm_120."""
WIDE_TILES_SHARED = 164_640
"""Per-block shared memory a GPU needs for :data:`CUDA_BLOCKS` at head_dim 256: the most any
compile of them needs (sm_100's; sm_90 164,096 B, sm_80..89 and sm_120 106,752 B). A100 (163 KB),
H100 / H200 and B200 (227 KB) allow it."""
NARROW_TILES_SHARED = 98_976
"""The same for :data:`CUDA_NARROW_BLOCKS`: the most any compile of them needs (sm_100's; sm_75
98,304 B, sm_86 69,760 B, AMD gfx950 71,616 B)."""
CUDA_SMALL_BLOCKS = (32, 32)
"""16-bit caches at head_dim 256 on a GPU whose block may use less than
:data:`NARROW_TILES_SHARED`: 64 KB GPUs (T4, 65,536 B on sm_75; AMD MI200 / MI300, whose LDS is
64 KB a block: 32,768 B on gfx942). The thresholds are the most any compile target needs, so AMD
GPUs, whose compiles need less (gfx942: 36,864 B for 64 x 32; gfx950: 143,296 B for 64 x 64),
take narrower tiles than they could. SGLang's own Triton extend takes the same two on GPUs before
sm_80 (64 x 64 up to head_dim 128, 32 x 32 above: ``sglang/kernels/ops/attention/extend_attention.py``)."""
CUDA_FP32_BLOCKS = (32, 32)
"""The same for fp32 caches up to head_dim 128 (fp32 tiles: 64 x 64 at head_dim 128 need 115 KB
of shared memory, more than the 99 KB a block may use on consumer Ampere, Ada, L4, L40S; 32 x 32
need 53,376 B on sm_86)."""
CUDA_FP32_WIDE_BLOCKS = (32, 16)
"""fp32 caches at head_dim 256: 32 x 32 tiles need 102,656 B there (sm_86 and sm_90, Triton 3.8),
over 99 KB; 32 x 16 need 67,776 B. Every CUDA configuration is compiled offline for sm_86 and
sm_90 and checked against those GPUs' limits in ``tests/kernels/test_shared_memory.py``."""
INTERPRETER_BLOCKS = (16, 32)
"""The same under the interpreter (its cost is per program and per tile op, not per FLOP)."""
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


def extend_launch_options(cache_dtype: torch.dtype, head_dim: int, *,
                          shared_per_block: int | None) -> dict[str, object]:
    """The extend kernel's tiles (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_D``), its dot precision
    (``LOW_PRECISION``: 16-bit tensor-core dots on CUDA), the row layout (``PACK_GQA``), the mask
    split (``SPLIT_MASK``) and, on CUDA, ``num_warps`` (and ``num_stages`` on 227 KB GPUs), for a cache
    of ``cache_dtype`` and ``head_dim`` on a CUDA GPU whose block may use ``shared_per_block``
    bytes of shared memory (:func:`shared_per_block_of`), or under the interpreter (None)."""
    cuda = shared_per_block is not None
    low = cuda and cache_dtype in LOW_PRECISION_DTYPES
    block_d = block_dim(head_dim)
    wide_rows = low and block_d <= 128 and (shared_per_block or 0) >= WIDE_ROWS_SHARED
    if not cuda:
        block_m, block_n = INTERPRETER_BLOCKS
    elif wide_rows:
        block_m, block_n = CUDA_WIDE_ROW_BLOCKS
    elif low:
        limit = shared_per_block or 0
        if block_d < 256 or limit >= WIDE_TILES_SHARED:
            block_m, block_n = CUDA_BLOCKS
        else:
            block_m, block_n = CUDA_NARROW_BLOCKS if limit >= NARROW_TILES_SHARED else CUDA_SMALL_BLOCKS
    else:
        block_m, block_n = CUDA_FP32_WIDE_BLOCKS if block_d >= 256 else CUDA_FP32_BLOCKS
    options: dict[str, object] = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d, "LOW_PRECISION": low,
                                  "PACK_GQA": False, "SPLIT_MASK": True}
    if cuda:
        # 8 warps from head_dim 128: with 4, ptxas spills (255 registers, 1.8 KB of stores at 128 on sm_90)
        options["num_warps"] = 8 if block_d >= 128 else 4
    if wide_rows:
        options.update(WIDE_ROW_LAUNCH)
    return options


MAX_GRID_Z = 65_535
"""CUDA's limit on a grid's third dimension (the extend's row blocks)."""


def extend_grid(options: dict[str, object], batch: int, q_heads: int, kv_heads: int,
                max_q_len: int) -> tuple[dict[str, object], tuple[int, int, int]]:
    """The launch's options and grid: ``(batch, kv_heads, row blocks of the packed rows)`` with
    ``PACK_GQA`` (a program per kv head, its group's q heads in the rows), else ``(batch, q_heads,
    row blocks)``. Packing multiplies the row blocks by the group: where that passes
    :data:`MAX_GRID_Z` (an MQA model's prefill of over ~118K tokens unchunked, at group 71) the
    launch is unpacked."""
    block_m = int(options["BLOCK_M"])  # type: ignore[call-overload]
    if options["PACK_GQA"]:
        blocks = -(-max_q_len * (q_heads // kv_heads) // block_m)
        if blocks <= MAX_GRID_Z:
            return options, (batch, kv_heads, blocks)
        options = {**options, "PACK_GQA": False}
    return options, (batch, q_heads, -(-max_q_len // block_m))


def shared_per_block_of(device: torch.device) -> int:
    """Bytes of shared memory a block may use on CUDA ``device`` (the opt-in limit Triton
    launches against)."""
    props = torch.cuda.get_device_properties(device)  # ROCm builds of torch have no opt-in attribute
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
           q_lens: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
           logits_soft_cap: float, window_left: int) -> None:
    check_heads_and_caches(q, k_cache, v_cache, "tokens")
    vectors = {"q_start": q_start, "q_lens": q_lens, "kv_indptr": kv_indptr, "kv_indices": kv_indices,
               "kv_lens": kv_lens}
    flat = [name for name, t in vectors.items() if t.dim() != 1]
    if flat:
        raise ValueError(f"{', '.join(flat)} must be 1-D")
    batch = q_lens.numel()
    if q_start.numel() != batch or kv_lens.numel() != batch or kv_indptr.numel() != batch + 1:
        raise ValueError(f"batch={batch} (q_lens) needs q_start [B], kv_lens [B] and kv_indptr [B+1]; got "
                         f"{tuple(q_start.shape)}, {tuple(kv_lens.shape)} and {tuple(kv_indptr.shape)}")
    check_cap_window(logits_soft_cap, window_left)


def paged_extend_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                     q_lens: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     kv_lens: torch.Tensor, *, sm_scale: float | None = None, logits_soft_cap: float = 0.0,
                     window_left: int = -1) -> torch.Tensor:
    """Torch reference of :func:`paged_extend`: a dense gather and masked softmax per request, in
    fp32 (host reads of the CSR: a reference, not a served path). Uncovered rows are zero."""
    _check(q, k_cache, v_cache, q_start, q_lens, kv_indptr, kv_indices, kv_lens, logits_soft_cap, window_left)
    _, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_cache.shape
    group, scale = q_heads // kv_heads, _scale(sm_scale, head_dim)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts, elens, indptr, lens = q_start.tolist(), q_lens.tolist(), kv_indptr.tolist(), kv_lens.tolist()
    for b, (s, e, n) in enumerate(zip(starts, elens, lens, strict=True)):
        pages = kv_indices[indptr[b]: indptr[b + 1]].to(device=k_cache.device, dtype=torch.long)
        if not 0 <= e <= n or pages.numel() * page_size < n:
            raise ValueError(f"request {b}: {e} new of {n} tokens in {pages.numel()} pages of {page_size}")
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
            raise ValueError(f"request {b}: page ids must lie in [0, {num_pages}), got {pages.tolist()}")
        if e == 0:
            continue
        t = torch.arange(n, device=k_cache.device)
        k = k_cache[pages[t // page_size], t % page_size].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache[pages[t // page_size], t % page_size].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,thd->hqt", q[s: s + e].float(), k.to(q.device)) * scale
        if logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        pos = (n - e + torch.arange(e, device=q.device))[:, None]
        keys = torch.arange(n, device=q.device)[None, :]
        keep = keys <= pos
        if window_left >= 0:
            keep &= keys >= pos - window_left
        logits = logits.masked_fill(~keep[None], float("-inf"))
        out[s: s + e] = torch.einsum("hqt,thd->qhd", torch.softmax(logits, dim=-1), v.to(q.device))
    return out.to(q.dtype)


if HAVE_TRITON:

    def _extend_fn(
        q_ptr, k_ptr, v_ptr, o_ptr, qstart_ptr, qlen_ptr, indptr_ptr, indices_ptr, lens_ptr,
        sm_scale, soft_cap,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        window_left,
        GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_CAP: tl.constexpr, LOW_PRECISION: tl.constexpr,
        PACK_GQA: tl.constexpr, SPLIT_MASK: tl.constexpr,
    ):
        b = tl.program_id(0)
        hh = tl.program_id(1)  # the q head; with PACK_GQA the kv head, its GROUP q heads in the rows
        # the last row blocks first: they see the most keys (no tail of heavy programs at the end)
        blk = tl.num_programs(2) - 1 - tl.program_id(2)
        q_len = tl.load(qlen_ptr + b)
        kv_len = tl.load(lens_ptr + b)
        q0 = tl.load(qstart_ptr + b).to(tl.int64)
        page_base = tl.load(indptr_ptr + b).to(tl.int64)
        prefix = kv_len - q_len
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        if PACK_GQA:  # row r: new token r // GROUP, q head hh * GROUP + r % GROUP (one K/V load for the group)
            tok = rows // GROUP
            head = hh * GROUP + rows % GROUP
            kv_head = hh
            first_tok = blk * BLOCK_M // GROUP
            last_tok = (blk * BLOCK_M + BLOCK_M - 1) // GROUP
        else:
            tok = rows
            head = hh + rows * 0
            kv_head = hh // GROUP
            first_tok = blk * BLOCK_M
            last_tok = first_tok + BLOCK_M - 1
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = tok < q_len
        d_mask = offs_d < HEAD_DIM
        pos = prefix + tok
        q = tl.load(q_ptr + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if LOW_PRECISION:
            q = q.to(k_ptr.dtype.element_ty)
        else:
            q = q.to(tl.float32)
        # logits in log2 units (exp2, as FlashAttention): the scale folds log2(e) in, or the cap does
        LOG2E: tl.constexpr = 1.4426950408889634
        qk_scale = sm_scale if USE_CAP else sm_scale * LOG2E
        # keys up to this block's last position (none for a block past the request's new tokens)
        hi = tl.where(first_tok < q_len, tl.minimum(prefix + last_tok + 1, kv_len), 0)
        lo = hi * 0
        if window_left >= 0:
            lo = tl.maximum(prefix + first_tok - window_left, 0)
        # keys every row of the block sees, with no window: tiles wholly below them need no mask
        full = tl.where(window_left < 0, tl.minimum(prefix + first_tok + 1, hi), lo)
        if not SPLIT_MASK:
            full = lo
        mid = lo + tl.maximum(full - lo, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_mask = t < hi
            page = tl.load(indices_ptr + page_base + t // PAGE, mask=t_mask, other=0).to(tl.int64)
            slot = (t % PAGE).to(tl.int64)
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head * stride_kh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            if LOW_PRECISION:
                qk = tl.dot(q, tl.trans(k)) * qk_scale
            else:
                qk = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
            if USE_CAP:  # cap * tanh(x / cap), through exp(-2|x|) (kernels/paged_decode.py)
                e = tl.exp(-2.0 * tl.abs(qk) / soft_cap)
                th = (1.0 - e) / (1.0 + e)
                qk = soft_cap * tl.where(qk < 0, -th, th) * LOG2E
            if t0 >= mid:  # a tile at the diagonal, the window's edge or the sequence's end
                keep = t_mask[None, :] & (t[None, :] <= pos[:, None])
                keep = keep & ((t[None, :] >= pos[:, None] - window_left) | (window_left < 0))
                qk = tl.where(keep, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(qk, 1, _MAX))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
            v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head * stride_vh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            if LOW_PRECISION:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            m_i = m_new
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(o_ptr + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])

    # the tables are views into a step's metadata upload, their alignment varies from step to
    # step: specialising on it would compile kernels mid-serving
    _extend_kernel = LazyKernel(_extend_fn, do_not_specialize_on_alignment=[
        "qstart_ptr", "qlen_ptr", "indptr_ptr", "indices_ptr", "lens_ptr"])


def paged_extend_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                        q_lens: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                        kv_lens: torch.Tensor, max_q_len: int, *, sm_scale: float | None = None,
                        logits_soft_cap: float = 0.0, window_left: int = -1,
                        shared_per_block: int | None = None,
                        launch: dict[str, object] | None = None) -> torch.Tensor:
    """Triton paged extend (one launch, no host sync). ``max_q_len`` (a host int, at least every
    ``q_lens[b]``) sizes the grid. Page ids are not range-checked. ``shared_per_block``: the CUDA
    device's :func:`shared_per_block_of`, which a caller launching every layer reads once (None: read
    here). ``launch``: options replacing :func:`extend_launch_options`' (tiles, ``PACK_GQA``,
    ``SPLIT_MASK``, ``num_warps``, ``num_stages``: the tests' and the tuning probe's)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not importable; use paged_extend_ref")
    _check(q, k_cache, v_cache, q_start, q_lens, kv_indptr, kv_indices, kv_lens, logits_soft_cap, window_left)
    if not (isinstance(max_q_len, int) and max_q_len >= 0):
        raise ValueError(f"max_q_len must be an int >= 0, got {max_q_len!r}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head_dim (stride 1)")
    _, q_heads, head_dim = q.shape
    check_head_dim(head_dim)
    _, page_size, kv_heads, _ = k_cache.shape
    batch = q_lens.numel()
    q = q if q.stride(2) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # dense: the kernel stores head_dim at stride 1
    if batch == 0 or max_q_len == 0 or q.shape[0] == 0:
        return out
    limit = None
    if q.is_cuda:
        limit = shared_per_block_of(q.device) if shared_per_block is None else shared_per_block
    options = {**extend_launch_options(k_cache.dtype, head_dim, shared_per_block=limit), **(launch or {})}
    group = q_heads // kv_heads
    options, grid = extend_grid(options, batch, q_heads, kv_heads, max_q_len)
    _extend_kernel[grid](
        q, k_cache, v_cache, out, q_start, q_lens, kv_indptr, kv_indices.contiguous(), kv_lens,
        _scale(sm_scale, head_dim), float(logits_soft_cap),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        window_left,
        GROUP=group, PAGE=page_size, HEAD_DIM=head_dim, USE_CAP=logits_soft_cap > 0, **options,
    )
    return out


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
                 q_lens: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor,
                 max_q_len: int, *, sm_scale: float | None = None, logits_soft_cap: float = 0.0,
                 window_left: int = -1, impl: str = "auto", shared_per_block: int | None = None) -> torch.Tensor:
    """Extend attention ``[T, Hq, D]`` of one layer through its page table (module docstring).

    impl ``auto`` (Triton on CUDA or under TRITON_INTERPRET=1, else the reference) | ``triton``
    | ``torch``; ``shared_per_block``: see :func:`paged_extend_triton`."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be one of auto, triton, torch; got {impl!r}")
    args = (q, k_cache, v_cache, q_start, q_lens, kv_indptr, kv_indices, kv_lens)
    if impl == "torch" or (impl == "auto" and not triton_usable(q, k_cache)):
        return paged_extend_ref(*args, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, window_left=window_left)
    return paged_extend_triton(*args, max_q_len, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                               window_left=window_left, shared_per_block=shared_per_block)
