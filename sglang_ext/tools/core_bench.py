"""`kvplane bench core`: the served core's per-step host time against pool size (no model).

Drives :class:`~sglang_ext.dataplane.layered_kv_core.LayeredKVCore` the way SGLang's layered
attention backend does (``sglang_ext/layered_attention.py``): a fixed batch (default 8 requests
x 256 tokens, 4 layers, page 16, fp16, CPU device) decodes one token per request per step --
``prepare_decode_step`` when it applies (steady decode, identity layout), else ``prepare_step``
with every request's slots -- then per layer ``enter_layer`` / ``write`` / ``exit_layer`` (a step
whose layers are idle, as served: the writes and the last ``exit_layer``). Only
the core's calls are timed (the inputs, SGLang's side, are built outside the timer); there is no
attention or MLP, so the figure is the bookkeeping alone.

The pool (``layers x logical_pages`` layer-pages) grows from 10^4 to 10^6 while the batch stays
the same; a core whose bookkeeping is proportional to what changes shows flat rows. Layouts:

- ``identity``: the budget holds every layer-page (all layers in place; the decode fast path);
- ``paged``: budget ``--budget-fraction`` of the layer-pages, every layer wanted on device;
- ``paged-offload``: the same budget, the plan offloads every other layer of every request
  (installed with ``update_residency(..., planned=True)``): staged steps with fetches and
  write-backs.

``--live-requests`` (a comma list; default: the batch alone) keeps more requests live than the
batch: the others arrived (plan + prefill) before it and hold their pages (resident as planned)
without decoding -- requests SGLang keeps waiting or paused-by-plan-free, as far as the core is
concerned. A core whose per-event bookkeeping is proportional to the changed request shows
``finish`` and ``arrival`` flat in the number of live requests too. ``--idle-paused`` has the plan
pause those idle requests (their layers become removable, given up only when space is needed):
with room on the device the batch's steady steps must stay on the cheap path, not reconcile fully
every step (``full reconciles`` in the table).

Per configuration: ``steady`` (a decode step of the unchanged batch; ``boundary``: its
``prepare_decode_step`` / ``prepare_step`` alone, less the wall time of the copies it makes --
its first fetches, and any write-back or moves -- which run synchronously on this CPU device and
as asynchronous launches on a GPU. Approximate: the copies' wall time may include preemption,
and on the CPU engine the fetched pages are worked out on the host, which the GPU's fetch kernel
does on the device), ``finish`` (a request
finishes -- ``release_request`` + ``page_freed`` -- and the next decode step runs without it),
``arrival`` (a new request's plan, ``update_residency``, and its prefill step) and ``join`` (the
first decode step with the newcomer in the batch), plus ``stats`` (one ``core.stats()``, which
SGLang's adapter calls per step when the stats file is on), and with ``--graph-admit`` ``admit``
(the steady step's tables and fetch lists loaded into CUDA-graph buffers with staging: what
``--kv-cuda-graphs on`` adds to a boundary, so that a replayed step's host work is ``boundary``
plus ``admit``). Medians of thread CPU time (torch
runs single-threaded here) and of wall time. Results:
``benchmarks/results/core/core-<machine>.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sglang_ext.dataplane.bench_env import describe_device, write_result
from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_results import RequestResidency
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig

RESULTS_DIR = Path("benchmarks/results/core")
LAYOUTS = ("identity", "paged", "paged-offload")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
PHASES = ("steady", "boundary", "finish", "arrival", "join", "stats", "admit")


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}: expected a comma list of numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name}: values must be >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=8, help="batch size (requests)")
    parser.add_argument("--live-requests", default=None,
                        help="live requests (batch + idle ones holding pages), comma list; default: the batch")
    parser.add_argument("--tokens", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=1, help="small rows: the figure is bookkeeping")
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    parser.add_argument("--pool-sizes", default="1e4,1e5,1e6",
                        help="pool sizes in layer-pages (layers x logical pages), comma list")
    parser.add_argument("--budget-fraction", type=float, default=0.5,
                        help="device budget of the paged layouts, as a share of the layer-pages")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=24, help="steady steps timed per event cycle")
    parser.add_argument("--events", type=int, default=6, help="finish + arrival cycles timed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-paused", action="store_true",
                        help="the idle live requests (beyond the batch) are paused by the plan, as the planner "
                        "parks requests that do not fit: their layers become removable, given up when space is needed")
    parser.add_argument("--paged-reads", action="store_true",
                        help="read as SGLang's paged decode backends do (FlashInfer, Triton: page tables, "
                        "no token tables; steady steps may advance the last tables), not as torch-native")
    parser.add_argument("--graph-admit", action="store_true",
                        help="also time each steady step's admission into CUDA-graph buffers with staging "
                        "(GraphStepBuffers + GraphStaging.load, what --kv-cuda-graphs on adds to a boundary: "
                        "the host work left per replayed step is the boundary plus this); paged layouts, "
                        "with --paged-reads")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR), help="where the JSON and Markdown go")


@dataclasses.dataclass
class _Req:
    rid: str
    slots: list[int]


class CoreRun:
    """One configuration: a core, SGLang's side of it (pages, slots), timed steps."""

    def __init__(self, args: argparse.Namespace, pool: int, layout: str, live: int | None = None) -> None:
        self.args = args
        self.layout = layout
        self.live = args.requests if live is None else live
        L, ps = args.layers, args.page_size
        self.logical = max(2, pool // L)
        budget = self.logical * L if layout == "identity" else max(1, int(args.budget_fraction * self.logical * L))
        self.core = LayeredKVCore(SlotStoreConfig(
            layers=L, page_size=ps, kv_heads=args.kv_heads, head_dim=args.head_dim,
            logical_pages=self.logical, device_pages=budget, dtype=DTYPES[args.dtype], device="cpu",
        ))
        if args.paged_reads:  # as the layered FlashInfer / Triton backends set the core up
            self.core.paged_reads, self.core.token_tables = True, False
        self.gpu_layers = tuple(layout != "paged-offload" or layer % 2 == 0 for layer in range(L))
        rng = np.random.default_rng(args.seed)
        self.free = list(rng.permutation(np.arange(1, self.logical)).tolist())  # page 0: padding
        self.reqs: list[_Req] = []
        self.idle: list[_Req] = []
        """Live requests outside the batch (``--live-requests``), paused with ``--idle-paused``."""
        self.last_lens: list[int] | None = None
        self.next_id = 0
        self.samples: dict[str, list[tuple[float, float]]] = {p: [] for p in PHASES}
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graph: Any = None
        """Graph buffers with staging the steady steps are admitted into (``--graph-admit``)."""
        if getattr(args, "graph_admit", False) and layout != "identity" and args.paged_reads:
            from sglang_ext.dataplane.graph_staging import GraphStaging
            from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers

            rows, cols = args.requests, self.logical + args.requests
            self.graph = GraphStepBuffers(L, rows, cols, "cpu", None, ps, GraphStaging(self.core.store, rows, cols))

    # ----- SGLang's side (untimed) ---------------------------------------------------------

    def _grow(self, req: _Req, n: int) -> list[int]:
        ps, out = self.args.page_size, []
        for _ in range(n):
            if req.slots and (req.slots[-1] + 1) % ps:
                slot = req.slots[-1] + 1
            else:
                if not self.free:
                    raise SystemExit(f"pool of {self.logical} pages too small for the batch")
                slot = self.free.pop() * ps
            req.slots.append(slot)
            out.append(slot)
        return out

    def _kv_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n not in self._kv:
            a = self.args
            k = torch.zeros((n, a.kv_heads, a.head_dim), dtype=DTYPES[a.dtype])
            self._kv[n] = (k, k.clone())
        return self._kv[n]

    def _want(self, req: _Req) -> RequestResidency:
        pages = tuple(dict.fromkeys(s // self.args.page_size for s in req.slots))
        return RequestResidency(pages=pages, gpu_layers=self.gpu_layers, planned=True)

    # ----- timed core calls ----------------------------------------------------------------

    def _layers(self, loc: torch.Tensor) -> None:
        core = self.core
        k, v = self._kv_rows(int(loc.numel()))
        idle, last = core.layers_idle, core.layers - 1  # as served: an idle step skips enter / exit (but the last)
        for layer in range(core.layers):
            if not idle:
                core.enter_layer(layer)
            core.write(layer, loc, k, v)
            if not idle or layer == last:
                core.exit_layer(layer)

    def _timed(self, phase: str | None, fn: Callable[[], Any]) -> None:
        c0, w0 = time.thread_time(), time.perf_counter()
        fn()
        c1, w1 = time.thread_time(), time.perf_counter()
        if phase is not None:
            self.samples[phase].append(((c1 - c0) * 1e3, (w1 - w0) * 1e3))

    def decode(self, phase: str | None) -> None:
        """One decode step of the batch (SGLang's fast-path test, then the general path)."""
        new = [self._grow(r, 1)[0] for r in self.reqs]
        lens = [len(r.slots) for r in self.reqs]
        rids = [r.rid for r in self.reqs]
        loc = torch.tensor(new, dtype=torch.int64)
        steady = self.last_lens is not None and len(self.last_lens) == len(lens) and all(
            n == p + 1 for n, p in zip(lens, self.last_lens, strict=True))
        requests = [(r.rid, torch.tensor(r.slots, dtype=torch.int64)) for r in self.reqs]

        def prepare() -> None:
            if not (steady and self.core.prepare_decode_step(rids, lens, loc)):
                self.core.prepare_step(requests, loc)

        times = self.core.transfer_times  # the CPU engine's copies, timed as they run
        copies0 = times.h2d_s + times.d2h_s
        c0, w0 = time.thread_time(), time.perf_counter()
        prepare()
        c1, w1 = time.thread_time(), time.perf_counter()
        copies = (times.h2d_s + times.d2h_s - copies0) * 1e3
        tables = None if self.core.overflow else self.core.tables  # the step's (released with it)
        self._layers(loc)
        c2, w2 = time.thread_time(), time.perf_counter()
        if phase is not None:
            self.samples[phase].append(((c2 - c0) * 1e3, (w2 - w0) * 1e3))
        if phase == "steady":  # the boundary's host work, approximately: without the copies it
            # made (synchronous on this CPU device, asynchronous on a GPU; module docstring)
            self.samples["boundary"].append((max(0.0, (c1 - c0) * 1e3 - copies), max(0.0, (w1 - w0) * 1e3 - copies)))
            if self.graph is not None and self.graph.why_not(tables, len(new)) is None:
                # timed after the step, apart from it: the buffers' loads of the step's tables
                self._timed("admit", lambda: self.graph.load(tables, padded_to=len(new)))
        self.last_lens = lens

    def arrive(self, phase: str | None, *, idle: bool = False) -> None:
        """A new request: its plan, then its prefill step (alone, as SGLang runs a prefill);
        ``idle``: it stays live outside the decode batch."""
        req = _Req(f"r{self.next_id}", [])
        self.next_id += 1
        new = self._grow(req, self.args.tokens)
        loc = torch.tensor(new, dtype=torch.int64)
        want = {req.rid: self._want(req)}
        requests = [(req.rid, torch.tensor(req.slots, dtype=torch.int64))]

        def step() -> None:
            self.core.update_residency(want)
            self.core.prepare_step(requests, loc)
            self._layers(loc)

        self._timed(phase, step)
        (self.idle if idle else self.reqs).append(req)
        self.last_lens = None  # the batch changed: the next decode step is not steady

    def finish(self, phase: str | None) -> None:
        """The oldest request finishes (its pages go back to SGLang), then a decode step."""
        req = self.reqs.pop(0)
        ps = self.args.page_size
        pages = sorted({s // ps for s in req.slots})
        self.last_lens = None
        self.free.extend(pages)
        new = [self._grow(r, 1)[0] for r in self.reqs]
        loc = torch.tensor(new, dtype=torch.int64)
        requests = [(r.rid, torch.tensor(r.slots, dtype=torch.int64)) for r in self.reqs]

        def step() -> None:
            self.core.release_request(req.rid)
            self.core.page_freed(pages)
            self.core.prepare_step(requests, loc)
            self._layers(loc)

        self._timed(phase, step)
        self.last_lens = [len(r.slots) for r in self.reqs]

    def run(self) -> dict[str, Any]:
        a = self.args
        for _ in range(self.live - a.requests):
            self.arrive(None, idle=True)
        for _ in range(a.requests):
            self.arrive(None)
        if getattr(a, "idle_paused", False) and self.idle:  # the plan parks them (untimed)
            self.core.update_residency({r.rid: dataclasses.replace(self._want(r), paused=True) for r in self.idle})
        for _ in range(3):
            self.decode(None)
        for _ in range(a.events):
            for _ in range(a.steps):
                self.decode("steady")
            self._timed("stats", self.core.stats)
            self.finish("finish")
            self.arrive("arrival")
            self.decode("join")
        stats = self.core.stats()
        row: dict[str, Any] = {
            "layout": self.layout,
            "live_requests": self.live,
            "idle_paused": bool(getattr(a, "idle_paused", False)) and bool(self.idle),
            "pool_layer_pages": self.logical * a.layers,
            "logical_pages": self.logical,
            "device_pages": self.core.config.device_pages if not self.core.store.identity
            else self.logical * a.layers,
            "full_reconciles": self.core.residency.full_reconciles,
            "overflow_steps": stats.overflow_steps_total,
            "staged_steps": stats.staged_steps_total,
            "host_fraction": stats.host_fraction,
            "advanced_steps": stats.advanced_decode_steps_total + stats.opened_advances_total
            + stats.staged_advances_total,
        }
        for phase, samples in self.samples.items():
            row[f"{phase}_cpu_ms"] = statistics.median(s[0] for s in samples) if samples else None
            row[f"{phase}_wall_ms"] = statistics.median(s[1] for s in samples) if samples else None
        row["admitted_steps"] = len(self.samples["admit"])
        return row


def _markdown(where: str, args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    head = (
        "# kvplane bench core\n\n"
        f"Machine: {where}\n\n"
        f"Batch: {args.requests} requests x {args.tokens} tokens, {args.layers} layers, page "
        f"{args.page_size}, {args.dtype}, {args.kv_heads} KV head(s) x {args.head_dim} dims, CPU device "
        f"(no model: the core's calls only), read {'through page tables (paged decode backends)' if args.paged_reads else 'through token tables (torch-native)'}. Paged layouts: budget {args.budget_fraction:g} of the "
        "layer-pages; `paged-offload` offloads every other layer. Live requests: the batch plus idle "
        "ones (planned, prefilled, holding their pages, not decoding"
        f"{'; paused by the plan: their layers removable' if getattr(args, 'idle_paused', False) else ''}). Median thread CPU time per step, ms "
        f"({args.steps} x {args.events} steady steps, {args.events} of each event); wall medians in the JSON.\n\n"
        "| layout | live requests | pool layer-pages | steady | its boundary | finish + step | arrival (plan + prefill) "
        "| join step | stats() | full reconciles | graph admission |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {r['layout']} | {r['live_requests']} | {r['pool_layer_pages']:,} | {r['steady_cpu_ms']:.3f} | "
        f"{r['boundary_cpu_ms']:.3f} | {r['finish_cpu_ms']:.3f} | "
        f"{r['arrival_cpu_ms']:.3f} | {r['join_cpu_ms']:.3f} | {r['stats_cpu_ms']:.3f} | {r['full_reconciles']} | "
        f"{_ms(r['admit_cpu_ms'])} |\n"
        for r in rows
    )
    return head + body


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def run(args: argparse.Namespace) -> int:
    try:
        layouts, pools, lives = _checked(args)
    except ValueError as exc:  # a bad option: one line, exit 2
        print(f"kvplane bench core: {exc}", file=sys.stderr)
        return 2
    return _run(args, layouts, pools, lives)


def _checked(args: argparse.Namespace) -> tuple[list[str], list[int], list[int]]:
    """(layouts, pool sizes, live request counts) from the options; ValueError naming a bad one."""
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        raise ValueError(f"--layouts: unknown {bad or layouts!r}; choose from {', '.join(LAYOUTS)}")
    if not 0 < args.budget_fraction < 1:
        raise ValueError(f"--budget-fraction must be in (0, 1), got {args.budget_fraction}")
    for name in ("requests", "tokens", "layers", "page_size", "kv_heads", "head_dim", "steps", "events"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    pools = _ints(args.pool_sizes, "pool-sizes")
    lives = [args.requests] if args.live_requests is None else _ints(args.live_requests, "live-requests")
    if min(lives) < args.requests:
        raise ValueError(f"--live-requests: each value must be >= --requests ({args.requests}), got {lives}")
    return layouts, pools, lives


def _run(args: argparse.Namespace, layouts: list[str], pools: list[int], lives: list[int]) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        where = f"{describe_device('cpu').rsplit(' (', 1)[0]}, {os.cpu_count()} cores"
        print(f"kvplane bench core on {where} ({args.requests} requests x {args.tokens} tokens, "
              f"{args.layers} layers, page {args.page_size}; median thread CPU ms per step)")
        print(f"{'layout':>14} {'live':>5} {'layer-pages':>12} {'steady':>8} {'bound.':>8} {'finish':>8} {'arrival':>8} "
              f"{'join':>8} {'stats':>8} {'full':>5} {'admit':>8}")
        rows = []
        for layout in layouts:
            for pool, live in ((pool, live) for live in lives for pool in pools):
                r = CoreRun(args, pool, layout, live).run()
                rows.append(r)
                print(f"{layout:>14} {live:>5} {r['pool_layer_pages']:>12,} {r['steady_cpu_ms']:>8.3f} "
                      f"{r['boundary_cpu_ms']:>8.3f} {r['finish_cpu_ms']:>8.3f} {r['arrival_cpu_ms']:>8.3f} {r['join_cpu_ms']:>8.3f} "
                      f"{r['stats_cpu_ms']:>8.3f} {r['full_reconciles']:>5} {_ms(r['admit_cpu_ms']):>8}")
    finally:
        torch.set_num_threads(threads)
    params = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    path = write_result(args.out_dir, "core", where, {
        "figure": "LayeredKVCore host time per step vs pool size (no model; CPU device)",
        "device": "cpu", "timer": "median thread CPU time (torch single-threaded) and wall time",
        "params": params, "rows": rows,
    })
    path.with_suffix(".md").write_text(_markdown(where, args, rows))
    print(f"result: {path} (+ .md)")
    json.loads(path.read_text())  # written whole
    return 0
