"""Soft-capped attention for the torch-native extend and decode loops (SGLang-free).

SGLang's ``TorchNativeAttnBackend`` runs ``scaled_dot_product_attention`` per request and has no
logit soft cap, so a soft-capped model (Gemma-2, Grok: ``RadixAttention.logit_cap``) would be
served uncapped wherever it runs: every prefill of every layered backend (they all take SGLang's
torch-native extend) and the torch-native decode. The layered backend calls these loops instead,
for the layers whose ``logit_cap`` is positive: the same per-request walk over ``req_to_token``
as SGLang's (a request's query rows are its last ``extend_seq_len`` positions; keys are its first
``seq_len`` slots), with scores ``cap * tanh(s / cap)`` (s = scale * q . k, SGLang's
``tanh`` capping method) before the causal / sliding-window mask and the softmax. The window is
SGLang's: key ``j`` is seen from position ``i`` when ``i - window <= j <= i``.
"""

from __future__ import annotations

import math

import torch

TILE_SCORES = 1 << 25
"""Scores (float32) held at once: query rows are tiled so that a long prefill's ``[H, Lq, Lk]``
matrix never exists whole (128 MiB a tile; an 8K-token prompt at 32 heads would need 8.6 GB)."""


def capped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cap: float, scale: float | None,
                mask: torch.Tensor | None) -> torch.Tensor:
    """Attention ``[H, Lq, D]`` of ``q`` ``[H, Lq, D]`` over ``k`` / ``v`` ``[Hk, Lk, D]`` (``H`` a
    multiple of ``Hk``: grouped heads), scores soft-capped at ``cap``; ``mask`` ``[Lq, Lk]`` (True:
    attend) or None. Computed in float32, returned in ``q``'s dtype."""
    if cap <= 0:
        raise ValueError(f"capped_sdpa: cap={cap} must be > 0")
    heads, kv_heads = q.shape[0], k.shape[0]
    if heads % kv_heads:
        raise ValueError(f"capped_sdpa: {heads} query heads are not a multiple of {kv_heads} KV heads")
    if heads != kv_heads:  # an int repeat count: no host sync
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kf, vf = k.float().transpose(-1, -2), v.float()
    rows = max(1, TILE_SCORES // max(1, heads * k.shape[1]))  # query rows per tile
    if rows >= q.shape[1]:
        return _capped_tile(q, kf, vf, cap, scale, mask)
    out = q.new_empty((heads, q.shape[1], v.shape[-1]))
    for start in range(0, q.shape[1], rows):
        end = start + rows
        out[:, start:end] = _capped_tile(q[:, start:end], kf, vf, cap, scale,
                                         None if mask is None else mask[start:end])
    return out


def _capped_tile(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, cap: float, scale: float,
                 mask: torch.Tensor | None) -> torch.Tensor:
    """:func:`capped_sdpa` of some query rows; ``kt``: the keys transposed, float32."""
    scores = torch.matmul(q.float(), kt).mul_(scale / cap).tanh_().mul_(cap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).to(q.dtype)


def attend_mask(q_start: int, q_len: int, kv_len: int, *, causal: bool, window: int | None,
                device: torch.device) -> torch.Tensor | None:
    """``[q_len, kv_len]`` (True: attend) for query positions ``q_start ..`` over keys ``0 ..``:
    causal and / or SGLang's sliding window; None when neither applies."""
    windowed = window is not None and window >= 0
    if not (causal or windowed):
        return None
    q_pos = torch.arange(q_start, q_start + q_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    keep = k_pos <= q_pos  # SGLang's window mask is causal too
    return keep & (k_pos >= q_pos - window) if windowed else keep


def capped_extend(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                  extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                  encoder_lens: torch.Tensor | None = None, *, cap: float, scaling: float | None = None,
                  enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
                  sliding_window_size: int | None = None) -> torch.Tensor:
    """SGLang's ``_run_sdpa_forward_extend`` (same arguments; ``query`` / ``output``
    ``[tokens, H, D]``), soft-capped (module docstring). Encoder-decoder KV is refused."""
    del enable_gqa  # grouped heads follow from the shapes
    if encoder_lens is not None or is_cross_attn:
        raise ValueError("soft-capped attention over encoder KV (cross attention) is not supported")
    start_q = 0
    for seq in range(int(seq_lens.shape[0])):
        q_len, prefix, kv_len = int(extend_seq_lens[seq]), int(extend_prefix_lens[seq]), int(seq_lens[seq])
        tokens = req_to_token[req_pool_indices[seq], :kv_len]
        q = query[start_q:start_q + q_len].movedim(0, 1)  # [H, q_len, D]
        mask = attend_mask(prefix, q_len, kv_len, causal=causal, window=sliding_window_size, device=q.device)
        out = capped_sdpa(q, k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1), cap=cap,
                          scale=scaling, mask=mask)
        output[start_q:start_q + q_len] = out.movedim(1, 0).to(output.dtype)
        start_q += q_len
    return output


def capped_decode(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                  encoder_lens: torch.Tensor | None = None, *, cap: float, scaling: float | None = None,
                  enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
                  sliding_window_size: int | None = None) -> torch.Tensor:
    """SGLang's ``_run_sdpa_forward_decode`` (same arguments: one query row per request, its last
    position), soft-capped (module docstring)."""
    del enable_gqa, causal  # one row at the last position sees every earlier key
    if encoder_lens is not None or is_cross_attn:
        raise ValueError("soft-capped attention over encoder KV (cross attention) is not supported")
    for seq in range(int(seq_lens.shape[0])):
        kv_len = int(seq_lens[seq])
        tokens = req_to_token[req_pool_indices[seq], :kv_len]
        q = query[seq:seq + 1].movedim(0, 1)  # [H, 1, D]
        mask = attend_mask(kv_len - 1, 1, kv_len, causal=False, window=sliding_window_size, device=q.device)
        out = capped_sdpa(q, k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1), cap=cap,
                          scale=scaling, mask=mask)
        output[seq:seq + 1] = out.movedim(1, 0).to(output.dtype)
    return output
