"""ExtendCheck: `kvplane gpu-check`'s prefill phase.

The paged backends (``--attention-backend triton`` / ``flashinfer`` under ``--enable-layered-kv``)
serve extends through :func:`kernels.paged_extend.paged_extend_triton` over the step's per-layer
page tables (``sglang_ext/layered_paged_decode.py``). This phase runs that kernel at the check's
heads and dtype on a scattered paged cache -- whole prompts, a chunk after a cached prefix, a
short prompt and a single decode row in one batch -- and reports:

- ``extend.max_abs_err``: its largest deviation from the fp32 reference
  (:func:`~kernels.paged_extend.paged_extend_ref`), against the 16-bit tensor-core tolerance on
  CUDA (the interpreter's fp32 dots on the CPU);
- ``extend.vs_torch_loop`` (CUDA): its time over that of the path it replaced -- SGLang's
  torch-native extend, a per-request gather of the request's K/V and torch SDPA over the whole
  sequence (its lengths here are host ints, so the loop is timed *without* the device reads the
  served one makes at every request and layer: a conservative comparison); target <= 1;
- ``extend.vs_dense_sdpa`` (CUDA, no target): its time over that SDPA alone on K/V gathered
  beforehand -- what the torch path costs without reading the pool;
- ``extend.tflops`` (CUDA, no target): causal attention FLOPs over the kernel's time.

Times are medians of device-synchronised wall time of one layer's attention (``bench_env.time_ms``),
the three timed in alternating rounds. On the CPU the kernel runs
under the Triton interpreter for the error only (timing figures are N/A: CUDA only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels.paged_extend import paged_extend_ref, paged_extend_triton
from sglang_ext.dataplane.bench_env import time_ms
from sglang_ext.tools.gpu_check_attention import interpreted
from sglang_ext.tools.gpu_check_config import GpuCheckConfig
from sglang_ext.tools.gpu_check_report import Figure

CUDA_PROMPTS = ((0, 4096), (0, 2048), (4096, 2048), (0, 512), (1024, 64), (3000, 1))
"""``(cached prefix, new tokens)`` per request on CUDA: two whole prompts, a chunked-prefill chunk,
a short prompt, a short extend of a long prefix and a decode row (a mixed batch)."""
CPU_PROMPTS = ((0, 20), (12, 9), (0, 3), (7, 1))
"""The same shape of batch at the dry run's size (the interpreter pays per program)."""
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
"""Max abs error vs the fp32 reference: a few ulps of the 16-bit type on the tensor cores
(``tests/kernels/test_paged_extend.py``); summation order in fp32."""
WARMUP = 2
ROUNDS = 5
"""At least this many alternating timing rounds (``GpuCheckConfig.repeat`` if more)."""


