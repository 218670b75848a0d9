"""`kvplane gpu-check`'s figures for the data plane's own transfer timing, the numbers that
``kvplane:h2d_seconds_total``, ``kvplane:d2h_seconds_total`` and ``kvplane:stall_seconds`` report
when serving.

On CUDA they come from the engine's :class:`~sglang_ext.dataplane.event_clock.EventClock`:
event pairs around each batched copy and each compute-stream wait, harvested without a sync.

- ``transfer_events.h2d_gbps`` / ``transfer_events.d2h_gbps``: bytes over the seconds the account
  booked for :class:`~sglang_ext.tools.gpu_check_transfer.TransferCheck`'s H2D and D2H loops. At
  least :data:`MIN_GBPS` proves that the seconds are booked and are not inflated.
- ``transfer_events.h2d_vs_wall_rel_err``: those GB/s against the same loop timed by wall clock
  around a device sync. Each launch moves hundreds of MiB at the GPU shapes, so the two agree when
  the pair brackets the copy itself. A pair recorded before the stream's waits, or after the
  copy, would make them differ.
- ``transfer_events.stall_ms_per_step``: the median of the per-step stall observations over the
  placed steps (each closed after its sync, as the served path closes a step after SGLang's
  result processing). It is at most the placed step. Every step must be observed exactly once,
  otherwise the value is missing (FAIL).
- ``transfer_events.stall_vs_wall_rel_err``: that stall against the wall clock's (placed step -
  all-resident step), ``|events / wall - 1|``. The metric is what an operator reads to know how
  much the transfers cost; until session 23 the only bound was "at most the step", which the
  H100 / H200 runs met with 0.05-41 ms of observed stall against 217-250 ms on the wall clock.
  The note carries the placed step's timeline
  (:class:`~sglang_ext.tools.step_timeline_probe.StepTimelineProbe`): where the step's time went.
  N/A when the wall-clock stall is under :data:`STALL_FLOOR_SHARE` of the resident step.

On the CPU the same account is fed by wall-clock timing of the synchronous copies: the values
are reported, N/A.
"""

from __future__ import annotations

import statistics
from typing import Any

from sglang_ext.tools.gpu_check_report import Figure
from sglang_ext.tools.gpu_check_transfer import TransferResult
from sglang_ext.tools.step_timeline_probe import StepTimelineProbe

MIN_GBPS = 1.0
"""A host link slower than this is not a GPU's (H100 PCIe 5: ~50 GB/s one way)."""
EVENT_VS_WALL = 0.25
"""|event GB/s / wall GB/s - 1| at most this; also |event stall / wall-clock stall - 1|."""
STALL_FLOOR_SHARE = 0.05
"""Below this share of the resident step the wall-clock stall is noise: no ratio is graded."""


def event_timing_figures(t: TransferResult, *, placed_stall_ms: list[float], resident_stall_ms: list[float],
                         steps: int, placed_ms: float, wall_stall_ms: float, cuda: bool,
                         details: dict[str, Any]) -> list[Figure]:
    """The five figures (module docstring). ``placed_stall_ms`` / ``resident_stall_ms``: the stall
    observations (ms) of ``steps`` placed / resident steps. Adds its numbers to ``details``."""
    cpu_note = "" if cuda else "CPU: the account is fed by wall-timed synchronous copies; not a GPU's figure"
    rel = (abs(t.h2d_event_gbps / t.h2d_gbps - 1.0)
           if t.h2d_event_gbps is not None and t.h2d_gbps > 0 else None)
    complete = len(placed_stall_ms) == steps
    stall = statistics.median(placed_stall_ms) if complete and placed_stall_ms else None
    resident = statistics.median(resident_stall_ms) if resident_stall_ms else None
    details["transfer_events"] = {
        "h2d_gbps": t.h2d_event_gbps, "d2h_gbps": t.d2h_event_gbps, "h2d_wall_gbps": t.h2d_gbps,
        "d2h_wall_gbps": t.d2h_gbps, "h2d_vs_wall_rel_err": rel, "steps": steps,
        "placed_stall_ms": placed_stall_ms, "resident_stall_ms": resident_stall_ms,
        "wall_stall_ms": wall_stall_ms,
    }
    how = ("the engine's timing account (CUDA-event pairs on the transfer stream, harvested with "
           "query() after the loop's sync): bytes launched / seconds booked, TransferCheck's loop")

    def gbps_note(event: float | None, wall: float) -> str:
        shown = "none booked" if event is None else f"{event:.1f} GB/s from events"
        return cpu_note or f"{shown} vs {wall:.1f} GB/s wall clock; plausible 1-100 GB/s"

    resident_ms = placed_ms - wall_stall_ms
    stall_rel = (abs(stall / wall_stall_ms - 1.0)
                 if stall is not None and wall_stall_ms >= STALL_FLOOR_SHARE * resident_ms > 0 else None)
    stall_why = cpu_note or (
        "" if stall_rel is not None
        else "the events observed no complete stall per step: not graded (the figure above fails)" if stall is None
        else f"wall-clock stall under {STALL_FLOOR_SHARE:.0%} of the resident step: not graded")
    timeline = details.get("step_timeline", {})
    placed_timeline = timeline.get("placed")
    timeline_note = ("" if placed_timeline is None else
                     f"placed {StepTimelineProbe.summary(placed_timeline)}"
                     + ("" if "resident" not in timeline else
                        f"; resident {StepTimelineProbe.summary(timeline['resident'])}"))
    return [
        Figure.graded("transfer_events.h2d_gbps", "H2D GB/s from the data plane's timing events",
                      t.h2d_event_gbps, "GB/s", ">=", MIN_GBPS, how, meaningful=cuda,
                      note=gbps_note(t.h2d_event_gbps, t.h2d_gbps)),
        Figure.graded("transfer_events.d2h_gbps", "D2H GB/s from the data plane's timing events",
                      t.d2h_event_gbps, "GB/s", ">=", MIN_GBPS, how, meaningful=cuda,
                      note=gbps_note(t.d2h_event_gbps, t.d2h_gbps)),
        Figure.graded("transfer_events.h2d_vs_wall_rel_err", "H2D GB/s from events vs wall clock", rel, "ratio",
                      "<=", EVENT_VS_WALL, "|event GB/s / wall-clock GB/s - 1| over the same engine.h2d launches",
                      meaningful=cuda, note=cpu_note),
        Figure.graded("transfer_events.stall_ms_per_step", "stall per placed step from the timing events",
                      stall, "ms", "<=", placed_ms,
                      "median of close_transfer_step()'s observations (compute-stream waits on fetch and fence "
                      "events, event pairs) over placed steps, each closed after its sync; <= the placed step",
                      meaningful=cuda,
                      note=cpu_note or (
                          f"{len(placed_stall_ms)} observations for {steps} steps; resident steps "
                          + ("none" if resident is None else f"{resident:.3f} ms")
                          + f"; wall-clock stall (placed - resident) {wall_stall_ms:.3f} ms")),
        Figure.graded("transfer_events.stall_vs_wall_rel_err", "stall from the timing events vs the wall clock's",
                      stall_rel, "ratio", "<=", EVENT_VS_WALL,
                      "|median events stall per placed step / (placed step - all-resident step) - 1|; the note "
                      "lays out one placed step on the compute stream (StepTimelineProbe)",
                      meaningful=cuda and stall_rel is not None,
                      note="; ".join(n for n in (stall_why, timeline_note) if n)),
    ]
