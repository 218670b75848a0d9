"""DecodeBackends: the paged decode attentions `kvplane gpu-check` runs over the step's tables.

- ``triton``: ``kernels.paged_decode.paged_decode_triton`` (on CUDA compiled; on the CPU under
  ``TRITON_INTERPRET=1``, set only around its calls -- the interpreter is slow, so the dry run
  keeps it out of the timed steps);
- ``flashinfer``: :class:`FlashInferLayeredDecode` (CUDA, when the wheel is importable; planned
  once per step before layer 0, as SGLang plans in ``init_forward_metadata``);
- ``torch``: ``kernels.paged_decode.paged_decode_ref`` (a dense gather per request; it reads
  lengths on the host, so it is a reference, never a served kernel).

Each backend first runs once on a tiny paged cache of the check's heads and dtype (FlashInfer and
Triton compile there, outside any timing); one that raises is listed in ``failed`` and not used.
The timed steps use the ``primary`` backend: FlashInfer if it works, else Triton on CUDA; the
torch reference on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kernels.block_copy import HAVE_TRITON
from kernels.paged_decode import default_kv_splits, paged_decode_ref, paged_decode_triton
from sglang_ext.dataplane.results import LayerView

BACKENDS = ("flashinfer", "triton", "torch")


@contextmanager
def interpreted(on: bool) -> Iterator[None]:
    """``TRITON_INTERPRET=1`` inside the block when ``on`` (restored after)."""
    if not on:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


class DecodeBackends:
    """The available backends on ``device`` (see module docstring)."""

    def __init__(self, device: str, q_heads: int, max_pages: int, primary: str = "auto",
                 probe_shape: tuple[int, int, int, torch.dtype] | None = None) -> None:
        """``probe_shape``: (page_size, kv_heads, head_dim, dtype) of the probe run (None: no probe)."""
        self.device, self.q_heads, self.max_pages = device, q_heads, max_pages
        self.cuda = device.startswith("cuda")
        self.unavailable: dict[str, str] = {}
        """Backend -> why it is not run here."""
        self.fi = None
        if not self.cuda:
            self.unavailable["flashinfer"] = "needs CUDA"
        else:
            from sglang_ext.dataplane import flashinfer_attention as fia

            if fia.HAVE_FLASHINFER:
                self.fi = fia.FlashInferLayeredDecode(device, max_pages=max_pages)
            else:
                self.unavailable["flashinfer"] = "flashinfer not importable (bring the flashinfer-python wheel)"
        if not HAVE_TRITON:
            self.unavailable["triton"] = "triton not importable"
        self.failed: dict[str, str] = {}
        """Backend -> the error its probe run raised (installed but not working: a failure)."""
        if probe_shape is not None:
            for name in BACKENDS:
                if name not in self.unavailable:
                    self._probe(name, *probe_shape)
        self.available = tuple(b for b in BACKENDS if b not in self.unavailable and b not in self.failed)
        if primary == "auto":
            primary = "torch" if not self.cuda else ("flashinfer" if self.fi is not None else "triton")
        if primary not in self.available:
            raise ValueError(f"attention backend {primary!r} is not available here: "
                             f"{self.unavailable.get(primary, 'unknown')} (available: {self.available})")
        self.primary = primary

    def _probe(self, name: str, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Run ``name`` once on two pages of three tokens' worth; record an exception in ``failed``."""
        dev = self.device
        cache = torch.randn((2, 2, page_size, kv_heads, head_dim), device=dev).to(dtype)
        i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
        n = page_size + 1
        view = LayerView(layer=0, k_cache=cache[0], v_cache=cache[1], kv_indptr=i32(0, 2), kv_indices=i32(1, 0),
                         kv_lens=i32(n), last_page_len=i32(n - page_size), rids=("probe",))
        q = torch.randn((1, self.q_heads, head_dim), device=dev).to(dtype)
        try:
            if name == "flashinfer" and self.fi is not None:
                self.fi.plan(view, self.q_heads)
            out = self.run(name, q, view)
            if not bool(torch.isfinite(out.float()).all()):
                raise RuntimeError("non-finite output")
        except Exception as exc:  # noqa: BLE001 - reported as a failed backend
            self.failed[name] = f"{type(exc).__name__}: {exc}"[:300]

    def plan_step(self, view: LayerView, graph: bool = False) -> None:
        """Once per step, before layer 0 (FlashInfer's plan; the others need none); ``graph``: on
        FlashInfer's CUDA-graph wrappers (a capture or a replay), else its eager ones (serving's)."""
        if self.fi is not None and graph:  # as the served decode plans its graphs (pinned CSR, no page ids)
            from sglang_ext.dataplane.flashinfer_attention import AttentionParams

            self.fi.plan_graph(view, (AttentionParams(num_qo_heads=self.q_heads),))
        elif self.fi is not None:
            self.fi.plan(view, self.q_heads)

    def run(self, name: str, q: torch.Tensor, view: LayerView) -> torch.Tensor:
        """Decode attention of ``view``'s layer with backend ``name`` (``[B, Hq, D]``)."""
        args = (q, view.k_cache, view.v_cache, view.kv_indptr, view.kv_indices, view.kv_lens)
        if name == "flashinfer" and self.fi is not None:
            return self.fi.run(q, view)
        if name == "triton":  # splits sized from the batch's page bound, not the view's length: one kernel
            # shape whatever the view lists (a step's own tables, or a graph's buffers' whole rows)
            splits = default_kv_splits(q, view.k_cache.shape[2], self.max_pages, view.k_cache.shape[1])
            with interpreted(not self.cuda):
                return paged_decode_triton(*args, num_kv_splits=splits)
        if name == "torch":
            return paged_decode_ref(*args)
        raise ValueError(f"backend {name!r} is not available: {self.unavailable.get(name, 'unknown')}")
