"""GpuCheckConfig: the shapes `kvplane gpu-check` drives the served core at (typed, validated).

Two presets: ``llama3-8b`` (issue 14: 32 layers, 32 query / 8 KV heads x 128, bf16, page 16,
batch 32, contexts 2K-8K, a gated MLP of 4096 x 14336 standing in for the rest of the layer)
and ``small`` (the CPU dry run: the same code path at toy sizes in float32, as bf16 matmuls
are slow on a CPU; well under a minute on two cores). ``--shapes auto`` picks ``llama3-8b`` on CUDA and ``small`` on the CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


PROGRAM_CAPS: tuple[int | None, ...] = (None, 256, 32, 16, 4)
"""Copy-launch program caps the overlap phase sweeps on CUDA (None: the kernel's default,
``kernels.block_copy.DEFAULT_PROGRAMS`` = 8; 256 about the default before it, 2 per SM;
:mod:`~sglang_ext.tools.gpu_check_overlap`)."""
TIMELINE_STEPS = 3
"""Steps of each kind laid out on the device (:class:`~sglang_ext.tools.step_timeline_probe.
StepTimelineProbe`); the last is kept."""


@dataclass(frozen=True)
class GpuCheckConfig:
    """What one check runs (validated; ``ValueError`` names the field and the allowed range)."""

    name: str
    """Preset name (``llama3-8b`` or ``small``)."""
    layers: int
    """Transformer layers L."""
    q_heads: int
    """Query heads (GQA: a multiple of ``kv_heads``)."""
    kv_heads: int
    """KV heads per layer."""
    head_dim: int
    """Head dimension of K and V."""
    page_size: int
    """Tokens per page (SGLang's ``page_size``; the planner's block)."""
    requests: int
    """Decode batch size."""
    context_min: int
    """Context tokens of the shortest request (contexts are spread evenly up to the longest)."""
    context_max: int
    """Context tokens of the longest request."""
    hidden: int
    """Hidden size of the stand-in layer body (attention output and MLP)."""
    intermediate: int
    """Intermediate size of the stand-in gated MLP."""
    dtype: str = "bfloat16"
    """KV and compute dtype (one of :data:`DTYPES`)."""
    offload_share: float = 0.5
    """Share of the batch's KV the planner's device budget leaves out (half-offloaded: 0.5)."""
    repeat: int = 10
    """Timed decode steps per figure (median)."""
    seed: int = 0
    """Seed of every random tensor (KV, queries, weights)."""

    def __post_init__(self) -> None:
        for name in ("layers", "q_heads", "kv_heads", "head_dim", "page_size", "requests", "context_min",
                     "context_max", "hidden", "intermediate", "repeat"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GpuCheckConfig.{name}={value!r} must be an int >= 1")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"GpuCheckConfig.q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.context_max < self.context_min:
            raise ValueError(f"GpuCheckConfig.context_max={self.context_max} is below context_min={self.context_min}")
        if self.dtype not in DTYPES:
            raise ValueError(f"GpuCheckConfig.dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        if not 0.0 < self.offload_share < 1.0:
            raise ValueError(f"GpuCheckConfig.offload_share={self.offload_share} must be in (0, 1)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def contexts(self) -> tuple[int, ...]:
        """Context tokens per request, evenly spread over ``[context_min, context_max]``."""
        n = self.requests
        if n == 1:
            return (self.context_max,)
        span = self.context_max - self.context_min
        return tuple(self.context_min + (span * i) // (n - 1) for i in range(n))

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one layer-page, K and V (the planner's ``block_bytes``)."""
        return 2 * self.page_size * self.kv_heads * self.head_dim * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def decode_steps(self) -> int:
        """Decode steps one check runs (warm-ups, timed and instrumented steps): the batch's headroom.
        Per phase: resident (a timed run of ``repeat + 2`` steps, ``2 * repeat`` for the host time
        (``repeat`` of them timed by events every step, for the stall observations), 3
        profiled, ``TIMELINE_STEPS``), placed (the same, 2 sync-probed, 1 for accuracy), overlap
        (an all-resident timed run, one per cap of ``PROGRAM_CAPS`` -- counted even where the
        engine has no cap -- one with the copy engines and ``TIMELINE_STEPS`` for each copy
        implementation; its host time, twice where the copy engines refuse midway; the
        half-offloaded placement on the copy engines, timed and laid out),
        recompute (a timed run, 1 for accuracy); with a margin; the placed phase once more
        (on the kernels, where the copy engines fault in it: ``gpu_check_placed.PlacedPhase``);
        and the CUDA-graph probes' steps (``gpu_check_graph.steps``, ``gpu_check_staged_graph.steps``);
        the batch-change phase's (``gpu_check_turnover``: one settling step, two a round, one checked)."""
        from sglang_ext.tools.gpu_check_graph import steps as graph_steps
        from sglang_ext.tools.gpu_check_staged_graph import steps as staged_steps
        from sglang_ext.tools.gpu_check_turnover import CHECKED_STEPS, ROUNDS, STEPS_PER_ROUND

        runs = self.repeat + 2
        return ((16 + len(PROGRAM_CAPS)) * runs + 6 * TIMELINE_STEPS + 13 + graph_steps(self.repeat)
                + staged_steps(self.repeat) + 1 + ROUNDS * STEPS_PER_ROUND + CHECKED_STEPS)

    def with_overrides(self, **changes: object) -> GpuCheckConfig:
        """A copy with the non-None ``changes`` applied (CLI overrides)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


LLAMA3_8B = GpuCheckConfig(
    name="llama3-8b", layers=32, q_heads=32, kv_heads=8, head_dim=128, page_size=16, requests=32,
    context_min=2048, context_max=8192, hidden=4096, intermediate=14336,
)
"""Issue 14's shapes: Llama-3-8B (bf16) at batch 32 with contexts 2K-8K."""

SMALL = GpuCheckConfig(
    name="small", layers=4, q_heads=8, kv_heads=2, head_dim=32, page_size=16, requests=4,
    context_min=64, context_max=160, hidden=128, intermediate=256, dtype="float32", repeat=5,
)
"""The CPU dry run's shapes (same code path, toy sizes)."""

PRESETS = {"llama3-8b": LLAMA3_8B, "small": SMALL}
