"""TurnoverCheck: `kvplane gpu-check`'s batch-change phase (run last, on the check's batch).

SGLang's decode batch changes whenever a request finishes or a prefilled one joins. The decode
step after such a change used to go through the general boundary: the served adapter read every
request's slots back from the device (``req_to_token[rows, :max_len]``, one device-to-host copy
and a host sync) and ``prepare_step`` observed every request and rebuilt the page lists. Now the
core continues what each request held (:class:`~sglang_ext.dataplane.decode_continuity.
DecodeContinuity`): ``prepare_decode_step`` takes the step. This phase times both on the served
core at the check's shapes, with every request resident:

each round, the batch's first request finishes (its release and its pages' free, as SGLang's end
of step) and a new one joins on the same pages (a prefill of ``context_min`` tokens through the
core), then the next decode step's boundary is timed -- thread CPU of the adapter's slot read
(general path only: from a device ``req_to_token`` copy of the batch's slots, as SGLang keeps
it) plus the core's boundary -- alternating the two paths round by round; then a steady step.

- ``turnover.boundary_ms``: median host time of the decode boundary after a change (continued);
- ``turnover.general_boundary_ms``: the same through the general path (slot read + ``prepare_step``);
- ``turnover.vs_general``: their ratio (target <= 1: continuing must cost less than what it replaced);
- ``turnover.vs_steady``: the continued boundary over the steady (same batch) one's, no target;
- ``turnover.attention_max_abs_err``: after one more change, the next step's attention at every
  layer, every backend, vs the dense reference over the KV each request holds (the joiners'
  prefills included): the continued boundary's tables read what the pool holds (bf16 tolerance;
  infinite when that step did not take the continued boundary).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sglang_ext.dataplane.bench_env import sync
from sglang_ext.tools.gpu_check_report import Figure

if TYPE_CHECKING:
    from sglang_ext.tools.gpu_check_measure import CoreCheck

ROUNDS = 8
"""Batch changes timed (half through each path)."""
STEPS_PER_ROUND = 2
"""Decode steps each round runs (the one after the change, one steady): the batch's headroom."""
CHECKED_STEPS = 1
"""Decode steps after the rounds: the one checked against the reference."""


