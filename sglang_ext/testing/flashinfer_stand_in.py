"""``FlashInferStandIn``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (0.7.2, ``fa2``) as
far as kvplane relies on it, computing real attention on any device -- so the layered FlashInfer
backend (``LayeredFlashInferDecode``) serves real SGLang requests on a CPU, eagerly and under
SGLang's decode graph runner (``tests/sglang/test_graph_server.py``). FlashInfer's kernels need
CUDA; they are checked against the dense reference by the gpu tests and ``kvplane gpu-check``.

What it keeps of the real wrapper (``flashinfer/decode.py``):

- the constructor's keywords; ``use_cuda_graph`` with user-owned ``indptr`` / ``indices`` /
  ``last_page_len`` buffers of a fixed batch size;
- ``plan``: eager, it keeps the CSR it is given (on the device) and takes ``indices`` as its
  indices buffer; in CUDA-graph mode it copies the CSR into its own fixed buffers, refusing
  another batch size or more indices than its buffer holds -- the lengths a run reads are the
  last plan's;
- ``run(q, (k_cache, v_cache))`` reads the page ids from whatever ``_paged_kv_indices_buf`` it
  finds (``fa2``), the lengths from the plan's buffers, and the scalars (scale, soft cap,
  window) the plan fixed. It refuses a run whose query or KV heads are not the plan's: FlashInfer
  sizes a plan's schedule by its head counts (the group size sets a tensor-core row's packing)
  and does not check a run against them, so on a GPU such a run decodes from a wrong schedule --
  under TP a plan must be made with this rank's heads (``tests/sglang/test_tp_graph_server.py``).

The run is fixed-shape torch (every row gathers as many pages as the indices buffer holds,
masked by its lengths): no host read, so a graph captured over it (``TapeGraph``) replays it
over whatever its buffers hold then, as FlashInfer's kernel does.
"""

from __future__ import annotations

import math
from typing import Any

import torch


class FlashInferStandIn:
    """A decode wrapper with FlashInfer 0.7.2's interface (module docstring)."""

    def __init__(self, workspace: torch.Tensor, layout: str, use_cuda_graph: bool = False, backend: str = "auto",
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        if layout != "NHD":
            raise ValueError(f"layout {layout!r}: the stand-in keeps NHD only")
        if use_cuda_graph != (paged_kv_indices_buffer is not None):
            raise ValueError("use_cuda_graph needs the three user-owned buffers, and they need it")
        self.device = workspace.device
        self.graph, self._backend, self._uses_cudnn = use_cuda_graph, backend, False
        self.tensor_cores = use_tensor_cores
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        self.plans = 0
        self._scalars: tuple[int, float, float, int] = (0, 1.0, 0.0, -1)
        """The last plan's (query heads, scale, soft cap, window_left)."""
        self._kv_heads = 0
        """The last plan's KV heads."""

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, window_left: int = -1,
             logits_soft_cap: float | None = None, q_data_type: Any = None, kv_data_type: Any = None,
             sm_scale: float | None = None) -> None:
        del page_size, q_data_type, kv_data_type  # read from the caches at run
        if self.graph:
            indptr_buf, last_buf = self._paged_kv_indptr_buf, self._paged_kv_last_page_len_buf
            assert indptr_buf is not None and last_buf is not None and self._paged_kv_indices_buf is not None
            if last_page_len.numel() != last_buf.numel():
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if indices.numel() > self._paged_kv_indices_buf.numel():
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            indptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            self._paged_kv_indices_buf[: indices.numel()].copy_(indices)
        else:
            self._paged_kv_indptr_buf = indptr.to(self.device, torch.int32)
            self._paged_kv_last_page_len_buf = last_page_len.to(self.device, torch.int32)
            self._paged_kv_indices_buf = indices
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self._scalars = (num_qo_heads, float(scale), float(logits_soft_cap or 0.0), int(window_left))
        self._kv_heads = num_kv_heads
        self.plans += 1

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Decode attention ``[B, Hq, D]`` of q ``[B, Hq, D]`` over the paged caches
        ``[pages, page_size, Hkv, D]`` (module docstring: fixed shapes, no host read)."""
        k_cache, v_cache = kv
        indices, indptr, last = self._paged_kv_indices_buf, self._paged_kv_indptr_buf, self._paged_kv_last_page_len_buf
        assert indices is not None and indptr is not None and last is not None
        heads, scale, cap, window = self._scalars
        if (q.shape[1], k_cache.shape[2]) != (heads, self._kv_heads):
            raise ValueError(f"the stand-in: a run of {q.shape[1]} query / {k_cache.shape[2]} KV heads on a plan "
                             f"for {heads} / {self._kv_heads} (FlashInfer would decode from a wrong schedule)")
        width, page = indices.shape[0], k_cache.shape[1]
        start, count = indptr[:-1].long(), (indptr[1:] - indptr[:-1]).long()
        slot = torch.arange(width, device=indices.device)
        pages = indices.long()[(start[:, None] + slot[None, :]).clamp(max=width - 1)]  # [B, W]
        k = k_cache[pages].flatten(1, 2).float()  # [B, W * page, Hkv, D]
        v = v_cache[pages].flatten(1, 2).float()
        group = q.shape[1] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        tokens = torch.arange(width * page, device=indices.device)[None, :]
        length = ((count - 1) * page + last.long())[:, None]  # [B, 1]
        ok = tokens < length
        if window >= 0:
            ok = ok & (tokens >= length - 1 - window)
        scores = torch.einsum("bhd,bthd->bht", q.float(), k) * scale
        if cap > 0:
            scores = cap * torch.tanh(scores / cap)
        scores = scores.masked_fill(~ok[:, None, :], float("-inf"))
        out = torch.einsum("bht,bthd->bhd", scores.softmax(dim=-1), v)
        return out.to(q.dtype)