def causal_flops(prompts: tuple[tuple[int, int], ...], q_heads: int, head_dim: int) -> float:
    """FLOPs of causal attention over ``prompts``: 2 dots of ``2 * D`` per (head, query, key seen)."""
    pairs = sum(e * p + e * (e + 1) // 2 for p, e in prompts)
    return 4.0 * q_heads * head_dim * pairs


class ExtendCheck:
    """The prefill phase (module docstring)."""

    def __init__(self, config: GpuCheckConfig, device: str,
                 prompts: tuple[tuple[int, int], ...] | None = None) -> None:
        self.config, self.device = config, device
        self.cuda = device.startswith("cuda")
        self.prompts = prompts or (CUDA_PROMPTS if self.cuda else CPU_PROMPTS)
        self.details: dict[str, Any] = {}

    def _inputs(self) -> dict[str, Any]:
        c, dev = self.config, self.device
        g = torch.Generator().manual_seed(c.seed)
        ps, dtype = c.page_size, c.torch_dtype
        seq = [p + e for p, e in self.prompts]
        counts = [-(-n // ps) for n in seq]
        pages = torch.randperm(sum(counts) + 3, generator=g)[: sum(counts)]  # scattered, a few unused
        shape = (sum(counts) + 3, ps, c.kv_heads, c.head_dim)
        new = torch.tensor([e for _, e in self.prompts])
        i32 = lambda t: torch.as_tensor(t, dtype=torch.int32).to(dev)  # noqa: E731
        return {
            "q": torch.randn(int(new.sum()), c.q_heads, c.head_dim, generator=g).to(dev, dtype),
            "k_cache": torch.randn(shape, generator=g).to(dev, dtype),
            "v_cache": torch.randn(shape, generator=g).to(dev, dtype),
            "q_start": i32(new.cumsum(0) - new), "q_lens": i32(new),
            "kv_indptr": i32([0, *torch.tensor(counts).cumsum(0).tolist()]),
            "kv_indices": i32(pages), "kv_lens": i32(seq),
        }

    def _kernel(self, t: dict[str, Any]) -> torch.Tensor:
        with interpreted(not self.cuda):
            return paged_extend_triton(**t, max_q_len=max(e for _, e in self.prompts))

    def _loops(self, t: dict[str, Any]) -> tuple[Callable[[], None], Callable[[], None]]:
        """(SGLang's torch-native extend loop over the paged cache, its SDPA alone on K/V
        gathered beforehand)."""
        c = self.config
        q = t["q"].movedim(0, 1)  # [Hq, T, D], as SGLang's loop views it
        indptr, indices = t["kv_indptr"].tolist(), t["kv_indices"].long()
        spans, start = [], 0
        for b, (p, e) in enumerate(self.prompts):
            spans.append((start, p, e, indices[indptr[b]: indptr[b + 1]]))
            start += e
        out = torch.empty_like(q)

        def gather(pages: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            k = t["k_cache"][pages].reshape(-1, c.kv_heads, c.head_dim)[:n].movedim(0, 1)
            v = t["v_cache"][pages].reshape(-1, c.kv_heads, c.head_dim)[:n].movedim(0, 1)
            return k, v

        def attend(s: int, p: int, e: int, k: torch.Tensor, v: torch.Tensor) -> None:
            full = q.new_empty((c.q_heads, p + e, c.head_dim))
            full[:, p:] = q[:, s: s + e]
            o = F.scaled_dot_product_attention(full.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                               is_causal=True, enable_gqa=True).squeeze(0)
            out[:, s: s + e] = o[:, p:]

        gathered = [gather(pages, p + e) for _, p, e, pages in spans]

        def loop() -> None:
            for s, p, e, pages in spans:
                attend(s, p, e, *gather(pages, p + e))

        def dense() -> None:
            for (s, p, e, _), (k, v) in zip(spans, gathered, strict=True):
                attend(s, p, e, k, v)

        return loop, dense

    def _interleaved_ms(self, fns: list[Callable[[], Any]]) -> list[float]:
        """Each of ``fns``' median time, timed in alternating rounds (each warmed first): a clock
        that ramps or throttles during the phase moves them alike. Run 23 (H200) timed the kernel
        first, then the loop, each in one block: the kernel 1.54 ms there against 1.36 ms in run
        22's probe, which timed it amid other work."""
        for fn in fns:
            time_ms(fn, self.device, 1, warmup=WARMUP)
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(max(self.config.repeat, ROUNDS)):
            for got, fn in zip(samples, fns, strict=True):
                got.append(time_ms(fn, self.device, 1, warmup=0))
        return [sorted(got)[len(got) // 2] for got in samples]

    def run(self) -> list[Figure]:
        c, dtype = self.config, self.config.torch_dtype
        t = self._inputs()
        got = self._kernel(t)
        want = paged_extend_ref(**t)
        err = float((got.float() - want.float()).abs().max())
        tol = TOLERANCE[dtype]
        batch = ", ".join(f"{p}+{e}" for p, e in self.prompts)
        self.details = {"prompts": [list(x) for x in self.prompts], "max_abs_err": err}
        figures = [Figure.graded(
            "extend.max_abs_err", "paged extend (prefill) kernel vs fp32 reference, max abs error", err, "",
            "<=", tol, f"one layer's extend of a batch (prefix+new: {batch}) on a scattered paged cache, "
            f"{c.q_heads}/{c.kv_heads} heads x {c.head_dim}, {c.dtype}, page {c.page_size}",
            note="" if self.cuda else "the Triton interpreter (fp32 dots)")]
        timing = [("extend.vs_torch_loop", "paged extend time / SGLang torch-native extend loop time", "x", "<=", 1.0),
                  ("extend.vs_dense_sdpa", "paged extend time / torch SDPA on pre-gathered K/V", "x", None, None),
                  ("extend.tflops", "paged extend causal attention throughput", "TFLOP/s", None, None)]
        if not self.cuda:
            return figures + [Figure.graded(key, title, None, unit, op, thr, "device-synchronised wall time", meaningful=False,
                                            note="CUDA only: kernel times under the interpreter mean nothing")
                              for key, title, unit, op, thr in timing]
        loop, dense = self._loops(t)
        kernel_ms, loop_ms, dense_ms = self._interleaved_ms([lambda: self._kernel(t), loop, dense])
        tflops = causal_flops(self.prompts, c.q_heads, c.head_dim) / (kernel_ms * 1e-3) / 1e12
        self.details.update(kernel_ms=kernel_ms, torch_loop_ms=loop_ms, dense_sdpa_ms=dense_ms, tflops=tflops)
        method = (f"median device-synchronised wall time of one layer's attention ({max(c.repeat, ROUNDS)} rounds "
                  f"alternating the three after {WARMUP} warm-ups each), batch {batch}; kernel {kernel_ms:.3f} ms, "
                  f"torch loop {loop_ms:.3f} ms, "
                  f"SDPA alone {dense_ms:.3f} ms")
        values = (kernel_ms / loop_ms, kernel_ms / dense_ms, tflops)
        return figures + [Figure.graded(key, title, value, unit, op, thr, method)
                          for (key, title, unit, op, thr), value in zip(timing, values, strict=True)]
