"""The exact decode-step timeline of a placement (issue 2 §2), event-driven.

Semantics (the data plane's contract):

* Layers run in order. Layer ``l`` starts when layer ``l-1`` has ended **and** every transfer of
  an offloaded ``(r, l)`` has finished; it then runs ``comp[l]`` ms. Step time = end of the last
  layer.
* Each request that offloads anything owns one staging slot (one layer of its blocks) and one
  transfer stream. Its offloaded layers are fetched in layer order: the first starts at t=0; each
  later one starts when the layer that used the slot has ended.
* Transfers in flight share the bandwidth equally (fluid processor sharing).

This corrects OrbitFlow Eq. (1) and Algorithm 1 (§3.3.1): the paper sizes one shared buffer by the
worst layer and approximates the timeline greedily per layer boundary; here every request has its
own slot and the timeline is simulated exactly.

Implementation: under processor sharing every in-flight stream receives the same service, so we
track one "virtual service" counter ``v`` (blocks served to each active stream so far). A transfer
of ``b`` blocks started at virtual service ``v0`` finishes when ``v`` reaches ``v0 + b``; between
events ``dv/dt = bw / n``. A heap keyed by finish-virtual-service gives O(log R) per event.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

Placement = Sequence[Sequence[int]]
"""``x[r][l]``: 1 keeps request r's layer l on the GPU, 0 keeps it in host memory."""


def memory_blocks(placement: Placement, blocks: Sequence[int]) -> tuple[int, int]:
    """(resident, staging) GPU blocks: ``sum_r b_r*sum_l x[r][l]`` and ``sum_r b_r*[r offloads]``."""
    resident = 0
    staging = 0
    for row, b in zip(placement, blocks, strict=True):
        on_gpu = sum(1 for x in row if x)
        resident += b * on_gpu
        if on_gpu < len(row):
            staging += b
    return resident, staging


def step_time_ms(
    placement: Placement,
    blocks: Sequence[int],
    comp_ms: Sequence[float],
    bw_blocks_per_ms: float,
) -> float:
    """Exact step time in ms of one decode step under ``placement``.

    ``blocks[r]`` is b_r (blocks per layer of request r), ``comp_ms[l]`` the compute time of layer
    l, ``bw_blocks_per_ms`` the link bandwidth shared by all transfers in flight.
    """
    n_layers = len(comp_ms)
    if len(placement) != len(blocks):
        raise ValueError(f"placement has {len(placement)} rows, blocks has {len(blocks)}")
    offloaded: list[list[int]] = []
    for r, row in enumerate(placement):
        if len(row) != n_layers:
            raise ValueError(f"placement[{r}] has {len(row)} layers, expected {n_layers}")
        offloaded.append([layer for layer in range(n_layers) if not row[layer]])
    if not any(offloaded):
        return float(sum(comp_ms))
    if bw_blocks_per_ms <= 0:
        raise ValueError(f"bw_blocks_per_ms must be > 0, got {bw_blocks_per_ms}")

    waiting = [0] * n_layers  # unfinished transfers each layer waits for
    slot_users: list[list[int]] = [[] for _ in range(n_layers)]  # requests staging at layer l
    for r, layers in enumerate(offloaded):
        for layer in layers:
            waiting[layer] += 1
            slot_users[layer].append(r)

    heap: list[tuple[float, int, int]] = []  # (finish virtual service, request, layer)
    next_idx = [0] * len(offloaded)
    v = 0.0  # virtual service per active stream, in blocks
    t = 0.0

    def start(r: int) -> None:
        heapq.heappush(heap, (v + blocks[r], r, offloaded[r][next_idx[r]]))

    for r, layers in enumerate(offloaded):
        if layers:
            start(r)

    for layer in range(n_layers):
        # Stall until every transfer this layer needs has landed.
        while waiting[layer] > 0:
            finish_v, _, done_layer = heapq.heappop(heap)
            t += (finish_v - v) * (len(heap) + 1) / bw_blocks_per_ms
            v = finish_v
            waiting[done_layer] -= 1
        # Run the layer; transfers keep flowing underneath.
        end = t + comp_ms[layer]
        while heap:
            n = len(heap)
            finish_v, _, done_layer = heap[0]
            t_done = t + (finish_v - v) * n / bw_blocks_per_ms
            if t_done > end:
                v += (end - t) * bw_blocks_per_ms / n
                break
            heapq.heappop(heap)
            t, v = t_done, finish_v
            waiting[done_layer] -= 1
        t = end
        # The slots used by this layer are free again: start each owner's next fetch.
        for r in slot_users[layer]:
            next_idx[r] += 1
            if next_idx[r] < len(offloaded[r]):
                start(r)
    return t
