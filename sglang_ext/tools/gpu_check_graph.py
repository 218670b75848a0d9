"""GraphProbe: `kvplane gpu-check`'s all-resident decode steps replayed as one CUDA graph.

Why: the H200 runs (``benchmarks/results/gpu/session32-h200-runs.md``) put the check's eager
all-resident step at 12.25-18.3 ms, about 0.35-0.39 ms a layer, where the layer's GPU work at
these shapes is nearer 0.23 ms (its weights, 436 MB, and its KV, ~0.65 GB at batch 32 x 5K
tokens, read at the H200's ~4.8 TB/s): the eager step is host-bound, and every microsecond of
host work -- kvplane's included -- is step time. Stock SGLang replays its decode as CUDA graphs,
which ``--enable-layered-kv`` turns off (``launch_decision.py``). Before the data plane can be
replayed one must know that it can be, and what replay buys. So:

1. the batch goes all-resident and decodes eager steps (timed: the eager step);
2. a step's boundary runs on the host as usual (SGLang's replay too runs
   ``init_forward_metadata`` outside the graph) and its tables go into
   :class:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers`; its layers read them (the
   stand-in layer body, the new token's K/V written to the buffers' rows, the Triton paged decode
   over the buffers' page table) -- first eagerly, checked against the same layers over the
   step's own tables, then captured in a CUDA graph (after warm-ups on a side stream) and
   replayed, checked again: bit-exact, the same kernels over the same data. Running the layers
   again writes the same token into the same rows: the step is idempotent until it ends;
3. then successive steps run as boundary + load + replay, timed (the replayed step); one more is
   replayed and its layers run eagerly over its own tables, checked bit-exact again (a graph
   that read anything the capture's step left behind -- its tables, its batch -- differs here,
   not at the capture); and one eager step after them compares every layer's attention with
   the dense reference over the regenerated KV: the replays wrote every token where the tables
   say, step after step;
4. figures: the two agreements (graded), the layers' and the steps' time eager vs replayed (what
   turning CUDA graphs off costs at these shapes), and kvplane's host share were the steps
   replayed (its boundary and the load, over the replayed step).

The graph holds :data:`PADDED_ROWS` rows more than the batch, as SGLang replays a batch on the
smallest captured size that holds it: the padded rows (large random inputs) write and read the
store's sink page (:meth:`GraphStepBuffers.load`), and every agreement compares the batch's rows.

A padded batch may split its KV otherwise than the batch alone (the kernels size their splits
from the batch), so the padded buffers vs the step's own tables are graded within bf16 tolerance
(``graph.buffers_vs_tables_err``), and a replay vs the same layers run eagerly over the same
buffers bit-exactly (``graph.replay_max_abs_diff``). With ``runner``, SGLang's decode runner's
flow follows (:meth:`GraphProbe.runner_run`, ``graph.runner.*``): graphs of two sizes captured
over a padding-only step, each step admitted after its boundary
(:class:`~sglang_ext.dataplane.decode_graphs.DecodeGraphs`); with ``identity``, the identity
layout's probe on a batch of its own (``graph.identity.*``).

Not covered: staged steps (a graph holds kernels only; fetches need host work in the layers,
:meth:`GraphStepBuffers.why_not`), and SGLang's graph runner itself (no SGLang on the GPU host; the
served path hooks it, ``sglang_ext/graph_runner_hooks.py``, and ``tests/sglang/test_graph_server.py``
runs it on the CPU over an emulated graph). The decode is FlashInfer's
where it is available (what serves on CUDA: its wrapper is already in CUDA-graph buffer mode,
one plan a step -- outside the graph, after the load -- and each layer's run reading that
layer's row of the buffers' page table, in place or copied into the wrapper's indices buffer:
``FlashInferLayeredDecode.run``), else Triton's (two launches, nothing read on the host);
where FlashInfer's capture raises, the probe says so and measures Triton's. A FlashInfer graph
captured over one plan replays a later plan's lengths: in FlashInfer 0.7.2 (``decode.py``) a
tensor-core ``auto`` wrapper with bf16/fp16 q and KV resolves to ``fa2`` at ``plan`` (cuDNN only
for multi-token rows on SM100/103), and fa2's kernel gets the plan's lengths only through what the
next ``plan`` rewrites (the wrapper's ``indptr`` / ``last_page_len`` buffers and the int
workspace's split schedule, fixed per batch size in CUDA-graph mode): the wrapper hands ``paged_run`` its ``max_kv_len``, which
``prefill.py``'s fa2 branch drops, while ``trtllm-gen`` and ``cute-dsl`` pass it to their kernels
(a replay would keep it). A capture that
raises on both is reported in the figures' notes, N/A, never a failed check;
on the CPU there is no graph (N/A), but the tests capture and replay the same steps on
:class:`~sglang_ext.testing.tape_graph.TapeGraph`, an emulation with a graph's semantics.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.tools.gpu_check_deadline import stop_deferred
from sglang_ext.tools.gpu_check_report import Figure

BACKENDS = ("flashinfer", "triton")
"""The decodes the probe captures, in order: FlashInfer's (what serves on CUDA; its wrapper in
CUDA-graph buffer mode, planned once a step outside the graph), then Triton's."""
WARMUP_RUNS = 2
"""Eager runs on a side stream before capture (``torch.cuda.graphs``' advice)."""
RUNNER_STEPS = 3
"""Steps the runner's flow admits and replays (:meth:`GraphProbe.runner_run`)."""
IDENTITY_REQUESTS = 8
"""Requests of the identity layout's batch (:meth:`GraphProbe.identity_run`): its device pool
holds every layer of every logical page, so it is kept small beside the check's own batch."""
PADDED_ROWS = 1
"""Rows the probe's graph holds beyond the batch: SGLang replays a batch on the smallest captured
size that holds it, the rest padded (:meth:`GraphStepBuffers.load`); the padded rows carry large
random inputs, and only the batch's rows are compared."""


