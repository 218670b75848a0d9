"""The exact decode-step timeline of a placement (issue 2 §2), event-driven.

Semantics (the data plane's contract):

* Layers run in order. Layer ``l`` starts when layer ``l-1`` has ended **and** every transfer of
  an offloaded ``(r, l)`` has finished; it then runs ``comp[l]`` ms. Step time = end of the last
  layer.
* Each request that offloads anything owns one staging slot (one layer of its blocks) and one
  transfer stream. Its offloaded layers are fetched in layer order: the first starts at t=0; each
  later one starts when the layer that used the slot has ended.
* Transfers in flight share the bandwidth equally (fluid processor sharing).
* **Fetch launches** (``launch_ms``, default 0): the data plane issues one copy launch per
  (target layer, trigger) -- the fetches that start together at one layer end (or at the step
  start) and go to one layer share a launch (``sglang_ext/dataplane/paged_step_tables.py``).
  When the host issues a step's work no faster than the GPU runs it (an eager forward, as
  ``kvplane gpu-check``'s timelines showed on an H200: the host issued a 22 ms hidden-fetch step
  in 20.9 ms), each launch delays the next layer's start by its host cost: the next layer starts
  ``launch_ms`` times the launches later, while the transfers already in flight keep moving.
  A GPU-bound server learns ``launch_ms`` near 0 (``ProfileTracker``); the start of the step
  counts the launches of every request's first fetch. Simplifications: the launched fetches start
  moving at the layer end (optimistic: the host issues the launches one after the other), and
  the step time is not monotone in ``launch_ms`` (a delayed fetch can leave the link to one
  needed sooner). The identity layout (everything fits, nothing staged in steady decode) issues
  a step's fetches at its start; the model charges them per trigger as the paged layout does.

This corrects OrbitFlow Eq. (1) and Algorithm 1 (§3.3.1): the paper sizes one shared buffer by the
worst layer and approximates the timeline greedily per layer boundary; here every request has its
own slot and the timeline is simulated exactly.

**Recompute** (issue 16, ``docs/recompute.md``; eLLM §4.3.1): a request may also carry ``(u, k)``:
its first ``u`` blocks are not cached on the GPU in any layer; layers ``l < k`` recompute them
(``u * block_size * recompute_ms_per_token[l]`` ms joins layer ``l``'s compute), layers
``l >= k`` fetch them with the request's other blocks of that layer. Per layer the request then
fetches ``f(l) = (0 if x[l] else b - u) + (u if l >= k else 0)`` blocks through its one slot,
with the same slot/stream rule. The slot holds every column fetched in some layer, as the served
core reserves it: ``b - u`` when a layer is offloaded, plus ``u`` when ``k < L``
(:func:`request_staging_blocks`). ``u = 0`` is the model above exactly.

Implementation: under processor sharing every in-flight stream receives the same service, so we
track one "virtual service" counter ``v`` (blocks served to each active stream so far). A transfer
of ``b`` blocks started at virtual service ``v0`` finishes when ``v`` reaches ``v0 + b``; between
events ``dv/dt = bw / n``. :func:`fetch_timeline_ms` keeps a heap keyed by finish-virtual-service
(O(log R) per event, one event per fetch): the reference. :func:`step_time_ms` runs the same
timeline on requests grouped by their fetch layers (:mod:`.grouped_timeline`: a plan's rows
repeat, so its work is O(requests + groups x layers) Python steps instead of one heap event per
fetch; equal to the heap's to float rounding, ``tests/controlplane/test_grouped_timeline.py``)
where its groups carry several fetches per layer, and on the heap otherwise.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from controlplane.model.grouped_timeline import (
    Group,
    fetch_groups,
    grouped_timeline_ms,
    placement_groups,
)

Placement = Sequence[Sequence[int]]
"""``x[r][l]``: 1 keeps request r's layer l on the GPU, 0 keeps it in host memory."""

