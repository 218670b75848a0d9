"""Exact step time, memory and lower bounds for *joint* assignments (layout + recompute).

A joint option of request ``r`` is a layout of the candidate set (:mod:`.candidates`) together
with a ``(u, k)`` of the grid (:class:`.RecomputeGrid`); a joint assignment is one option index
per request. Per option this precomputes what the exact model needs (``docs/recompute.md``):

* fetches ``f(l) = (0 if x[l] else b - u) + (u if l >= k else 0)`` for the layers with
  ``f(l) > 0``;
* memory: resident ``(b - u) * |{l: x[l] = 1}|`` + staging ``(b - u) [a layer offloaded] +
  u [k < L]`` (the served core's slot, :func:`controlplane.model.request_staging_blocks`) +
  transient ``u [k > 0]``;
* added compute ``u * block_size * rms[l]`` for ``l < k``.

:meth:`RecomputeEvaluator.exact_ms` runs :func:`controlplane.model.fetch_timeline_ms` (the model's
own timeline; ``tests/controlplane/test_recompute_planner.py`` checks it equals
:func:`controlplane.model.step_time_ms` with ``recompute=``). Lower bounds, all valid for the exact
model and monotone in what is added (so also valid on partial assignments):

* compute: ``T >= sum_l comp'[l]`` (``comp'`` with every recompute added);
* aggregate link: every fetch for layers ``<= l`` lands before layer ``l`` starts, so
  ``T >= W_l / bw + sum_{j >= l} comp'[j]``;
* chain: a request's own fetches with the whole link to itself, each starting when the layer
  that used its slot before has ended: ``T >= sum comp' + sum_j max(0, f_j / bw - window_j)``
  (more compute or more traffic from other requests can only raise it);
* volume: ``T >= V / bw + comp[L-1]`` (``V`` every fetched block; O(1) per move, for ordering).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

from controlplane.model import fetch_sizes, fetch_timeline_ms, request_staging_blocks
from controlplane.planner.candidates import CandidateSet
from controlplane.planner.recompute_grid import RecomputeGrid


class JointOption(NamedTuple):
    """One request's layout with one ``(u, k)``."""

    layout: int
    """Candidate index in the :class:`CandidateSet`."""
    u: int
    """Recompute blocks (uncached prefix)."""
    k: int
    """Recompute layers (0 when ``u = 0``)."""
    resident: int
    """Resident blocks."""
    staging: int
    """Staging slot blocks (``(b - u) [a layer offloaded] + u [k < L]``, 0 when nothing is
    fetched)."""
    transient: int
    """Transient blocks (``u`` when ``k > 0``)."""
    fetches: tuple[tuple[int, int], ...]
    """``(layer, f(l))`` for every layer with ``f(l) > 0``, ascending."""
    cum: tuple[int, ...]
    """Fetched blocks of layers ``<= l`` per layer."""
    tokens: int
    """Recomputed tokens per layer ``< k`` (``u * block_size``, 0 when ``k = 0``)."""
    recompute_ms: float
    """Compute the recompute adds over all layers."""

    @property
    def mem(self) -> int:
        """Every GPU block the option needs."""
        return self.resident + self.staging + self.transient

    @property
    def volume(self) -> int:
        """Blocks fetched per step."""
        return self.cum[-1] if self.cum else 0


