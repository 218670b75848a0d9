"""Attention over layered page tables: a torch reference (CPU/GPU) and the dense reference.

``torch_layered_attention`` reads one layer's pages from the shared device pool, exactly what a
paged kernel (FlashInfer, SGLang's torch_native backend) sees: resident layers point at their own
blocks, offloaded layers at the request's staging slot. Queries of request b are its last
``q_len_b`` positions (decode: q_len 1; prefill/extend: q_len > 1, causal).
GQA: query head h reads KV head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import torch


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None
) -> torch.Tensor:
    """Causal attention of one request: q ``[nq, Hq, D]`` over k, v ``[n, Hkv, D]``; the queries
    are positions ``n - nq .. n - 1``. Computed in float32, returned in q's dtype."""
    nq, hq, dim = q.shape
    n, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hkv}")
    if nq > n:
        raise ValueError(f"{nq} queries but only {n} keys")
    scale = dim**-0.5 if sm_scale is None else sm_scale
    group = hq // hkv
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    qpos = torch.arange(n - nq, n, device=q.device)[:, None]
    kpos = torch.arange(n, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def gather_pages(
    cache: torch.Tensor, pages: torch.Tensor, n_tokens: int
) -> torch.Tensor:
    """Tokens ``[n_tokens, H, D]`` of a paged ``cache[N, bs, H, D]`` through ``pages``."""
    _, bs, h, d = cache.shape
    if pages.numel() * bs < n_tokens:
        raise ValueError(f"{pages.numel()} pages of {bs} tokens cannot hold {n_tokens} tokens")
    return cache.index_select(0, pages.long()).reshape(-1, h, d)[:n_tokens]


def torch_layered_attention(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Paged causal attention of one layer for a batch.

    q ``[total_q, Hq, D]`` with CSR ``qo_indptr [B+1]``; ``k_cache``/``v_cache``
    ``[N, bs, Hkv, D]``; this layer's pages ``kv_indices`` with CSR ``kv_indptr [B+1]``;
    ``kv_lens [B]`` tokens per request (including the new ones). Returns ``[total_q, Hq, D]``.
    """
    batch = kv_lens.numel()
    if qo_indptr.numel() != batch + 1 or kv_indptr.numel() != batch + 1:
        raise ValueError(
            f"qo_indptr and kv_indptr must have B+1 = {batch + 1} entries, got "
            f"{qo_indptr.numel()} and {kv_indptr.numel()}"
        )
    out = torch.empty_like(q)
    qo = qo_indptr.tolist()
    kvp = kv_indptr.tolist()
    lens = kv_lens.tolist()
    for b in range(batch):
        pages = kv_indices[kvp[b] : kvp[b + 1]]
        k = gather_pages(k_cache, pages, lens[b])
        v = gather_pages(v_cache, pages, lens[b])
        out[qo[b] : qo[b + 1]] = dense_attention(q[qo[b] : qo[b + 1]], k, v, sm_scale)
    return out