Recompute = Sequence[tuple[int, int]]
"""Per request ``(u_r, k_r)``: recompute blocks (the uncached prefix, ``0 <= u_r <= b_r - 1``) and
recompute layers (``0 <= k_r <= L``; layers ``< k_r`` recompute the prefix, the rest fetch it)."""

Fetches = Sequence[Sequence[tuple[int, float]]]
"""Per request, its fetches ``(layer, blocks)`` in ascending layer order (``blocks > 0``)."""


def fetch_sizes(row: Sequence[int], blocks: int, u: int = 0, k: int = 0) -> list[int]:
    """``f(l)`` per layer: the cached blocks of an offloaded layer plus the uncached prefix of a
    layer ``>= k`` (``docs/recompute.md``). ``u = 0`` gives ``b`` at offloaded layers, else 0."""
    cached = blocks - u
    return [(0 if x else cached) + (u if u and layer >= k else 0) for layer, x in enumerate(row)]


def request_staging_blocks(row: Sequence[int], blocks: int, u: int = 0, k: int = 0) -> int:
    """One request's staging slot: the union of the columns it fetches in some layer, as the
    served core reserves it (``sglang_ext/dataplane/step_tables.py``, ``docs/recompute.md``):
    the ``b - u`` cached blocks when some layer is offloaded, plus the ``u`` prefix blocks when
    some layer ``>= k`` fetches them (``k < L``). ``u = 0`` gives ``b`` when the request offloads
    a layer, else 0 (OrbitFlow's slot). At least ``max_l f(l)``; more when every offloaded layer
    is below ``k`` (the two parts are then fetched in different layers but both held)."""
    cached = blocks - u if any(not x for x in row) else 0
    return cached + (u if u and k < len(row) else 0)


def _check_recompute(recompute: Recompute, blocks: Sequence[int], n_layers: int) -> None:
    if len(recompute) != len(blocks):
        raise ValueError(f"recompute has {len(recompute)} entries, blocks has {len(blocks)}")
    for r, ((u, k), b) in enumerate(zip(recompute, blocks, strict=True)):
        if not 0 <= u <= max(0, b - 1):
            raise ValueError(f"recompute[{r}] u={u} is out of range (allowed [0, {max(0, b - 1)}])")
        if not 0 <= k <= n_layers:
            raise ValueError(f"recompute[{r}] k={k} is out of range (allowed [0, {n_layers}])")


def memory_blocks(
    placement: Placement, blocks: Sequence[int], recompute: Recompute | None = None
) -> tuple[int, int]:
    """(resident, staging) GPU blocks: ``sum_r b_r*sum_l x[r][l]`` and ``sum_r b_r*[r offloads]``.

    With ``recompute`` (``docs/recompute.md``): resident ``sum_r (b_r - u_r) * sum_l x[r][l]``,
    staging ``sum_r`` :func:`request_staging_blocks` (``(b_r - u_r) [r offloads a layer] +
    u_r [k_r < L]``); the transient blocks are :func:`transient_blocks`.
    """
    if recompute is None:
        resident = 0
        staging = 0
        for row, b in zip(placement, blocks, strict=True):
            on_gpu = sum(1 for x in row if x)
            resident += b * on_gpu
            if on_gpu < len(row):
                staging += b
        return resident, staging
    _check_recompute(recompute, blocks, len(placement[0]) if placement else 0)
    resident = staging = 0
    for row, b, (u, k) in zip(placement, blocks, recompute, strict=True):
        resident += (b - u) * sum(1 for x in row if x)
        staging += request_staging_blocks(row, b, u, k)
    return resident, staging


def transient_blocks(recompute: Recompute | None) -> int:
    """Transient GPU blocks of the recomputed prefixes: ``sum_r u_r [k_r > 0]`` (one layer of each
    recomputed prefix, reused layer after layer; ``docs/recompute.md``)."""
    return sum(u for u, k in recompute or () if k > 0)


def gpu_blocks(
    placement: Placement, blocks: Sequence[int], recompute: Recompute | None = None
) -> int:
    """Every GPU KV block the placement needs: resident + staging + transient (what must fit
    ``gpu_kv_budget_blocks``)."""
    return sum(memory_blocks(placement, blocks, recompute)) + transient_blocks(recompute)


