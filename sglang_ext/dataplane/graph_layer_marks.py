"""GraphLayerMarks: per-layer timing events recorded inside captured decode graphs.

The adaptive controller refreshes its per-layer compute profile from sampled decode steps
(OrbitFlow §3.4; :class:`~sglang_ext.layer_timing.LayerTimer`): every N-th step, an event at each
layer's entry and another once its fetches have arrived, read after the step. An eager step
records them from Python. A replayed CUDA graph runs no Python, so under ``--kv-cuda-graphs on``
-- where nearly every decode step replays -- the sampled steps had no marks and the controller
stopped learning (``docs/cuda-graphs.md``).

These are the marks a graph records itself: while a decode graph is being captured, each layer's
:meth:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers.enter` records a timing event
before the layer's wait on its fetches (``mark``) and one after it (``ready``), created with
``external=True`` so that the capture turns each record into an event-record node of the graph
(``torch.cuda.Event``'s ``external``: a record node, not a cross-stream dependency). Every replay
then records the same events again, on the device, at the same points of the step. The timer
takes a replayed step's events by the captured size it replays at (:meth:`of`) and reads them
after the step, as it reads an eager step's.

Only the capture records (``capturing()``: ``torch.cuda.is_current_stream_capturing``): the
capture's eager warm-ups and any eager run over the same buffers leave the captured events alone,
so the events of a size are the ones its graph records. One set per captured size: a replay
re-records its set, which is why a sample must be read before the next replay of that size
(:meth:`LayerTimer.replayed` keeps count and drops a sample a later replay overwrote). A size
captured twice (SGLang's LoRA and no-LoRA graphs) gives no events: which graph replays is not
known here. ROCm gives none: HIP does not time events recorded inside graphs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch


class GraphLayerMarks:
    """Captured per-layer entry and ready events by graph size (module docstring); ``event()``
    makes a timing event, ``capturing()`` says whether a graph capture is recording now."""

    def __init__(self, layers: int, event: Callable[[], Any], capturing: Callable[[], bool]) -> None:
        if layers < 1:
            raise ValueError(f"GraphLayerMarks needs layers >= 1, got {layers}")
        self.layers = layers
        self._event = event
        self._capturing = capturing
        self._sets: dict[int, tuple[dict[int, Any], dict[int, Any]]] = {}
        """Captured size -> (entry events, ready events), by layer."""
        self._twice: set[int] = set()
        """Sizes captured more than once (SGLang's LoRA and no-LoRA graphs of one size): whose
        events a replay stamps is then unknown, so those sizes give none (:meth:`of`)."""
        self._kept: list[Any] = []
        """Every event a capture recorded: a graph captured again replaces its size's set, and
        the older graph's event nodes must not record into destroyed events."""

    @classmethod
    def for_device(cls, layers: int, device: Any) -> GraphLayerMarks | None:
        """Marks for graphs on ``device``: CUDA with events that a capture records as graph nodes
        (``torch.cuda.Event(external=True)``), else None (no graph timing: the CPU, where the tests'
        emulated graphs replay no events, or a torch without external events)."""
        if torch.device(device).type != "cuda" or torch.version.hip is not None:
            return None  # (HIP does not time events recorded inside graphs: ROCm/rocm-systems#2380)
        if "external" not in inspect.signature(torch.cuda.Event.__new__).parameters:
            return None
        return cls(layers, lambda: torch.cuda.Event(enable_timing=True, external=True),
                   torch.cuda.is_current_stream_capturing)

    def recapture(self) -> None:
        """Every size is about to be captured again (SGLang's recapture): the older graphs never
        replay again (SGLang drops their runner before it captures anew), so their sets -- and
        the sizes they made ambiguous -- are forgotten, and so are their events: each recapture
        would otherwise keep two per layer and size more, for the life of the process."""
        self._sets.clear()
        self._twice.clear()
        self._kept.clear()

    def mark(self, layer: int, size: int) -> None:
        """Layer ``layer`` of the graph of ``size`` rows starts (before its wait): recorded when capturing."""
        self._record(0, layer, size)

    def ready(self, layer: int, size: int) -> None:
        """Layer ``layer``'s fetches have arrived (after the compute stream's wait on them)."""
        self._record(1, layer, size)

    def _record(self, kind: int, layer: int, size: int) -> None:
        if not self._capturing():
            return
        event = self._event()
        event.record()
        self._kept.append(event)
        recorded = self._sets.setdefault(size, ({}, {}))[kind]
        if layer in recorded:  # a capture records each point once: this is another graph of the size
            self._twice.add(size)
        recorded[layer] = event

    def of(self, size: int) -> tuple[dict[int, Any], dict[int, Any]] | None:
        """The entry and ready events the graph of ``size`` rows records, or None where it
        records none for some layer (not captured through :meth:`mark`, or not every layer)."""
        got = self._sets.get(size)
        if got is None or size in self._twice or len(got[0]) != self.layers or len(got[1]) != self.layers:
            return None
        return got
