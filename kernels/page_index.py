"""Index remapping for attention: per-layer page tables -> token-level KV locations.

SGLang's token-indexed attention paths (``torch_native``, ``triton``) address the KV cache by
token slot (``k_buffer[loc]``), FlashInfer by page. With a layer-aware page table (OrbitFlow §4,
Fig. 6) every layer of a request has its own pages, so the token slots differ per layer; this
kernel expands one layer's pages into slots: ``loc[t] = pages[t // bs] * bs + t % bs``.

Inputs follow FlashInfer's CSR convention: ``kv_indptr [B+1]`` into ``kv_indices`` (pages),
``kv_lens [B]`` tokens per request; output is ``[sum(kv_lens)]`` int64 in request order.
"""

from __future__ import annotations

import torch

from kernels.block_copy import HAVE_TRITON, triton_usable
from kernels.lazy_jit import LazyKernel

if HAVE_TRITON:
    import triton
    import triton.language as tl

TOKENS_PER_PROGRAM = 256
"""Tokens each Triton program expands."""


def _check(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor, block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if kv_indptr.dim() != 1 or kv_lens.dim() != 1 or kv_indptr.numel() != kv_lens.numel() + 1:
        raise ValueError(
            f"kv_indptr must be [B+1] and kv_lens [B]; got {tuple(kv_indptr.shape)} and "
            f"{tuple(kv_lens.shape)}"
        )
    if kv_indices.dim() != 1:
        raise ValueError(f"kv_indices must be 1-D, got {kv_indices.dim()}-D")


def pages_to_token_locs_ref(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Torch reference of :func:`pages_to_token_locs`."""
    _check(kv_indptr, kv_indices, kv_lens, block_size)
    out = []
    for b in range(kv_lens.numel()):
        n = int(kv_lens[b])
        t = torch.arange(n, device=kv_indices.device)
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        if pages.numel() * block_size < n:
            raise ValueError(f"request {b}: {pages.numel()} pages cannot hold {n} tokens")
        out.append(pages[t // block_size] * block_size + t % block_size)
    if not out:
        return torch.empty(0, dtype=torch.long, device=kv_indices.device)
    return torch.cat(out)


if HAVE_TRITON:

    def _pages_to_locs_kernel(
        indptr_ptr,
        indices_ptr,
        lens_ptr,
        out_start_ptr,
        out_ptr,
        BS: tl.constexpr,
        TOK: tl.constexpr,
    ):
        b = tl.program_id(0)
        chunk = tl.program_id(1)
        n = tl.load(lens_ptr + b)
        page_base = tl.load(indptr_ptr + b)
        out_base = tl.load(out_start_ptr + b)
        t = chunk * TOK + tl.arange(0, TOK)
        mask = t < n
        page = tl.load(indices_ptr + page_base + t // BS, mask=mask, other=0).to(tl.int64)
        tl.store(out_ptr + out_base + t, page * BS + t % BS, mask=mask)


    _pages_to_locs_kernel = LazyKernel(_pages_to_locs_kernel)

def pages_to_token_locs_triton(
    kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Triton expansion (one launch); ``max_len`` is read on the host to size the grid."""
    _check(kv_indptr, kv_indices, kv_lens, block_size)
    batch = kv_lens.numel()
    out_start = torch.zeros(batch, dtype=torch.long, device=kv_lens.device)
    if batch > 1:
        out_start[1:] = torch.cumsum(kv_lens.long(), 0)[:-1]
    total = int(kv_lens.sum()) if batch else 0
    out = torch.empty(total, dtype=torch.long, device=kv_indices.device)
    if total == 0:
        return out
    max_len = int(kv_lens.max())
    grid = (batch, triton.cdiv(max_len, TOKENS_PER_PROGRAM))
    _pages_to_locs_kernel[grid](
        kv_indptr, kv_indices, kv_lens, out_start, out, BS=block_size, TOK=TOKENS_PER_PROGRAM
    )
    return out


def pages_to_token_locs(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    block_size: int,
    impl: str = "auto",
) -> torch.Tensor:
    """Token slots ``[sum(kv_lens)]`` of one layer; impl ``auto`` | ``triton`` | ``torch``."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be one of auto, triton, torch; got {impl!r}")
    if impl == "torch" or (impl == "auto" and not triton_usable(kv_indices)):
        return pages_to_token_locs_ref(kv_indptr, kv_indices, kv_lens, block_size)
    return pages_to_token_locs_triton(kv_indptr, kv_indices, kv_lens, block_size)
