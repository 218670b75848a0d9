"""RecomputeRequests: which decoding requests recompute an uncached prefix this step (eLLM).

Called after SGLang built the step's batch and before the residency wants are installed
(AROUND ``Scheduler.get_next_batch_to_run``, :mod:`sglang_ext.scheduler_hooks`), on every TP rank
(the choice depends only on the request, so every rank makes the same one):

- a decode batch's request with ``custom_params.kvplane_recompute_ratio`` (``recompute_param``),
  or any request under ``--kv-recompute-ratio``, is *forced*: ``(u, k)`` with ``u = floor(ratio *
  prompt_tokens / page_size)`` pages (at most all but the page being decoded), fixed at its first
  decode step, and ``k`` recomputed layers;
- every other request takes the control plane's plan (``PlacementInstaller.planned_recompute``,
  from ``Plan.recompute_blocks`` / ``recompute_layers``): the planned ``u`` counts pages at the
  plan window's end, so each step it is clamped to the request's current pages - 1 (the prefix
  may reach into generated tokens: its ids are the prompt's and then the output's); a request the
  plan leaves out recomputes nothing;
- the installer's wants keep those ``u`` pages in no device layer
  (:attr:`PlacementInstaller.uncached`);
- the layered attention backend receives ``recompute_inputs[rid] = (u, k, token ids of the
  prefix)``: it appends the prefix tokens to the forward (``docs/recompute.md``).

Nothing is chosen when the layered pool has no host tier (every layer of the slot space on the
device: ``SlotStoreConfig.host_tier``): an uncached prefix would save nothing there.

Work per step is proportional to the batch (a few dict lookups per request); a request's prefix
ids are cut once per ``(u, k)`` it takes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sglang_ext.recompute_param import recompute_forced, recompute_request


class RecomputeRequests:
    """Per-scheduler recompute choices (module docstring)."""

    def __init__(self, *, layers: int, page_size: int, installer: Any, backend: Any,
                 default_ratio: float = 0.0, default_layers: int | None = None) -> None:
        self.layers = layers
        self.default_ratio = default_ratio
        """``--kv-recompute-ratio`` (a request's ``custom_params`` override it)."""
        self.default_layers = default_layers
        self.page_size = page_size
        self.installer = installer
        store = getattr(getattr(installer, "pool", None), "store", None)
        host_tier = getattr(store, "host_tier", True)
        self.backend = backend if hasattr(backend, "recompute_inputs") and host_tier else None
        """None without the layered backend, or when the layered pool has no host tier (every layer
        on the device, :attr:`SlotStoreConfig.host_tier`): a request's ``custom_params`` ratio and
        the plan's recompute are then not taken, and the worker reports it cannot recompute."""
        self._specs: dict[str, tuple[int, int, np.ndarray] | None] = {}
        self._forced: dict[str, bool] = {}
        """Per live request: forced (custom_params / launch flag) or planned, checked once."""
        self.steps = 0
        """Decode steps that recomputed something."""
        self._recomputing = False
        """The last decode step recomputed for someone (its uncached prefixes must be undone when
        they leave: the full path runs)."""

    @property
    def enabled(self) -> bool:
        return self.backend is not None and getattr(self.installer, "layered", False)

    @property
    def plannable(self) -> bool:
        """Whether the control plane's recompute can reach the forward: enabled, the backend's
        decode runs recompute rows, and ``--kv-recompute-ratio`` does not force every request
        (the worker reports its recompute cost only then, ``sglang_ext/worker_info.py``)."""
        return self.enabled and bool(getattr(self.backend, "recompute_ok", False)) and not self.default_ratio

    def prepare(self, plan: Any) -> None:
        """This step's recompute inputs and uncached prefixes (after SGLang built the batch)."""
        if not self.enabled:
            return
        batch = getattr(plan, "batch_to_run", plan)
        backend: Any = self.backend  # not None: enabled
        if batch is None or not batch.forward_mode.is_decode():
            if backend.recompute_inputs:
                backend.recompute_inputs = {}
            return
        specs, forced_of = self._specs, self._forced
        planned = self.installer.planned_recompute
        if not planned and not self._recomputing and self._nobody_forced(batch.reqs):
            if backend.recompute_inputs:
                backend.recompute_inputs = {}
            return  # the usual step: a few dict lookups, no per-request install
        inputs: dict[str, tuple[int, int, np.ndarray]] = {}
        live: dict[str, tuple[int, int, np.ndarray] | None] = {}
        for req in batch.reqs:
            rid = req.rid
            if self._forced_flag(req):
                spec = specs[rid] if rid in specs else self._spec(req)
            else:
                spec = self._planned(req, planned.get(rid), specs.get(rid))
            live[rid] = spec
            if spec is not None:
                inputs[rid] = spec
            self.installer.set_uncached(rid, 0 if spec is None else spec[0])
        for rid in specs.keys() - live.keys():  # finished, aborted or paused: chosen again later
            self.installer.set_uncached(rid, 0)
            forced_of.pop(rid, None)
        self._specs = live
        self._recomputing = bool(inputs)
        backend.recompute_inputs = inputs
        self.steps += bool(inputs)

    def _nobody_forced(self, reqs: list) -> bool:
        """Whether no request of the batch forces recompute (each request's parameters read once;
        entries of requests that left are pruned once the table is twice the batch)."""
        forced_of = self._forced
        forced = False
        get = forced_of.get
        for req in reqs:
            got = get(req.rid)
            forced = (self._forced_flag(req) if got is None else got) or forced
        if len(forced_of) > 2 * len(reqs) + 64:
            live = {req.rid for req in reqs}
            for rid in [r for r in forced_of if r not in live]:
                del forced_of[rid]
        return not forced

    def _forced_flag(self, req: Any) -> bool:
        """Whether ``req`` forces its ratio (custom_params or the launch flag), read once."""
        got = self._forced.get(req.rid)
        if got is None:
            got = self._forced[req.rid] = recompute_forced(self._params(req), self.default_ratio)
        return got

    @staticmethod
    def _params(req: Any) -> Any:
        return getattr(getattr(req, "sampling_params", None), "custom_params", None)

    def _planned(self, req: Any, plan: tuple[int, int] | None,
                 last: tuple[int, int, np.ndarray] | None) -> tuple[int, int, np.ndarray] | None:
        """The plan's ``(u, k)`` for ``req`` this step: ``u`` clamped to its pages - 1 (the plan
        sizes blocks at its window's end), the prefix ids re-cut only when ``u`` changes."""
        if plan is None:
            return None
        prompt, out = req.origin_input_ids, req.output_ids
        ps = self.page_size
        pages = -(-(len(prompt) + len(out)) // ps)
        u = min(plan[0], pages - 1)
        if u <= 0:
            return None
        k = min(plan[1], self.layers)
        if last is not None and last[0] == u:
            return last if last[1] == k else (u, k, last[2])
        n = u * ps
        ids = prompt[:n] if n <= len(prompt) else [*prompt, *out[: n - len(prompt)]]
        return u, k, np.asarray(ids, dtype=np.int64)

    def _spec(self, req: Any) -> tuple[int, int, np.ndarray] | None:
        asked = recompute_request(self._params(req), self.layers, self.default_ratio, self.default_layers)
        if asked is None:
            return None
        ratio, k = asked
        prompt = req.origin_input_ids
        ps = self.page_size
        context = len(prompt) + len(req.output_ids)
        pages = -(-context // ps)
        u = min(int(ratio * len(prompt)) // ps, pages - 1)
        if u <= 0:
            return None
        return u, k, np.asarray(prompt[: u * ps], dtype=np.int64)
