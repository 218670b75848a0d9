"""GraphProbe: `kvplane gpu-check`'s all-resident step with its layers replayed as a CUDA graph.

Why: the H200 runs (``benchmarks/results/gpu/session32-h200-runs.md``) put the check's eager
all-resident step at 12.25-18.3 ms, about 0.35-0.39 ms a layer, where the layer's GPU work at
these shapes is nearer 0.23 ms (its weights, 436 MB, and its KV, ~0.65 GB at batch 32 x 5K
tokens, read at the H200's ~4.8 TB/s): the eager step is host-bound, and every microsecond of
host work -- kvplane's included -- is step time. Stock SGLang replays its decode as CUDA graphs,
which ``--enable-layered-kv`` turns off (``launch_decision.py``). Before kvplane's data plane can
be replayed, one must know that it can be captured at all, and what replay would buy. So:

1. the batch goes all-resident, decodes two steady steps, and a third step's boundary runs on
   the host as usual (SGLang's replay too runs ``init_forward_metadata`` outside the graph);
2. that step's layers -- the stand-in layer body, kvplane's ``enter_layer`` / ``write`` /
   ``exit_layer`` (the last one's, which ends the step, outside), the Triton paged decode --
   run eagerly, timed, then are captured in a CUDA graph (after warm-ups on a side stream) and
   replayed, timed. Running them again writes the same token into the same rows: the step is
   idempotent until its last ``exit_layer``;
3. figures: the replay's outputs against the eager ones (bit-exact: the same kernels over the
   same data; a difference says something in kvplane's per-layer path read the host at capture
   or moved between runs), the layers' time eager vs replayed (what the host costs this step,
   i.e. what turning CUDA graphs off costs at these shapes), and kvplane's host share were the
   layers replayed (its boundary time over boundary + replay).

What it does not show: replaying *successive* steps. The captured graph reads this step's tables
where they lie (kept alive here); a served replay needs each step's tables copied into buffers
that stay put, which the data plane does not do yet. Triton attention (two launches, nothing read
on the host); FlashInfer's decode needs its CUDA-graph wrapper mode, not tried here. A capture
that raises is reported in the figures' notes, N/A, never a failed check; on the CPU there is no
graph to capture (N/A), but the same orchestration runs under the tests with an eager stand-in.
"""

from __future__ import annotations

import statistics
import traceback
from collections.abc import Callable
from typing import Any

import torch

from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.tools.gpu_check_report import Figure