def recompute_compute_ms(
    comp_ms: Sequence[float],
    recompute: Recompute,
    recompute_ms_per_token: Sequence[float],
    block_size: int,
) -> list[float]:
    """Per layer ``comp[l] + sum_{r: l < k_r} u_r * block_size * recompute_ms_per_token[l]``
    (eLLM §4.2.1 Eq. 2: linear in the recomputed tokens for the GEMMs that dominate here)."""
    if len(recompute_ms_per_token) != len(comp_ms):
        raise ValueError(
            f"recompute_ms_per_token has {len(recompute_ms_per_token)} layers, expected {len(comp_ms)}"
        )
    out = list(comp_ms)
    for u, k in recompute:
        if u:
            tokens = u * block_size
            for layer in range(min(k, len(out))):
                out[layer] += tokens * recompute_ms_per_token[layer]
    return out


def step_time_ms(
    placement: Placement,
    blocks: Sequence[int],
    comp_ms: Sequence[float],
    bw_blocks_per_ms: float,
    *,
    recompute: Recompute | None = None,
    recompute_ms_per_token: Sequence[float] | None = None,
    block_size: int = 1,
    launch_ms: float = 0.0,
) -> float:
    """Exact step time in ms of one decode step under ``placement``.

    ``blocks[r]`` is b_r (blocks per layer of request r), ``comp_ms[l]`` the compute time of layer
    l, ``bw_blocks_per_ms`` the link bandwidth shared by all transfers in flight. ``recompute``
    (per request ``(u, k)``) adds the recompute option; it needs ``recompute_ms_per_token`` (per
    layer) and ``block_size`` when some request recomputes (``u > 0`` and ``k > 0``).
    """
    n_layers = len(comp_ms)
    if len(placement) != len(blocks):
        raise ValueError(f"placement has {len(placement)} rows, blocks has {len(blocks)}")
    for r, row in enumerate(placement):
        if len(row) != n_layers:
            raise ValueError(f"placement[{r}] has {len(row)} layers, expected {n_layers}")
    if recompute is None:
        return _timeline(placement_groups(placement, blocks), comp_ms, bw_blocks_per_ms, launch_ms)
    _check_recompute(recompute, blocks, n_layers)
    comp = list(comp_ms)
    if any(u and k for u, k in recompute):
        if recompute_ms_per_token is None:
            raise ValueError("recompute_ms_per_token is required when a request recomputes")
        comp = recompute_compute_ms(comp_ms, recompute, recompute_ms_per_token, block_size)
    fetches = []
    for row, b, (u, k) in zip(placement, blocks, recompute, strict=True):
        sizes = fetch_sizes(row, b, u, k)
        fetches.append([(layer, f) for layer, f in enumerate(sizes) if f > 0])
    return _timeline(fetch_groups(fetches), comp, bw_blocks_per_ms, launch_ms, fetches)


def _timeline(groups: list[Group], comp_ms: Sequence[float], bw: float, launch_ms: float,
              fetches: Fetches | None = None) -> float:
    """The grouped timeline where its groups carry at least three fetches per layer they fetch
    for; else the event heap, whose work per fetch is smaller (on this project's 2-core host:
    4 requests x 80 layers, half offloaded, 95 us by the heap and 150 grouped; 24 x 32 on three
    rows, 200 and 135; the controller's check at 256 x 80, nearly every layer offloaded, 44 ms and
    about 2.5). ``fetches``: the per-request fetches the groups were built from, when the caller
    has them (else they are rebuilt from the groups for the heap)."""
    count = sum(len(p) * len(sizes[0]) for p, sizes in groups)
    if count >= 3 * len({layer for p, _ in groups for layer in p}):
        return grouped_timeline_ms(groups, comp_ms, bw, launch_ms=launch_ms)
    if fetches is None:
        fetches = [
            [(layer, sizes[i][m]) for i, layer in enumerate(p)] for p, sizes in groups for m in range(len(sizes[0]))
        ]
    return fetch_timeline_ms(fetches, comp_ms, bw, launch_ms=launch_ms)


