"""LayerPageMoves: the layer-pages one reconciliation moved, per layer (for residency events)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayerPageMoves:
    """Layer-pages moved by one reconciliation, per layer (for residency events)."""

    offloaded: dict[int, list[int]]
    """layer -> pages whose device copy was dropped."""
    loaded: dict[int, list[int]]
    """layer -> pages copied host -> device."""


def by_layer(layers: np.ndarray, pages: np.ndarray) -> dict[int, list[int]]:
    """``{layer: [pages]}`` of parallel arrays (first-seen order)."""
    moved: dict[int, list[int]] = {}
    for layer, page in zip(layers.tolist(), pages.tolist(), strict=True):
        moved.setdefault(layer, []).append(page)
    return moved
