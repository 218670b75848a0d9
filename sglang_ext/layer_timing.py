"""Sampled per-layer decode timing for the control plane's profile (OrbitFlow §3.4 profile refresh).

Every ``every``-th decode step the layered attention backend marks the entry of each layer's
attention (:meth:`LayerTimer.mark`) and the scheduler hook marks the end of the forward
(:meth:`LayerTimer.end`). Layer ``l``'s time is from its mark to the next layer's; the last
layer's runs to the end of ``run_batch`` and so also carries the LM head and sampling. On CUDA
the marks are ``torch.cuda.Event`` records (no sync inside the step; read after
``process_batch_result`` has synchronised), on CPU ``time.perf_counter``. The result goes out as
``StepReport.layer_compute_ms``; steps that were not sampled report None.
"""

from __future__ import annotations

import time
from typing import Any

import torch

DEFAULT_EVERY = 16
"""Sample one decode step in this many."""


class LayerTimer:
    """Per-layer marks of one sampled decode step."""

    def __init__(self, layers: int, device: str | torch.device = "cpu", every: int = DEFAULT_EVERY) -> None:
        if layers < 1 or every < 1:
            raise ValueError(f"LayerTimer needs layers >= 1 and every >= 1, got {layers}, {every}")
        self.layers = layers
        self.every = every
        self.cuda = torch.device(device).type == "cuda"
        self._decode_steps = 0
        self._armed = False
        self._marks: dict[int, Any] = {}
        self._end: Any = None
        self.samples = 0
        """Steps whose per-layer times were reported."""

    def begin(self, is_decode: bool) -> None:
        """Start of ``run_batch``: arm on every ``every``-th decode step."""
        self._marks, self._end = {}, None
        self._armed = False
        if is_decode:
            self._armed = self._decode_steps % self.every == 0
            self._decode_steps += 1

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def mark(self, layer: int) -> None:
        """Layer ``layer`` (0-based, this rank's) starts its attention."""
        if self._armed and layer not in self._marks:
            self._marks[layer] = self._now()

    def end(self) -> None:
        """The forward (and sampling) returned."""
        if self._armed:
            self._end = self._now()

    def take(self) -> tuple[float, ...] | None:
        """Per-layer ms of the sampled step (None if this step was not sampled or incomplete)."""
        armed, self._armed = self._armed, False
        if not armed or self._end is None or len(self._marks) != self.layers:
            return None
        points = [self._marks[layer] for layer in range(self.layers)] + [self._end]
        if self.cuda:
            points[-1].synchronize()
            out = tuple(float(a.elapsed_time(b)) for a, b in zip(points, points[1:], strict=False))
        else:
            out = tuple((b - a) * 1e3 for a, b in zip(points, points[1:], strict=False))
        if any(ms < 0 for ms in out):
            return None
        self.samples += 1
        return out