class RecomputeEvaluator:
    """Joint options per request and exact evaluation of joint assignments (one window).

    Options are listed per request as ``(layout, u, k)`` specs with their memory, fetched volume
    and recompute time in closed form (what move ordering needs, O(1) each); the per-layer
    :class:`JointOption` (fetches, cumulative work) is built only when an option is evaluated or
    bounded, and memoised.
    """

    def __init__(
        self,
        cands: CandidateSet,
        blocks: Sequence[int],
        comp_ms: Sequence[float],
        bw_blocks_per_ms: float,
        grid: RecomputeGrid,
        launch_ms: float = 0.0,
    ) -> None:
        """``launch_ms``: host cost of one fetch launch (:mod:`controlplane.model.timeline`; the
        exact step time counts it, the bounds leave it out)."""
        if not launch_ms >= 0:
            raise ValueError(f"launch_ms must be >= 0, got {launch_ms}")
        self.launch_ms = float(launch_ms)
        self.cands = cands
        self.grid = grid
        self.blocks = list(blocks)
        self.comp = list(comp_ms)
        self.bw = float(bw_blocks_per_ms)
        self.n_layers = len(self.comp)
        self.compute_ms = sum(self.comp)
        self.rms = grid.recompute_ms_per_token
        self._rms_prefix = [0.0, *accumulate(self.rms)]
        self._on_gpu = [sum(row) for row in cands.rows]
        self.grid_options: list[tuple[tuple[int, int], ...]] = []
        """Per request, its ``(u, k)`` of the grid (``(0, 0)`` first). Option ``j`` of request
        ``r`` is layout ``j // G`` with ``grid_options[r][j % G]`` (``G`` its length), except
        that ``(all, u, 0)`` is ``(all, 0, 0)`` (the prefix fetched with the rest)."""
        self._pos: list[dict[tuple[int, int], int]] = []
        self.mem: list[list[int]] = []
        """Per request and option, every GPU block it needs."""
        self.volume: list[list[int]] = []
        """Per request and option, blocks fetched per step."""
        self.recompute_ms: list[list[float]] = []
        """Per request and option, the compute its recompute adds."""
        for b in self.blocks:
            self._add_request(b)
        self.min_mem = [min(m) for m in self.mem]
        self._built: list[dict[int, JointOption]] = [{} for _ in self.blocks]
        self.evaluations = 0

    def _add_request(self, b: int) -> None:
        """Closed forms per option (``docs/recompute.md``): with ``cb = b - u`` and ``m``
        offloaded layers, staging is ``cb + u [k < L]`` (``u [k < L]`` alone when ``m = 0``),
        volume ``cb m + u (L - k)``."""
        n_layers, bs = self.n_layers, self.grid.block_size
        opts = tuple((u, k if u else 0) for u, k in self.grid.options(b))
        self.grid_options.append(opts)
        self._pos.append({uk: i for i, uk in enumerate(opts)})
        pre = [
            (b - u, u if k else 0, u if u and k < n_layers else 0, u * (n_layers - k))
            for u, k in opts
        ]
        mem: list[int] = []
        volume: list[int] = []
        for on_gpu in self._on_gpu:
            m = n_layers - on_gpu
            if m:
                mem += [cb * (on_gpu + 1) + sp + t for cb, t, sp, _ in pre]
            else:
                mem += [cb * on_gpu + sp + t for cb, t, sp, _ in pre]
            volume += [cb * m + vp for cb, _, _, vp in pre]
        rec = [u * bs * self._rms_prefix[k] for u, k in opts]
        self.mem.append(mem)
        self.volume.append(volume)
        self.recompute_ms.append(rec * self.cands.size)

    def n_options(self, r: int) -> int:
        """How many options request ``r`` has."""
        return len(self.mem[r])

    def spec(self, r: int, j: int) -> tuple[int, int, int]:
        """``(layout, u, k)`` of option ``j`` of request ``r``."""
        opts = self.grid_options[r]
        c, i = divmod(j, len(opts))
        u, k = opts[i]
        if u and not k and c == self.cands.size - 1:  # (all, u, 0) is (all, 0, 0)
            return c, 0, 0
        return c, u, k

    def index_of(self, r: int, layout: int, u: int, k: int) -> int | None:
        """The option of request ``r`` with this layout and ``(u, k)`` (None when ``(u, k)``
        is not in its grid)."""
        i = self._pos[r].get((u, k if u else 0))
        return None if i is None else layout * len(self.grid_options[r]) + i

    def layout_options(self, r: int, layout: int) -> range:
        """The options of request ``r`` with ``layout``."""
        g = len(self.grid_options[r])
        return range(layout * g, (layout + 1) * g)

    def option(self, r: int, j: int) -> JointOption:
        """Option ``j`` of request ``r`` with its per-layer fetches (built once)."""
        opt = self._built[r].get(j)
        if opt is None:
            c, u, k = self.spec(r, j)
            b = self.blocks[r]
            row = self.cands.rows[c]
            sizes = fetch_sizes(row, b, u, k)
            tokens = u * self.grid.block_size if k else 0
            opt = self._built[r][j] = JointOption(
                layout=c,
                u=u,
                k=k,
                resident=(b - u) * self._on_gpu[c],
                staging=request_staging_blocks(row, b, u, k),
                transient=u if k else 0,
                fetches=tuple((layer, f) for layer, f in enumerate(sizes) if f > 0),
                cum=tuple(accumulate(sizes)),
                tokens=tokens,
                recompute_ms=tokens * self._rms_prefix[k],
            )
        return opt

    # --- what an assignment is ------------------------------------------------------------
    def chosen(self, assign: Sequence[int]) -> list[JointOption]:
        """The options of a joint assignment."""
        return [self.option(r, o) for r, o in enumerate(assign)]

    def memory(self, assign: Sequence[int]) -> int:
        """Resident + staging + transient blocks."""
        return sum(self.mem[r][o] for r, o in enumerate(assign))

    def split_memory(self, assign: Sequence[int]) -> tuple[int, int, int]:
        """(resident, staging, transient) blocks."""
        opts = self.chosen(assign)
        return (
            sum(o.resident for o in opts),
            sum(o.staging for o in opts),
            sum(o.transient for o in opts),
        )

    def from_layouts(self, layouts: Sequence[int]) -> tuple[int, ...]:
        """The joint assignment of candidate layouts without recompute."""
        return tuple(c * len(self.grid_options[r]) for r, c in enumerate(layouts))

    def compute(self, opts: Sequence[JointOption]) -> list[float]:
        """Per layer, the compute with the options' recompute added."""
        comp = list(self.comp)
        rms = self.rms
        for o in opts:
            if o.tokens:
                for layer in range(o.k):
                    comp[layer] += o.tokens * rms[layer]
        return comp

    # --- exact ----------------------------------------------------------------------------
    def exact_ms(self, assign: Sequence[int], cutoff: float = math.inf) -> float:
        """Exact step time (``docs/recompute.md``); ``math.inf`` once it reaches ``cutoff``."""
        self.evaluations += 1
        opts = self.chosen(assign)
        return fetch_timeline_ms(
            [o.fetches for o in opts], self.compute(opts), self.bw, cutoff=cutoff, launch_ms=self.launch_ms
        )

    # --- bounds ---------------------------------------------------------------------------
    def chain_ms(self, option: JointOption, prefix: Sequence[float]) -> float:
        """Stall of ``option``'s own fetch chain with the whole link (``prefix``: prefix sums
        of the compute, ``prefix[l]`` = compute of layers ``< l``)."""
        stall = 0.0
        start = 0  # first layer after the slot's previous user
        for layer, size in option.fetches:
            late = size / self.bw - (prefix[layer] - prefix[start])
            if late > 0:
                stall += late
            start = layer + 1
        return stall

    def bound_parts(
        self, opts: Sequence[JointOption]
    ) -> tuple[list[float], list[float], float]:
        """(compute per layer, cumulative fetched blocks per layer, largest chain bound
        ``sum comp + stall``)."""
        comp = self.compute(opts)
        work = [0.0] * self.n_layers
        for o in opts:
            if o.fetches:
                work = [w + c for w, c in zip(work, o.cum, strict=True)]
        prefix = [0.0, *accumulate(comp)]
        chain = max((self.chain_ms(o, prefix) for o in opts), default=0.0)
        return comp, work, prefix[-1] + chain

    def bound_from(self, comp: Sequence[float], work: Sequence[float], chain: float) -> float:
        """``max(sum comp, chain, max_l W_l / bw + suffix_l)`` (``chain``: a chain bound
        ``sum comp' + stall``, possibly with less compute ``comp'``: the chain bound only grows
        when compute is added, since a stall shrinks by at most the compute added before it)."""
        total = 0.0
        best = 0.0
        inv = 1.0 / self.bw
        for layer in range(self.n_layers - 1, -1, -1):
            total += comp[layer]
            term = work[layer] * inv + total
            if term > best:
                best = term
        return max(best, total, chain)

    def lower_bound_ms(self, assign: Sequence[int]) -> float:
        """A valid lower bound on :meth:`exact_ms` (compute, aggregate link, chains)."""
        return self.bound_from(*self.bound_parts(self.chosen(assign)))

    def volume_bound_ms(self, recompute_ms: float, volume: float) -> float:
        """``max(sum comp + recompute, V / bw + comp[L-1])`` in O(1) (ordering moves)."""
        return max(self.compute_ms + recompute_ms, volume / self.bw + self.comp[-1] if volume else 0.0)
