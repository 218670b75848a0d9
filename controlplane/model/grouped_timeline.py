"""The exact decode-step timeline of :mod:`.timeline`, by requests grouped on their fetch layers.

Same semantics as :func:`.timeline.fetch_timeline_ms` (issue 2 §2: layers in order, one slot and
one stream per offloading request, fluid processor sharing of the link, ``launch_ms`` per fetch
launch), computed another way:

* Requests that fetch at the same layers start every fetch at the same instant (the step start,
  then the end of the layer their slot served), so they are one **group**: its fetch layers
  ``P`` and, per fetch, its members' sizes. A placement's rows repeat (the planner's candidate
  layouts; all-GPU rows for requests it does not place), so a batch of hundreds of requests has a
  handful of groups, and building them costs O(requests + groups x layers), not O(requests x
  layers) tuples.
* Processor sharing gives every active stream the same service, so one virtual clock ``v``
  (blocks served to each active stream so far) describes the link; a fetch of ``b`` blocks
  started at ``v0`` ends when ``v`` reaches ``F = v0 + b``. With the active ``F`` sorted and
  their prefix sums, moving the clock through a layer's compute or a stall is a bisection
  (:class:`controlplane.planner.evaluator.Evaluator` does the same over candidate layouts),
  not one heap event per fetch.

The event heap of :func:`.timeline.fetch_timeline_ms` stays the reference; the two agree to
float rounding (``tests/controlplane/test_grouped_timeline.py``). Measured on this project's
2-core CPU host: the controller's profile check of 256 requests x 80 layers, nearly every layer
offloaded, 45 ms a report by the heap and 3.4 ms grouped
(``benchmarks/results/service/session88-scale-review/README.md``).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

Group = tuple[tuple[int, ...], Sequence[Sequence[float]]]
"""``(P, sizes)``: the ascending layers ``P`` the group's requests fetch for, and per fetch
``i`` the members' sizes in blocks (``sizes[i][m] > 0``; every ``sizes[i]`` has one entry per
member, in one member order)."""


def link_served(fs: list[float], v: float, work: float) -> float:
    """The virtual clock after the link serves ``work`` blocks from ``v`` to the fetches whose
    finish points are the sorted ``fs`` (the finished ones are removed from ``fs``): with prefix
    sums ``S_j``, moving the clock to ``V`` serves ``S_j + V (n - j) - n v`` blocks, ``j`` the
    fetches finished by ``V``, so the largest ``j`` is a bisection (also the planner's
    :meth:`controlplane.planner.evaluator.Evaluator.exact_ms`)."""
    n = len(fs)
    if not n:
        return v
    if (fs[0] - v) * n > work:  # nothing completes
        return v + work / n
    ps = list(accumulate(fs))
    base = n * v + work
    lo, hi = 1, n  # the largest j whose fetches all finish: ps[j-1] + fs[j-1] (n - j) <= base
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if ps[mid - 1] + fs[mid - 1] * (n - mid) <= base:
            lo = mid
        else:
            hi = mid - 1
    j = lo
    if j == n:
        v = fs[-1]  # the link idles for the rest
        fs.clear()
        return v
    v = fs[j - 1] + (base - ps[j - 1] - fs[j - 1] * (n - j)) / (n - j)
    del fs[:j]
    return v


def grouped_timeline_ms(
    groups: Sequence[Group],
    comp_ms: Sequence[float],
    bw_blocks_per_ms: float,
    *,
    cutoff: float = math.inf,
    launch_ms: float = 0.0,
) -> float:
    """Step time in ms of ``groups`` (:data:`Group`) over layers computing ``comp_ms[l]`` ms,
    the link serving ``bw_blocks_per_ms``; ``math.inf`` as soon as the step provably reaches
    ``cutoff`` (as :func:`.timeline.fetch_timeline_ms`)."""
    n_layers = len(comp_ms)
    if not launch_ms >= 0:
        raise ValueError(f"launch_ms must be >= 0, got {launch_ms}")
    live = [(p, sizes) for p, sizes in groups if p and sizes and len(sizes[0])]
    if not live:
        return float(sum(comp_ms))
    if bw_blocks_per_ms <= 0:
        raise ValueError(f"bw_blocks_per_ms must be > 0, got {bw_blocks_per_ms}")
    bw = bw_blocks_per_ms
    prefix = [0.0, *accumulate(comp_ms)]  # prefix[l]: compute of the layers before l
    # starters[l]: the groups whose slot layer l frees, with the index of their next fetch
    starters: dict[int, list[tuple[int, int]]] = {}
    for g, (p, _) in enumerate(live):
        for i in range(len(p) - 1):
            starters.setdefault(p[i], []).append((g, i + 1))
    # only the layers something fetches for can stall or start fetches; the compute between
    # them is one prefix-sum difference (the link flows through it, as through launch time)
    events = sorted({layer for p, _ in live for layer in p})
    need = [0.0] * n_layers  # the largest finish F among the fetches layer l waits for
    fs: list[float] = []
    for p, sizes in live:
        first = sizes[0]
        fs.extend(first)
        top = max(first)
        if top > need[p[0]]:
            need[p[0]] = top
    fs.sort()
    v = t = 0.0
    # the step's first launches, one per target layer, before layer 0 starts
    delay = len({p[0] for p, _ in live}) * launch_ms if launch_ms else 0.0
    pos = 0
    for layer in events:
        dt = prefix[layer] - prefix[pos] + delay  # launches, then the layers before this one
        delay = 0.0
        if dt > 0.0:
            v = link_served(fs, v, dt * bw)
            t += dt
        target = need[layer]
        if target > v:  # stall until every fetch this layer needs has landed
            j = bisect_right(fs, target)
            n = len(fs)
            t += (sum(fs[:j]) + target * (n - j) - n * v) / bw
            v = target
            del fs[:j]
        # t + (compute of layer.. on) never decreases layer to layer (stalls and launches only
        # add), so stopping at the first layer that reaches the cutoff is exact
        if t + prefix[n_layers] - prefix[layer] >= cutoff:
            return math.inf
        dt = comp_ms[layer]
        if dt > 0.0:
            v = link_served(fs, v, dt * bw)
            t += dt
        started = starters.get(layer)
        if started:  # the slots this layer used are free: each owner's next fetch starts
            targets = set()
            for g, i in started:
                p, sizes = live[g]
                nl = p[i]
                targets.add(nl)
                now = sizes[i]
                top = v + max(now)
                if top > need[nl]:
                    need[nl] = top
                fs.extend([v + b for b in now])
            fs.sort()
            if launch_ms:  # one launch per target layer, before the next layer starts
                delay = len(targets) * launch_ms
        pos = layer + 1
    t += prefix[n_layers] - prefix[pos] + delay
    return math.inf if t >= cutoff else t


def placement_groups(placement: Sequence[Sequence[int]], blocks: Sequence[int]) -> list[Group]:
    """The :data:`Group` list of ``placement`` without recompute (each offloaded layer fetches the
    request's ``b_r`` blocks): requests with equal rows share one group, built once."""
    members: dict[tuple[int, ...], list[float]] = {}
    for row, b in zip(placement, blocks, strict=True):
        key = row if isinstance(row, tuple) else tuple(row)
        lst = members.get(key)
        if lst is None:
            members[key] = [float(b)]
        else:
            lst.append(float(b))
    out: list[Group] = []
    for row, sizes in members.items():
        p = tuple(layer for layer, x in enumerate(row) if not x)
        if p:
            out.append((p, [sizes] * len(p)))
    return out


def fetch_groups(fetches: Sequence[Sequence[tuple[int, int]]]) -> list[Group]:
    """The :data:`Group` list of per-request fetches ``(layer, blocks)`` (any sizes per fetch, as
    recompute makes them): requests fetching at the same layers share one group."""
    by_layers: dict[tuple[int, ...], list[list[float]]] = {}
    for own in fetches:
        if not own:
            continue
        p = tuple(layer for layer, _ in own)
        cols = by_layers.get(p)
        if cols is None:
            cols = by_layers[p] = [[] for _ in p]
        for col, (_, size) in zip(cols, own, strict=True):
            col.append(float(size))
    return list(by_layers.items())