def steps(repeat: int) -> int:
    """Decode steps (new tokens) the probe adds to the batch (``GpuCheckConfig.decode_steps``): per
    backend tried (two at most) the timed eager steps (``time_ms``: 2 warm-ups + ``repeat``), the
    captured one, the replayed ones (as many), the later replay checked and the accuracy step; then
    the runner's flow: its steps and its accuracy step."""
    return 2 * (2 * (repeat + 2) + 3) + RUNNER_STEPS + 1


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
        with stop_deferred(), torch.cuda.graph(self.graph):  # a --deadline-s stop waits for the capture's end
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class GraphProbe:
    """The probe (module docstring) on a :class:`~sglang_ext.tools.gpu_check_measure.CoreCheck`;
    ``graph``: builds the graph object from the device (default :class:`CudaGraph`, CUDA only);
    ``identity``: also the identity layout's replay, on a batch of its own (:meth:`identity_figures`)."""

    def __init__(self, check: Any, graph: Callable[[str], Any] | None = None, identity: bool = False,
                 runner: bool = False) -> None:
        self.check = check
        self.graph = graph
        self.identity = identity
        self.runner = runner
        """Also the runner's flow (:meth:`runner_run`) after the probe, with the backend it used."""

    def run(self) -> list[Figure]:
        """The probe's figures (N/A with the reason where nothing could be captured)."""
        ch = self.check
        if self.graph is None and not ch.device.startswith("cuda"):
            why = ("CUDA only: there is no graph to capture on the CPU (the tests replay these steps on "
                   "TapeGraph, an emulation: tests/dataplane/test_gpu_check_graph.py)")
            return (self.figures(None, why) + (self.runner_figures(None, why) if self.runner else [])
                    + (self.identity_figures(None, why) if self.identity else []))
        try:
            measured = self.measure()
        except Exception as exc:  # noqa: BLE001 - a probe on hardware nobody ran it on: reported, not failed
            traceback.print_exc()
            figures, measured = self.figures(None, f"the capture or replay raised {type(exc).__name__}: {exc}"), None
        else:
            ch.details["graph_probe"] = measured
            figures = self.figures(measured, "")
        if self.runner:
            figures += self.runner_run(None if measured is None else measured["backend"])
        return figures + (self.identity_run() if self.identity else [])

    def runner_run(self, backend: str | None) -> list[Figure]:
        """SGLang's decode runner's flow on the check's batch, through
        :class:`~sglang_ext.dataplane.decode_graphs.DecodeGraphs`: graphs of two sizes (the
        batch padded by :data:`PADDED_ROWS`, and twice that) captured largest first over a
        padding-only step on the sink (the attention planned for it first, as SGLang's capture
        does), then :data:`RUNNER_STEPS` steps each admitted after its boundary, its inputs
        filled, planned, replayed and compared with its layers run eagerly over the same buffers
        (bit-exact), the last replay's attention and one eager step after them against the dense
        reference."""
        if backend is None:
            return self.runner_figures(None, "the probe's own capture did not complete")
        try:
            m = self._runner(backend)
        except Exception as exc:  # noqa: BLE001 - reported, not failed (as the probe)
            traceback.print_exc()
            return self.runner_figures(None, f"the runner's flow raised {type(exc).__name__}: {exc}")
        self.check.details["graph_runner"] = m
        return self.runner_figures(m, "")

    def _runner(self, backend: str) -> dict[str, Any]:
        from sglang_ext.dataplane.decode_graphs import DecodeGraphs

        ch = self.check
        b, c, device = ch.batch, ch.config, ch.device
        core, real = b.core, len(b.rids)
        sizes = (real + PADDED_ROWS, 2 * (real + PADDED_ROWS))
        graphs = DecodeGraphs(core, sizes, b.batch_pages + sizes[-1])
        buffers = graphs.buffers
        inputs = _padded_inputs((ch.x, ch.q, b.k1, b.v1), sizes[-1])

        def layers(bs: int) -> list[torch.Tensor]:
            return ch.layers(None, backend=backend, plan=False, graph=buffers, padded=tuple(t[:bs] for t in inputs))

        graphs.capture(layers, lambda: (self.graph or CudaGraph)(device),
                       lambda bs: plan_padding_step(ch, backend, buffers))
        sync(device)
        diffs, admitted, static = [], [], []
        for _ in range(RUNNER_STEPS):
            loc = b.begin_decode()
            try:
                size = graphs.admit(slots=loc)
                admitted.append(size)
                if size is None:
                    raise RuntimeError(f"an all-resident step was not admitted: {dict(graphs.eager_reasons)}")
                for dst, src in zip(inputs, (ch.x, ch.q, b.k1, b.v1), strict=True):
                    dst[:real].copy_(src)
                plan_loaded_step(ch, backend, buffers)
                static = [out[:real].clone() for out in graphs.replay(size)]
                sync(device)  # vs the same layers over the same buffers, eagerly (the same token again)
                diffs.append(_max_diff(static, [out[:real] for out in layers(size)]))
            finally:
                core.exit_layer(c.layers - 1)
        # the last replay vs the dense reference: the eager rerun above shares the replay's plan, so
        # only this sees a replay whose attention was not planned for its own step (FlashInfer's)
        dense = ch.dense_errors({"replay": static})["replay"]
        errors = ch.attention_errors()[backend]
        return {"backend": backend, "sizes": list(sizes), "admitted": admitted, "replays": graphs.replays,
                "max_abs_diff": max(diffs), "replay_vs_dense": dense, "attention": errors}

    def runner_figures(self, m: dict[str, Any] | None, why: str) -> list[Figure]:
        """The runner's flow: its replays vs eager (graded 0) and the KV after them (bf16 tolerance)."""
        got = m is not None
        note = why if m is None else (f"{m['backend']} attention, graphs of {m['sizes']} rows captured over a "
                                      f"padding-only step, {m['replays']} steps admitted at {m['admitted']}")
        err = None if m is None else m["attention"]
        dense = None if m is None else m["replay_vs_dense"]
        return [
            Figure.graded("graph.runner.replay_vs_dense_err", "SGLang runner's flow: the last replayed step vs "
                          "dense reference", None if dense is None else dense["max_abs_err"], "abs",
                          None if dense is None else "<=", None if dense is None else dense["tolerance"],
                          "every layer's attention output of the last admitted, planned and replayed step vs "
                          "dense_attention over the regenerated K/V (bf16 tolerance): the replay vs eager check "
                          "reruns the layers under the replay's own plan, this one does not", meaningful=got,
                          note=note),
            Figure.graded("graph.runner.replay_max_abs_diff", "SGLang runner's flow: admitted steps replayed vs "
                          "eager", None if m is None else m["max_abs_diff"], "abs", "<=", 0.0,
                          "DecodeGraphs: graphs per batch size captured over a padding-only step (the sink), each "
                          "step admitted after its boundary, padded, replayed; the batch's rows vs its layers "
                          "run eagerly over the same buffers", meaningful=got, note=note),
            Figure.graded("graph.runner.attention_err", "SGLang runner's flow: attention after the replays vs "
                          "dense reference", None if err is None else err["max_abs_err"], "abs",
                          None if err is None else "<=", None if err is None else err["tolerance"],
                          "one eager step after the replayed ones: every layer's attention vs dense_attention "
                          "over the regenerated K/V (bf16 tolerance)", meaningful=got, note=note),
        ]

    def identity_run(self) -> list[Figure]:
        """The identity layout's replay (every layer of every page on the device: what serves
        while nothing is offloaded; the layers write in place by slot id, padded rows at SGLang's
        padding slot 0) on a batch of at most :data:`IDENTITY_REQUESTS` requests."""
        from sglang_ext.tools.gpu_check_measure import CoreCheck  # it imports this module

        ch = self.check
        config = dataclasses.replace(ch.config, requests=min(ch.config.requests, IDENTITY_REQUESTS))
        try:
            sub = CoreCheck(config, ch.device, ch.backends.primary, identity=True)
            sub.step()
            measured = GraphProbe(sub, self.graph).measure()
        except Exception as exc:  # noqa: BLE001 - reported, not failed (as the paged probe)
            traceback.print_exc()
            return self.identity_figures(None, f"the identity layout's capture or replay raised "
                                               f"{type(exc).__name__}: {exc}")
        ch.details["graph_probe_identity"] = measured
        return self.identity_figures(measured, "")

    def identity_figures(self, m: dict[str, Any] | None, why: str) -> list[Figure]:
        """The three graded agreements of :meth:`figures`, for the identity layout."""
        graded = {f.key: f for f in self.figures(m, why)}
        return [dataclasses.replace(graded[key], key=key.replace("graph.", "graph.identity.", 1),
                                    title=f"identity layout: {graded[key].title}")
                for key in ("graph.replay_max_abs_diff", "graph.buffers_vs_tables_err",
                            "graph.replayed_steps_attention_err")]

    def measure(self) -> dict[str, Any]:
        """Module docstring, 1-3: with FlashInfer's decode first where it is available (what
        serves on CUDA), else -- or where its capture raises, which the result then names --
        with the Triton decode."""
        ch = self.check
        b, c, device = ch.batch, ch.config, ch.device
        core = b.core
        b.place([[1] * c.layers for _ in b.rids])
        core.store.engine.quiesce()
        sync(device)
        return first_that_captures([name for name in BACKENDS if name in ch.backends.available], self._attempt)

    def _attempt(self, backend: str) -> dict[str, Any]:
        """One backend's capture, replays and accuracy (module docstring, 2-3)."""
        ch = self.check
        b, c, device = ch.batch, ch.config, ch.device
        core = b.core
        real = len(b.rids)
        rows = real + PADDED_ROWS
        buffers = GraphStepBuffers(c.layers, rows, b.batch_pages + PADDED_ROWS, device, core.store.sink_page,
                                   c.page_size, mirror=core.store.mirror)
        padded = _padded_inputs((ch.x, ch.q, b.k1, b.v1), rows)
        host_ms: list[float] = []  # kvplane's part of each boundary: prepare_step (+ the buffers' load)
        plan_ms: list[float] = []  # the attention's plan (FlashInfer's; SGLang's own backend plans too)
        eager_step_ms = time_ms(lambda: (ch.step(backend=backend), host_ms.append(b.prepare_cpu_s * 1e3)),
                                device, c.repeat)  # the eager step with the same decode
        host_eager_ms, host_ms = statistics.median(host_ms), []

        def boundary(defer: bool = False) -> torch.Tensor:
            core.defer_tables = defer  # a replayed step's tables need no device half (as served)
            try:
                loc = b.begin_decode()
            finally:
                core.defer_tables = False
            t0 = time.thread_time()
            buffers.load(core.tables, padded_to=rows, slots=loc)
            t1 = time.thread_time()
            plan_loaded_step(ch, backend, buffers)  # one plan a step, outside the graph, from the host CSR
            host_ms.append(b.prepare_cpu_s * 1e3 + (t1 - t0) * 1e3)
            plan_ms.append((time.thread_time() - t1) * 1e3)
            return loc

        loc = boundary()

        def table_layers() -> list[torch.Tensor]:
            return ch.layers(loc, backend=backend, plan=False, end_step=False)

        def graph_layers() -> list[torch.Tensor]:
            return ch.layers(loc, backend=backend, plan=False, graph=buffers, padded=padded)

        # a padded batch may split its KV otherwise than the batch alone (the kernels size their
        # splits from the batch), so the buffers vs the step's own tables agree within bf16
        # tolerance; a replay vs the same layers over the same buffers must agree exactly
        try:
            plan_attention(ch, backend, core.tables.plan_view(b.layer_view(0)))  # each plan fits its batch
            eager = [out.clone() for out in table_layers()]
            eager_layers_ms = time_ms(table_layers, device, c.repeat)
            plan_loaded_step(ch, backend, buffers)
            buffered = [out.clone() for out in graph_layers()]
            buffers_diff = _max_diff([out[:real] for out in buffered], eager)
            graph = (self.graph or CudaGraph)(device)
            buffers.mark_captured()
            static = graph.capture(graph_layers)
            graph.replay()
            sync(device)
            replay_diff = _max_diff([out[:real] for out in static], [out[:real] for out in buffered])
            replay_layers_ms = time_ms(graph.replay, device, c.repeat)
        finally:
            core.exit_layer(c.layers - 1)  # the step ends as every step does
            core.store.engine.quiesce()
            sync(device)

        def replayed_step() -> None:
            boundary(defer=buffers.block is not None)
            graph.replay()
            core.exit_layer(c.layers - 1)

        host_ms = []
        replay_step_ms = time_ms(replayed_step, device, c.repeat)
        loc = boundary()  # a later step replayed, then its layers eagerly over the buffers: the same
        try:  # outputs, or the graph read something the capture's step left behind
            graph.replay()
            sync(device)
            late = [out[:real].clone() for out in static]
            late_diff = _max_diff(late, [out[:real] for out in graph_layers()])
        finally:
            core.exit_layer(c.layers - 1)
        errors = ch.attention_errors()[backend]  # one eager step over every replayed token
        return {"backend": backend, "layers": c.layers, "requests": real, "rows": rows,
                "buffers_max_abs_diff": buffers_diff, "replay_max_abs_diff": replay_diff,
                "late_replay_max_abs_diff": late_diff,
                "layers_eager_ms": eager_layers_ms, "layers_replay_ms": replay_layers_ms,
                "step_eager_ms": eager_step_ms, "step_replay_ms": replay_step_ms, "host_eager_ms": host_eager_ms,
                "host_replay_ms": statistics.median(host_ms), "plan_replay_ms": statistics.median(plan_ms),
                "replayed_attention": errors, "loads": buffers.loads}

    def figures(self, m: dict[str, Any] | None, why: str) -> list[Figure]:
        """Two graded agreements and five figures for the record (module docstring, 4)."""
        got, cuda = m is not None, self.check.device.startswith("cuda")
        note = why if m is None else (f"{m['backend']} attention, {m['layers']} layers, batch {m['requests']} "
                                      f"padded to {m['rows']} rows, "
                                      f"{m['loads']} steps loaded into the buffers" + "".join(
                                          f"; {name}'s capture raised {err}" for name, err in m["backends_failed"].items()))

        def v(key: str) -> float | None:
            return None if m is None else m[key]

        err = None if m is None else m["replayed_attention"]
        agree = None if m is None else max(m["replay_max_abs_diff"], m["late_replay_max_abs_diff"])
        share = None if m is None else m["host_replay_ms"] / m["step_replay_ms"]
        timed = got and cuda

        def ratio(a: str, b: str) -> str:
            return "" if m is None else f"; eager / replay {m[a] / m[b]:.2f}x"

        return [
            Figure.graded(
                "graph.replay_max_abs_diff", "CUDA-graph replay of an all-resident step's layers vs eager", agree,
                "abs", "<=", 0.0, "one step's layers over GraphStepBuffers (padded), eagerly and as one "
                "captured graph replayed, and a later step's replay vs its layers run eagerly over the same "
                "buffers: every layer's attention output, the batch's rows", meaningful=got,
                note=note if m is None else f"replay {m['replay_max_abs_diff']:g}, a later step's replay "
                f"{m['late_replay_max_abs_diff']:g}; {note}"),
            Figure.graded(
                "graph.buffers_vs_tables_err", "the padded buffers vs the step's own tables (eager)",
                None if m is None else m["buffers_max_abs_diff"], "abs", None if err is None else "<=",
                None if err is None else err["tolerance"], "one step's layers eagerly over GraphStepBuffers "
                "padded by a row vs over the step's own tables: every layer's attention output, the batch's "
                "rows (bf16 tolerance: a padded batch may split its KV otherwise)", meaningful=got, note=note),
            Figure.graded(
                "graph.replayed_steps_attention_err", "attention after replayed steps vs dense reference",
                None if err is None else err["max_abs_err"], "abs", None if err is None else "<=",
                None if err is None else err["tolerance"], "steps run as boundary + load + replay, then one "
                "eager step: every layer's attention vs dense_attention over the regenerated K/V (bf16 "
                "tolerance)", meaningful=got, note=note),
            Figure.graded("graph.layers_ms.eager", "all-resident step's layers, eager (kvplane's calls "
                          "included)", v("layers_eager_ms"), "ms", None, None, "median wall time, the "
                          "boundary excluded, device-synchronised", meaningful=timed, note=note),
            Figure.graded("graph.layers_ms.replay", "all-resident step's layers, one CUDA-graph replay",
                          v("layers_replay_ms"), "ms", None, None, "median wall time of a replay, "
                          "device-synchronised" + ratio("layers_eager_ms", "layers_replay_ms"),
                          meaningful=timed, note=note),
            Figure.graded("graph.step_ms.eager", "all-resident decode step, eager", v("step_eager_ms"), "ms",
                          None, None, "median wall time, device-synchronised", meaningful=timed, note=note),
            Figure.graded("graph.step_ms.replay", "all-resident decode step: boundary + load + replay",
                          v("step_replay_ms"), "ms", None, None, "median wall time, device-synchronised"
                          + ratio("step_eager_ms", "step_replay_ms"), meaningful=timed, note=note),
            Figure.graded("graph.kvplane_cpu_share", "kvplane CPU time per replayed step / the step", share,
                          "ratio", None, None, "thread CPU time of the boundary (prepare_decode_step) and the "
                          "buffers' load, medians, over the replayed step's wall time (the attention's plan, "
                          "which SGLang's own backend makes too, apart); a lower bound: the check's new slots "
                          "are a host tensor, so the served boundary's read-back of SGLang's device "
                          "out_cache_loc (its one sync) is not in it", meaningful=timed,
                          note=note if m is None else f"{m['host_replay_ms']:.3f} ms of {m['step_replay_ms']:.3f} "
                          f"ms, plan {m['plan_replay_ms']:.3f} ms (eager step: {m['host_eager_ms']:.3f} ms of "
                          f"{m['step_eager_ms']:.3f}); {note}"),
        ]


