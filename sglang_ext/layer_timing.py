"""Sampled per-layer decode timing for the control plane's profile (OrbitFlow §3.4 profile refresh).

Every ``every``-th decode step the layered attention backend marks the entry of each layer's
attention (:meth:`LayerTimer.mark`), and again once the layer's fetches have arrived
(:meth:`LayerTimer.ready`, after the compute stream's wait on them), and the scheduler hook
marks the end of the forward (:meth:`LayerTimer.end`). Layer ``l``'s time is from its ready
mark (its entry mark when it waited on nothing) to the next layer's entry; the last layer's runs
to the end of ``run_batch`` and so also carries the LM head and sampling. The wait is left out:
the placement model's ``comp[l]`` is the layer's compute, and the timeline adds the stalls
itself (a sample that carried them would have the controller count them twice, and fit the
bandwidth as if transfers cost nothing). What the wait took is kept per layer
(:attr:`LayerTimer.last_stall_ms`). On CUDA
the marks are ``torch.cuda.Event`` records (no sync inside the step; read after
``process_batch_result`` has synchronised), on CPU ``time.perf_counter``. The result goes out as
``StepReport.layer_compute_ms``; steps that were not sampled report None.

A replayed CUDA graph (``--kv-cuda-graphs on``) runs no Python: its marks are events the graph
records itself (:class:`~sglang_ext.dataplane.graph_layer_marks.GraphLayerMarks`), handed over by
:meth:`LayerTimer.replayed` for every replay. Those events are recorded again by the next replay
of the same graph, so a sample a later replay overwrote before :meth:`LayerTimer.take` read it
(SGLang's overlap loop launches step k+1 before processing step k) is dropped, not misread.

Each forward's marks are queued at :meth:`LayerTimer.end` and :meth:`LayerTimer.take` returns the
oldest: one ``end`` per ``run_batch`` and one ``take`` per ``process_batch_result``, in the same
order. Without SGLang's overlap loop the queue holds one entry at most; with it, step k's results
are processed after step k+1 was launched, and ``take`` still returns step k's marks (whose events
that processing has waited for), not step k+1's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

DEFAULT_EVERY = 16
"""Sample one decode step in this many."""
MAX_IN_FLIGHT = 4
"""Ended forwards kept for :meth:`LayerTimer.take` (SGLang's overlap loop has one in flight)."""


class LayerTimer:
    """Per-layer marks of one sampled decode step."""

    def __init__(self, layers: int, device: str | torch.device = "cpu", every: int = DEFAULT_EVERY,
                 event: Callable[[], Any] | None = None, eager_samples: bool = False) -> None:
        if layers < 1 or every < 1:
            raise ValueError(f"LayerTimer needs layers >= 1 and every >= 1, got {layers}, {every}")
        self.layers = layers
        self.every = every
        self.cuda = torch.device(device).type == "cuda"
        self._event = event or (_cuda_event if self.cuda else None)
        """Makes a timing event (``record(stream)``, ``synchronize()``, ``elapsed_time(other)``);
        None: marks are ``time.perf_counter`` readings (the CPU)."""
        self.eager_samples = eager_samples
        """A sampled step must run eagerly, not replay a graph (:attr:`wants_eager`): SGLang's
        overlap loop replays step k+1 -- the same graph, a steady batch -- before step k's sample
        is read, so a replayed sample would be overwritten and dropped every time."""
        self._decode_steps = 0
        self._armed = False
        self._marks: dict[int, Any] = {}
        self._ready: dict[int, Any] = {}
        self._done: deque[tuple[dict[int, Any], dict[int, Any], Any, tuple[int, int] | None] | None] = deque(
            maxlen=MAX_IN_FLIGHT)
        """Ended forwards not yet taken, oldest first (None: not sampled); the last item tags a
        replayed step's graph marks (their set, its replay count then)."""
        self._graph: tuple[int, int] | None = None
        """This forward's graph marks (a replay's), as :attr:`_done` tags them."""
        self._replays: dict[int, int] = {}
        """Replays so far per set of graph marks (by identity)."""
        self.samples = 0
        """Steps whose per-layer times were reported."""
        self.last_stall_ms: tuple[float, ...] = ()
        """Per layer, the wait on its fetches in the last sample taken (entry to ready)."""

    def begin(self, is_decode: bool) -> None:
        """Start of ``run_batch``: arm on every ``every``-th decode step."""
        self._marks = {}
        self._ready = {}
        self._armed = False
        self._graph = None
        if is_decode:
            self._armed = self._decode_steps % self.every == 0
            self._decode_steps += 1

    def _now(self, stream: Any = None) -> Any:
        if self._event is not None:
            event = self._event()
            event.record(stream)
            return event
        return time.perf_counter()

    def mark(self, layer: int) -> None:
        """Layer ``layer`` (0-based, this rank's) starts its attention."""
        if self._armed and layer not in self._marks:
            self._marks[layer] = self._now()

    def ready(self, layer: int) -> None:
        """Layer ``layer``'s fetches have arrived (after the compute stream's wait on them): its
        compute is timed from here."""
        if self._armed and layer in self._marks and layer not in self._ready:
            self._ready[layer] = self._now()

    @property
    def wants_eager(self) -> bool:
        """This forward is sampled and must run eagerly to be timed (:attr:`eager_samples`)."""
        return self._armed and self.eager_samples

    def replayed(self, marks: tuple[dict[int, Any], dict[int, Any]] | None) -> None:
        """This forward replays a captured graph recording ``marks`` (entry and ready events by
        layer: ``GraphLayerMarks.of``; None: it records none, and a sampled step goes unreported
        as before; so on the CPU, whose marks are clock readings). Called for every replay, sampled
        or not: each one records the events again."""
        if marks is None or self._event is None:
            return
        key = id(marks[0])
        uses = self._replays[key] = self._replays.get(key, 0) + 1
        if self._armed:
            self._marks, self._ready = dict(marks[0]), dict(marks[1])
            self._graph = (key, uses)

    def end(self, stream: Any = None) -> None:
        """The forward (and sampling) returned; on CUDA the end mark goes on ``stream`` (the
        forward's stream: SGLang's overlap loop runs the forward on a stream of its own), default
        the current one. Queues the step's marks for :meth:`take`."""
        armed, self._armed = self._armed, False
        self._done.append((self._marks, self._ready, self._now(stream), self._graph) if armed else None)
        self._marks = {}
        self._ready = {}
        self._graph = None

    def take(self) -> tuple[float, ...] | None:
        """Per-layer ms of the oldest ended step not yet taken (None if it was not sampled or is
        incomplete, or no step ended)."""
        if not self._done:
            return None
        sample = self._done.popleft()
        if sample is None or len(sample[0]) != self.layers:
            return None
        marks, ready, end, graph = sample
        if graph is not None and self._replays.get(graph[0]) != graph[1]:
            return None  # a later replay of the same graph recorded its events again
        entries = [marks[layer] for layer in range(self.layers)]
        starts = [ready.get(layer, entries[layer]) for layer in range(self.layers)]
        ends = [*entries[1:], end]
        if self._event is not None:
            end.synchronize()

            def ms(a: Any, b: Any) -> float:
                return 0.0 if a is b else float(a.elapsed_time(b))
        else:

            def ms(a: Any, b: Any) -> float:
                return (b - a) * 1e3
        try:
            out = tuple(ms(a, b) for a, b in zip(starts, ends, strict=True))
            stall = tuple(ms(a, b) for a, b in zip(entries, starts, strict=True))
        except RuntimeError:  # an event never recorded (a graph's, replayed before its capture finished)
            return None
        if any(x < 0 for x in out) or any(x < 0 for x in stall):
            return None
        self.samples += 1
        self.last_stall_ms = stall
        return out


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)