class TurnoverCheck:
    """The batch-change phase (module docstring); mutates the check's batch: run it last."""

    def __init__(self, check: CoreCheck) -> None:
        self.check = check
        self.details: dict[str, Any] = {}

    def _finish_and_join(self, r: int) -> None:
        """The batch's first request finishes; a new one joins on its pages, prefilled with the
        KV the reference regenerates (:meth:`CheckBatch.replace_first`)."""
        b, core, c = self.check.batch, self.check.batch.core, self.check.config
        rid, tokens = f"join{r}", c.context_min
        gone, pages = b.replace_first(rid, tokens)
        core.release_request(gone)
        core.page_freed(pages)
        loc = torch.from_numpy(b.slots[-1][:tokens].copy())
        core.prepare_step([(rid, loc.clone())], loc)
        for layer in range(c.layers):
            k, v = b.prefill_kv(len(b.rids) - 1, layer)
            core.enter_layer(layer)
            core.write(layer, loc, k, v)
            core.exit_layer(layer)

    def _timed_boundary(self, general: bool) -> tuple[float, torch.Tensor]:
        """The decode step after a change: its boundary's host ms and its new slots."""
        b, core = self.check.batch, self.check.batch.core
        width = max(b.lens) + 1
        table = np.zeros((len(b.rids), width), dtype=np.int32)
        for i, slots in enumerate(b.slots):
            table[i, : b.lens[i] + 1] = slots[: b.lens[i] + 1]
        req_to_token = torch.from_numpy(table).to(b.device)  # SGLang's device table (not timed)
        new = []
        for i in range(len(b.rids)):
            new.append(int(b.slots[i][b.lens[i]]))
            b.lens[i] += 1
        loc = torch.tensor(new, dtype=torch.int64)
        sync(b.device)
        t0 = time.thread_time()
        if general or not core.prepare_decode_step(b.rids, b.lens, loc):
            # the served adapter's general read (layered_attention._request_slots): the batch's
            # rows in one device-to-host copy, then a fresh CPU tensor per request
            rows = torch.tensor(list(range(len(b.rids))), dtype=torch.int64).to(b.device, non_blocking=True)
            host = req_to_token[rows, : max(b.lens)].cpu().numpy()
            requests = [(rid, torch.from_numpy(host[i, : b.lens[i]].astype(np.int64)))
                        for i, rid in enumerate(b.rids)]
            core.prepare_step(requests, loc)
            took = False
        else:
            took = True
        ms = (time.thread_time() - t0) * 1e3
        if took == general:
            raise RuntimeError(f"TurnoverCheck: the {'general' if general else 'continued'} step took the other path")
        return ms, loc

    def run(self) -> list[Figure]:
        """The phase's figures. On a GPU the graph probes before it leave the core deferring its
        tables' device half and its step-start fetches (``DecodeGraphs``, ``GraphStaging``): an
        eager boundary's upload and gather would then run at the first layer, outside the timed
        boundary, while the CPU dry run (no graphs) times them. Both are off for the phase, as
        at the baseline's measurement, and restored after (static review, session 77)."""
        core = self.check.batch.core
        deferred = (core.defer_tables, core.pipeline.defer_start)
        core.defer_tables = core.pipeline.defer_start = False
        try:
            return self._run()
        finally:
            core.defer_tables, core.pipeline.defer_start = deferred

    def _run(self) -> list[Figure]:
        check = self.check
        b, core, c = check.batch, check.batch.core, check.config
        b.place([[1] * c.layers] * len(b.rids))
        check.step()
        times: dict[str, list[float]] = {"continued": [], "general": []}
        steady: list[float] = []
        turnovers = core.continuity.turnovers
        for r in range(ROUNDS):
            self._finish_and_join(r)
            general = r % 2 == 1
            ms, loc = self._timed_boundary(general)
            times["general" if general else "continued"].append(ms)
            check.layers(loc)
            check.step()  # the new batch's steady step
            steady.append(b.prepare_cpu_s * 1e3)
        # one more change, and the step after it checked: every layer's attention over the tables the
        # continued boundary built vs the dense reference over every request's regenerated KV
        self._finish_and_join(ROUNDS)
        taken = core.paged_decode_steps
        errors = check.attention_errors()
        continued = core.paged_decode_steps == taken + 1
        worst = max(errors.items(), key=lambda kv: kv[1]["max_abs_err"] / kv[1]["tolerance"])
        sync(b.device)
        cont, gen = statistics.median(times["continued"]), statistics.median(times["general"])
        cuda = str(b.device).startswith("cuda")
        steady_ms = statistics.median(steady)
        self.details = {"rounds": ROUNDS, "times_ms": times, "steady_ms": steady,
                        "turnovers": core.continuity.turnovers - turnovers, "join_tokens": c.context_min,
                        "checked_step_continued": continued, "attention_errors": errors}
        how = (f"median thread CPU of the decode boundary after a finish + a join ({ROUNDS // 2} rounds each, "
               "alternating), every request resident")
        return [
            Figure.graded("turnover.boundary_ms", "decode boundary after a batch change (continued)", cont, "ms",
                          None, None, how + "; prepare_decode_step (DecodeContinuity)",
                          note="no target of its own: turnover.vs_general grades it"),
            Figure.graded("turnover.general_boundary_ms", "decode boundary after a batch change (general path)", gen,
                          "ms", None, None, how + "; the adapter's slot read from the device + prepare_step",
                          note="the path a batch change took before session 37"),
            Figure.graded("turnover.vs_general", "continued vs general boundary after a batch change", cont / gen,
                          "ratio", "<=", 1.0, "turnover.boundary_ms / turnover.general_boundary_ms",
                          meaningful=cuda, note=("" if cuda else "CPU: the host's timing, not graded; ")
                          + f"{cont:.3f} vs {gen:.3f} ms"),
            Figure.graded("turnover.vs_steady", "continued boundary vs a steady step's", cont / steady_ms, "ratio",
                          None, None, "turnover.boundary_ms / the median boundary of the steady steps after",
                          note=f"steady {steady_ms:.3f} ms (advanced tables); no target"),
            Figure.graded("turnover.attention_max_abs_err", "layered attention after a batch change vs dense reference",
                          worst[1]["max_abs_err"] if continued else math.inf, "abs", "<=", worst[1]["tolerance"],
                          "the decode step after one more finish + join (continued boundary), every layer, every "
                          "attention backend: paged decode over the step's tables vs dense_attention in fp32 over "
                          "each request's regenerated K/V; bf16 tolerance",
                          note=(f"worst backend {worst[0]}; relative L2 error {worst[1]['rel_l2_err']:.2e}"
                                if continued else "the checked step did not take the continued boundary")),
        ]
