"""PlacedPhase: `kvplane gpu-check`'s placed phase, on what serves by default.

The planner's half-offloaded placement (the config's ``offload_share``) is installed on the check's
batch and stepped: its median step and the model's prediction (the stall figure: also at the link
the steps' own copies measured, from the timing events of the host-time steps), kvplane's host
time and profile, the launches a step, the stall the engine's timing events saw, one step's
timeline and the host syncs inside layers. It runs on the engine that serves by default: the
copy engines (``--kv-copy-engine dma``) where the transfer check ran them (``check.dma_error`` is
None), the model's bandwidth then their H2D; else the Triton kernels, the fallback.

The copy engines run on hardware nobody ran them on: a fault on them costs the copy engines,
not the phase. It is reported as the check's ``dma_error`` (the ``.dma`` figures' notes say so,
with the traceback on stderr), and the phase runs again on the kernels, planned afresh for the
batch as it is then (the check's headroom counts one more phase: ``GpuCheckConfig.decode_steps``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from controlplane.model import step_time_ms
from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.tools.gpu_check_probes import SyncProbe
from sglang_ext.tools.gpu_check_transfer import CopyEnginePhase, TransferResult

SYNC_STEPS = 2
"""Placed steps run under the sync probe."""


def drivers_of(engine: Any) -> list[Any]:
    """The engine's copy-engine driver bindings (batched, 2-D), each once; none on the kernels."""
    calls = {id(c): c for c in (getattr(engine, "_dma", None), getattr(engine, "_pitched", None)) if c is not None}
    return list(calls.values())  # one object serving both: once


def driver_seconds(drivers: list[Any]) -> float:
    """Wall seconds inside these driver bindings' calls so far. A transfer-bound step's calls block
    once the driver's copy queue is full (gpu-check run 20: ~3 us a 2-D copy with room, ~42 us
    without), and that wait is host time of the step too."""
    return sum(getattr(c, "call_seconds", 0.0) for c in drivers)


class PlacedPhase:
    """The placed phase of :class:`~sglang_ext.tools.gpu_check_measure.CoreCheck` (module docstring)."""

    def __init__(self, check: Any) -> None:
        self.check = check

    def run(self, comp: list[float], transfer: TransferResult) -> SimpleNamespace:
        """The phase's measurements (``on_dma``: on the copy engines)."""
        ch = self.check
        if ch.dma_error is None:
            result = None
            with CopyEnginePhase("the placed phase on the copy engines", ch.batch) as dma:
                if dma.on:
                    result = self._measure(comp, transfer, True)
            ch.dma_error = dma.error
            if dma.on and dma.error is None:
                return result
        return self._measure(comp, transfer, False)

    def _measure(self, comp: list[float], transfer: TransferResult, on_dma: bool) -> SimpleNamespace:
        ch, b, c, device = self.check, self.check.batch, self.check.config, self.check.device
        bw = transfer.served_bw_blocks_per_ms(on_dma)  # the model at the serving engine's H2D
        rows = ch.plan(comp, bw)
        delta = b.place(rows)
        b.core.store.engine.quiesce()
        sync(device)
        blocks_now = b.blocks(1)
        predicted_ms = step_time_ms(rows, blocks_now, comp, bw)
        placed_ms = time_ms(ch.step, device, c.repeat)
        staged_before, launches = b.core.staged_advances, b.core.store.engine.stats
        h2d_before, d2h_before = launches.h2d_launches, launches.d2h_launches
        drivers = drivers_of(b.core.store.engine)  # held: a refusal midway drops the engine's reference
        driver_before = driver_seconds(drivers)
        times = b.core.transfer_times  # the link the steps' own copies measure (its first steps time every copy)
        timed_bytes, timed_s = times.h2d_timed_bytes, times.h2d_timed_s
        placed_cpu_ms = ch.kvplane_cpu_ms()
        link_s, link_bytes = times.h2d_timed_s - timed_s, times.h2d_timed_bytes - timed_bytes
        link_bw = link_bytes / link_s / 1e3 / c.layer_page_bytes if link_s > 0 and link_bytes > 0 else None
        predicted_link_ms = None if link_bw is None else step_time_ms(rows, blocks_now, comp, link_bw)
        placed_cpu_mean_ms = ch.cpu_mean_ms
        placed_advanced = b.core.staged_advances - staged_before
        steps_run = 2 * c.repeat  # kvplane_cpu_ms: the steps timed every step, then the CPU-timed ones
        placed_launches = {"h2d": (launches.h2d_launches - h2d_before) / steps_run,
                           "d2h": (launches.d2h_launches - d2h_before) / steps_run,
                           "driver_ms": (driver_seconds(drivers) - driver_before) * 1e3 / steps_run}
        placed_prepare_ms, placed_parts_ms = ch.prepare_cpu_ms, ch.parts_cpu_ms
        placed_stall_ms = ch.stall_ms
        placed_profile = ch.host_profile()
        placed_timeline = ch.timeline()
        probe = SyncProbe(device)
        with probe:
            for _ in range(SYNC_STEPS):
                ch.step(probe.scope)
        sync(device)
        return SimpleNamespace(
            rows=rows, delta=delta, blocks_now=blocks_now, predicted_ms=predicted_ms, placed_ms=placed_ms,
            predicted_link_ms=predicted_link_ms, link_gbps=None if link_bw is None else link_bw * c.layer_page_bytes / 1e6,
            placed_cpu_ms=placed_cpu_ms, placed_cpu_mean_ms=placed_cpu_mean_ms, placed_advanced=placed_advanced,
            steps_run=steps_run, placed_launches=placed_launches, placed_prepare_ms=placed_prepare_ms,
            placed_parts_ms=placed_parts_ms, placed_stall_ms=placed_stall_ms, placed_profile=placed_profile,
            placed_timeline=placed_timeline, probe=probe, on_dma=on_dma)