def first_that_captures(backends: list[str], attempt: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """``attempt(backend)``'s result for the first of ``backends`` whose attempt does not raise,
    with ``backends_failed``: those that raised before it, and why (the last one's error is the
    caller's: raised). An attempt that raised inside a step's layers leaves that step unfinished:
    the core's next boundary closes it, as it closes a forward SGLang abandoned, but the layers it
    never ran hold no KV for its token, so the next attempt's accuracy figures compare against a
    batch with that gap (the note names the failed attempt). A failed capture leaves none."""
    tried: dict[str, str] = {}
    for backend in backends:
        try:
            result = attempt(backend)
        except Exception as exc:  # noqa: BLE001 - the next backend; the last one's failure is the probe's
            if backend == backends[-1]:
                raise
            traceback.print_exc()
            cause = exc.__context__ or exc  # a capture's own error, not the capture end's that replaced it
            tried[backend] = f"{type(cause).__name__}: {cause}"[:300]
            continue
        return {**result, "backends_failed": tried}
    raise RuntimeError(f"no attention backend a graph probe replays ({', '.join(BACKENDS)}) is available")


def plan_attention(ch: Any, backend: str, view: Any) -> None:
    """FlashInfer's plan for ``view`` (host CSR), outside any graph, as SGLang plans before a
    capture or a replay; the other decodes plan nothing."""
    if backend == "flashinfer":
        ch.backends.plan_step(view, graph=True)


def plan_padding_step(ch: Any, backend: str, buffers: GraphStepBuffers) -> None:
    """:func:`plan_attention` of the padding-only step loaded into ``buffers`` for a capture (its
    CSR read back to the host once: SGLang plans it before capturing)."""
    view = buffers.layer_view(ch.batch.core.store, 0, tuple(ch.batch.rids))
    plan_attention(ch, backend, dataclasses.replace(view, kv_indptr=view.kv_indptr.cpu(),
                                                    last_page_len=view.last_page_len.cpu()))


def plan_loaded_step(ch: Any, backend: str, buffers: GraphStepBuffers) -> None:
    """:func:`plan_attention` of the step loaded into ``buffers`` (padded as they are)."""
    if backend != "flashinfer":  # the others plan nothing
        return
    b = ch.batch
    plan_attention(ch, backend, buffers.plan_view(b.core.tables, buffers.layer_view(b.core.store, 0, tuple(b.rids))))


def _padded_inputs(inputs: tuple[torch.Tensor, ...], rows: int) -> tuple[torch.Tensor, ...]:
    """Each input with rows appended up to ``rows``: large random values (the static buffers of a
    padded replay hold whatever they held), so a padded row that reached a request's KV or output
    would show."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    out = []
    for t in inputs:
        extra = (torch.randn((rows - t.shape[0], *t.shape[1:]), generator=gen) * 100).to(t.device, t.dtype)
        out.append(torch.cat([t, extra]))
    return tuple(out)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))