def fetch_timeline_ms(
    fetches: Fetches,
    comp_ms: Sequence[float],
    bw_blocks_per_ms: float,
    *,
    cutoff: float = math.inf,
    launch_ms: float = 0.0,
) -> float:
    """The timeline itself: per request its fetches ``(layer, blocks)`` through one slot and one
    stream, layers computing ``comp_ms[l]`` ms, ``launch_ms`` per fetch launch (module
    docstring). ``math.inf`` as soon as the step provably reaches ``cutoff`` (a layer may start
    no earlier than now, and every later layer still runs)."""
    n_layers = len(comp_ms)
    if not launch_ms >= 0:
        raise ValueError(f"launch_ms must be >= 0, got {launch_ms}")
    if not any(fetches):
        return float(sum(comp_ms))
    if bw_blocks_per_ms <= 0:
        raise ValueError(f"bw_blocks_per_ms must be > 0, got {bw_blocks_per_ms}")
    suffix = None
    if cutoff < math.inf:
        suffix = [0.0] * (n_layers + 1)
        for layer in range(n_layers - 1, -1, -1):
            suffix[layer] = suffix[layer + 1] + comp_ms[layer]

    waiting = [0] * n_layers  # unfinished transfers each layer waits for
    slot_users: list[list[int]] = [[] for _ in range(n_layers)]  # requests staging at layer l
    for r, own in enumerate(fetches):
        for layer, _ in own:
            waiting[layer] += 1
            slot_users[layer].append(r)

    heap: list[tuple[float, int, int]] = []  # (finish virtual service, request, layer)
    next_idx = [0] * len(fetches)
    v = 0.0  # virtual service per active stream, in blocks
    t = 0.0

    def start(r: int) -> int:
        """Start r's next fetch; its target layer (launches are counted per target layer)."""
        layer, size = fetches[r][next_idx[r]]
        heapq.heappush(heap, (v + size, r, layer))
        return layer

    def flow(t: float, v: float, end: float) -> tuple[float, float]:
        """Transfers keep moving from ``t`` to ``end`` (a layer's compute, or launch time);
        returns the new ``(t, v)`` (``t == end``)."""
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
        return end, v

    first = {start(r) for r, own in enumerate(fetches) if own}
    if launch_ms:  # the step's first launches, before layer 0 starts
        t, v = flow(t, v, len(first) * launch_ms)

    for layer in range(n_layers):
        # Stall until every transfer this layer needs has landed.
        while waiting[layer] > 0:
            finish_v, _, done_layer = heapq.heappop(heap)
            t += (finish_v - v) * (len(heap) + 1) / bw_blocks_per_ms
            v = finish_v
            waiting[done_layer] -= 1
        if suffix is not None and t + suffix[layer] >= cutoff:
            return math.inf
        # Run the layer; transfers keep flowing underneath.
        t, v = flow(t, v, t + comp_ms[layer])
        # The slots used by this layer are free again: start each owner's next fetch.
        targets = set()
        for r in slot_users[layer]:
            next_idx[r] += 1
            if next_idx[r] < len(fetches[r]):
                targets.add(start(r))
        if launch_ms and targets:  # one launch per target layer, before the next layer starts
            t, v = flow(t, v, t + len(targets) * launch_ms)
    return t


def launch_count(placement: Placement) -> int:
    """Fetch launches of one step under ``placement`` (module docstring: one per target layer at
    the step start and at each layer end): the distinct first offloaded layers, plus per layer
    the distinct next offloaded layers of the requests whose slot it frees."""
    firsts: set[int] = set()
    by_trigger: dict[int, set[int]] = {}
    for row in placement:
        off = [layer for layer, x in enumerate(row) if not x]
        if off:
            firsts.add(off[0])
            for prev, nxt in zip(off, off[1:], strict=False):
                by_trigger.setdefault(prev, set()).add(nxt)
    return len(firsts) + sum(len(targets) for targets in by_trigger.values())
