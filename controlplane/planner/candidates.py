"""Per-request candidate layouts (issue 2 §3; OrbitFlow §3.3.2, the distance-driven set D(L)).

A candidate is the set of layers a request keeps in host memory. The set is the same for every
request of a model with ``L`` layers:

* ``none``: nothing offloaded;
* for ``k = 2..L``: offload the layers whose 1-based index is a multiple of ``k`` (``floor(L/k)``
  layers); for each distinct count only the widest ``k`` is kept (the paper's D(L));
* ``all``: every layer offloaded.

Candidates are ordered by the number of offloaded layers, ascending, so index 0 is ``none`` and the
last index is ``all``. Memory per block of a request is ``L - m + [m > 0]`` (resident layers plus
the one staging slot of issue 2 §2).
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CandidateSet:
    """The candidate layouts of one model depth."""

    layers: int
    """Model depth L."""
    offloaded: tuple[tuple[int, ...], ...]
    """Per candidate, the 0-based offloaded layers in ascending order."""
    labels: tuple[str, ...]
    """Per candidate, "none", "k=<distance>" or "all"."""

    @property
    def size(self) -> int:
        """Number of candidates."""
        return len(self.offloaded)

    @functools.cached_property
    def counts(self) -> tuple[int, ...]:
        """Per candidate, the number of offloaded layers m."""
        return tuple(len(o) for o in self.offloaded)

    @functools.cached_property
    def mem_units(self) -> tuple[int, ...]:
        """Per candidate, GPU blocks per request block: resident layers plus one staging slot."""
        return tuple(self.layers - m + (1 if m else 0) for m in self.counts)

    @functools.cached_property
    def rows(self) -> tuple[tuple[int, ...], ...]:
        """Per candidate, the placement row: 1 (GPU) / 0 (host) per layer."""
        out = []
        for off in self.offloaded:
            row = [1] * self.layers
            for layer in off:
                row[layer] = 0
            out.append(tuple(row))
        return tuple(out)

    @functools.cached_property
    def cumulative(self) -> tuple[tuple[int, ...], ...]:
        """Per candidate, offloaded layers ``<= l`` for every layer l (cached)."""
        return self.cumulative_counts(range(self.layers))

    @functools.cached_property
    def next_offloaded(self) -> tuple[tuple[int, ...], ...]:
        """Per candidate and layer ``l``, its next offloaded layer after ``l`` (-1 when none)."""
        out = []
        for off in self.offloaded:
            row = [-1] * self.layers
            for a, b in zip(off, off[1:], strict=False):
                row[a] = b
            out.append(tuple(row))
        return tuple(out)

    @functools.cached_property
    def offloading_at(self) -> tuple[tuple[int, ...], ...]:
        """Per layer, the candidates that offload it (ascending)."""
        at: list[list[int]] = [[] for _ in range(self.layers)]
        for c, off in enumerate(self.offloaded):
            for layer in off:
                at[layer].append(c)
        return tuple(tuple(a) for a in at)

    def cumulative_counts(self, layer_ids: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Per candidate, how many of its offloaded layers are ``<= l`` for each ``l`` given."""
        return tuple(
            tuple(bisect_left(off, layer + 1) for layer in layer_ids) for off in self.offloaded
        )


@functools.lru_cache(maxsize=64)
def candidate_set(layers: int) -> CandidateSet:
    """The candidate set for a model of ``layers`` layers (cached; immutable)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    widest: dict[int, int] = {}  # offloaded count -> widest distance k
    for k in range(2, layers + 1):
        widest[layers // k] = k  # k ascends, so the last write is the widest
    offloaded: list[tuple[int, ...]] = [()]
    labels = ["none"]
    for count in sorted(widest):
        k = widest[count]
        offloaded.append(tuple(i - 1 for i in range(k, layers + 1, k)))
        labels.append(f"k={k}")
    if layers not in widest:  # k=1 is "all"; L=1 has k=.. none, so "all" is layer 0
        offloaded.append(tuple(range(layers)))
        labels.append("all")
    return CandidateSet(layers, tuple(offloaded), tuple(labels))
