"""StepTimelineProbe: where a decode step's time goes on the device, layer by layer.

`kvplane gpu-check` found the data plane's timing events observing 0.05-41 ms of stall per
half-offloaded step while the wall clock says the step waits 217-250 ms on transfers (H100 and
H200 runs, ``benchmarks/results/gpu/``). The events bracket the compute stream's waits on the
fetch events, so either the compute stream does not wait there (its layers run slower instead,
or the host reaches the layers late) or the account misses the waits. One timeline of a step
tells which:

- ``wait_ms[l]``: the compute stream's span across layer ``l``'s ``enter_layer`` (the stream waits
  on its fetches there: the stall as the events should see it);
- ``layer_ms[l]``: the compute stream's span from layer ``l``'s ``enter_layer`` to the next
  layer's (the wait included); ``compute_ms`` = their sum less the waits -- against the
  all-resident step's, it shows compute slowed by copies sharing the SMs;
- ``boundary_ms``: from the step's start to layer 0 (the boundary's uploads);
- ``host_enqueue_ms``: the host's wall time to issue the step (near the step's device time: the
  host, not the device, sets the pace -- a blocking call somewhere);
- ``transfers_done_ms``: when the transfer streams finished the step's copies, from its start;
- ``host_enter_ms[l]``: when the host reached layer ``l``'s ``enter_layer`` (wall clock, from the
  step's start on the host), and ``host_lead_ms[l]``: how far the device trailed it there (the
  device's mark less the host's). A lead near zero (under :data:`HOST_BOUND_MS`) says the device
  had run out of queued work and waited for the host at that layer: the host sets the pace
  there, and every microsecond of host work is step time (``host_bound_layers`` counts them;
  run 20's hidden step issued in 15.4 of its 15.7 ms, which this says layer by layer);
- ``kvplane_host_ms[l]``: the host's wall time inside kvplane's calls of layer ``l`` (enter,
  write, exit), so a host-bound layer's share of kvplane is read off the same step.

Marks are CUDA events on the compute stream (read after the caller's device sync), or
``time.perf_counter()`` on the CPU, where every call is synchronous (the dry run: same code; the
device is the host there, so every layer reads as host-bound). The device's start mark is
recorded after a sync (the caller's), so it runs as the host issues it, give or take the launch
latency, which the leads include.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

HOST_BOUND_MS = 0.05
"""A layer whose device mark trails the host's by less than this waited for the host (launch
latency is ~5-20 us; a device running behind its queue trails by its queued work)."""


class StepTimelineProbe:
    """Marks around each layer's ``enter_layer`` on the compute stream (module docstring); use
    :meth:`begin`, the step with :meth:`scope`, :meth:`end`, a device sync, :meth:`result`."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self._start: Any = None
        self._end: Any = None
        self._enters: list[tuple[Any, Any]] = []
        self._transfers: list[Any] = []
        self._host_s = 0.0
        self._host0 = 0.0
        self._host_enters: list[float] = []
        self._kv_host: dict[int, float] = {}

    def _mark(self, stream: Any = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def _ms(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b)) if self.cuda else (b - a) * 1e3

    def begin(self) -> None:
        """Before the step's boundary."""
        self._enters, self._transfers, self._host_enters, self._kv_host = [], [], [], {}
        self._host0 = time.perf_counter()
        self._start = self._mark()

    @contextmanager
    def scope(self, kind: str, layer: int, part: str = "") -> Iterator[None]:
        if kind != "kvplane":
            yield
            return
        enter = part == "enter"
        t0 = time.perf_counter()
        if enter:
            self._host_enters.append(t0 - self._host0)
            before = self._mark()
            t0 = time.perf_counter()  # kvplane's host time: the marks are the probe's, not kvplane's
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self._kv_host[layer] = self._kv_host.get(layer, 0.0) + (t1 - t0)
            if enter:
                self._enters.append((before, self._mark()))

    def end(self, transfer_streams: Sequence[Any] = ()) -> None:
        """After the step's last layer; ``transfer_streams`` (CUDA) get a mark each, after the copies."""
        self._end = self._mark()
        if self.cuda:
            self._transfers = [self._mark(s) for s in transfer_streams]
        self._host_s = time.perf_counter() - self._host0

    def result(self) -> dict[str, Any]:
        """The step's timeline in ms (module docstring); call after the device is synchronised."""
        if self._start is None or self._end is None or not self._enters:
            raise RuntimeError("StepTimelineProbe.result: no step was recorded (begin, scope, end first)")
        starts = [b for b, _ in self._enters] + [self._end]
        wait = [self._ms(b, a) for b, a in self._enters]
        layer = [self._ms(starts[i], starts[i + 1]) for i in range(len(self._enters))]
        step = self._ms(self._start, self._end)
        host_enter = [t * 1e3 for t in self._host_enters]
        device_enter = [self._ms(self._start, b) for b, _ in self._enters]
        lead = [d - h for d, h in zip(device_enter, host_enter, strict=True)]
        kv_host = [self._kv_host.get(i, 0.0) * 1e3 for i in range(len(self._enters))]
        return {
            "step_ms": step,
            "host_enqueue_ms": self._host_s * 1e3,
            "boundary_ms": self._ms(self._start, starts[0]),
            "wait_ms_total": sum(wait),
            "compute_ms_total": sum(layer) - sum(wait),
            "transfers_done_ms": max((self._ms(self._start, t) for t in self._transfers), default=None),
            "wait_ms": wait,
            "layer_ms": layer,
            "host_enter_ms": host_enter,
            "host_lead_ms": lead,
            "host_bound_layers": sum(x < HOST_BOUND_MS for x in lead),
            "kvplane_host_ms": kv_host,
            "kvplane_host_ms_total": sum(kv_host),
        }

    @staticmethod
    def summary(t: dict[str, Any]) -> str:
        """One line of a :meth:`result`."""
        done = t["transfers_done_ms"]
        line = (f"step {t['step_ms']:.2f} ms = boundary {t['boundary_ms']:.2f} + waits {t['wait_ms_total']:.2f} "
                f"+ layers' compute {t['compute_ms_total']:.2f}; host issued it in {t['host_enqueue_ms']:.2f} ms"
                + ("" if done is None else f"; transfers done at {done:.2f} ms"))
        lead = t.get("host_lead_ms")
        if lead:  # results of before the leads were recorded have none
            line += (f"; the device trailed the host by {lead[0]:.2f} ms at layer 0 and {lead[-1]:.2f} at layer "
                     f"{len(lead) - 1} (waited for the host at {t['host_bound_layers']} of {len(lead)} layers); "
                     f"kvplane's layer calls took {t['kvplane_host_ms_total']:.2f} ms of host time")
        return line