STEADY_STEPS = 2
"""All-resident steps decoded after the placement moves, before the captured one."""
WARMUP_RUNS = 2
"""Eager runs on a side stream before capture (``torch.cuda.graphs``' advice)."""
STEPS = STEADY_STEPS + 1
"""Decode steps (new tokens) the probe adds to the batch (``GpuCheckConfig.decode_steps``)."""


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the probe's two calls (the tests stand an eager one in)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """``fn``'s outputs as the graph's static tensors (warm-ups on a side stream first)."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        current.wait_stream(side)
        with torch.cuda.graph(self.graph):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class GraphProbe:
    """The probe (module docstring) on a :class:`~sglang_ext.tools.gpu_check_measure.CoreCheck`;
    ``graph``: builds the graph object from the device (default :class:`CudaGraph`, CUDA only)."""

    def __init__(self, check: Any, graph: Callable[[str], Any] | None = None) -> None:
        self.check = check
        self.graph = graph

    def run(self) -> list[Figure]:
        """The probe's figures (N/A with the reason where nothing could be captured)."""
        ch = self.check
        if self.graph is None and not ch.device.startswith("cuda"):
            return self.figures(None, "CUDA only: there is no graph to capture on the CPU")
        try:
            measured = self.measure()
        except Exception as exc:  # noqa: BLE001 - a probe on hardware nobody ran it on: reported, not failed
            traceback.print_exc()
            return self.figures(None, f"the capture or replay raised {type(exc).__name__}: {exc}")
        ch.details["graph_probe"] = measured
        return self.figures(measured, "")

    def measure(self) -> dict[str, Any]:
        """Capture and replay one all-resident step's layers (module docstring, 1-2)."""
        ch = self.check
        b, c, device = ch.batch, ch.config, ch.device
        core = b.core
        b.place([[1] * c.layers for _ in b.rids])
        core.store.engine.quiesce()
        sync(device)
        boundary_cpu_ms = []  # kvplane's share of each boundary (prepare_step), the captured step's last
        for _ in range(STEADY_STEPS):
            ch.step()
            boundary_cpu_ms.append(b.prepare_cpu_s * 1e3)
        sync(device)
        loc = b.begin_decode()
        boundary_cpu_ms.append(b.prepare_cpu_s * 1e3)
        tables = core.tables  # the graph reads these buffers: alive until the step ends
        if tables is None:
            raise RuntimeError("the all-resident step staged no tables (overflow?): nothing to capture")
        backend = "triton" if "triton" in ch.backends.available else ch.backends.primary
        if backend == "flashinfer":  # planned once, outside the layers (never the probe's case with Triton)
            ch.backends.plan_step(tables.plan_view(b.layer_view(0)))

        def layers() -> list[torch.Tensor]:
            return ch.layers(loc, backend=backend, plan=False, end_step=False)

        try:
            eager = [out.clone() for out in layers()]
            sync(device)
            eager_ms = time_ms(layers, device, c.repeat)
            graph = (self.graph or CudaGraph)(device)
            static = graph.capture(layers)
            graph.replay()
            sync(device)
            diff = max(float((s.float() - e.float()).abs().max()) for s, e in zip(static, eager, strict=True))
            replay_ms = time_ms(graph.replay, device, c.repeat)
        finally:
            core.exit_layer(c.layers - 1)  # the step ends as every step does
            core.store.engine.quiesce()
            sync(device)
        return {"backend": backend, "layers_eager_ms": eager_ms, "layers_replay_ms": replay_ms,
                "replay_max_abs_diff": diff, "boundary_cpu_ms": statistics.median(boundary_cpu_ms),
                "boundary_cpu_ms_each": boundary_cpu_ms, "layers": c.layers,
                "requests": len(b.rids)}

    def figures(self, m: dict[str, Any] | None, why: str) -> list[Figure]:
        """Four figures: the replay's agreement (graded: bit-exact), and three for the record."""
        got = m is not None
        eager, replay = (m["layers_eager_ms"], m["layers_replay_ms"]) if got else (None, None)
        note = why if not got else f"Triton attention ({m['backend']}), {m['layers']} layers, batch {m['requests']}"
        share = None if not got else m["boundary_cpu_ms"] / (m["boundary_cpu_ms"] + replay)
        cuda = self.check.device.startswith("cuda")
        return [
            Figure.graded(
                "graph.replay_max_abs_diff", "CUDA-graph replay of an all-resident step's layers vs eager",
                None if not got else m["replay_max_abs_diff"], "abs", "<=", 0.0,
                "the layers (kvplane's enter / write / exit, Triton paged decode, the layer body) captured "
                "once and replayed: every layer's attention output vs the same layers run eagerly",
                meaningful=got, note=note),
            Figure.graded(
                "graph.layers_ms.eager", "all-resident step's layers, eager", eager, "ms", None, None,
                "median wall time of the layers alone (the boundary excluded), device-synchronised",
                meaningful=got and cuda, note=note),
            Figure.graded(
                "graph.layers_ms.replay", "all-resident step's layers, CUDA-graph replay", replay, "ms", None,
                None, "median wall time of one replay, device-synchronised; eager / replay = "
                + ("-" if not got else f"{eager / replay:.2f}x"), meaningful=got and cuda, note=note),
            Figure.graded(
                "graph.kvplane_cpu_share", "kvplane CPU time per step / step, were the layers replayed", share,
                "ratio", None, None, "the step boundary's thread CPU time (prepare_decode_step: kvplane's "
                "host work left outside a graph; median of the probe's three steps) over boundary + replay",
                meaningful=got and cuda, note=note if not got else f"{m['boundary_cpu_ms']:.3f} ms boundary; {note}"),
        ]
