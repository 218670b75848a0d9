"""RecomputeRequests: which decoding requests recompute an uncached prefix this step (eLLM).

Called after SGLang built the step's batch and before the residency wants are installed
(AROUND ``Scheduler.get_next_batch_to_run``, :mod:`sglang_ext.scheduler_hooks`), on every TP rank
(the choice depends only on the request, so every rank makes the same one):

- a decode batch's request with ``custom_params.kvplane_recompute_ratio`` (``recompute_param``),
  or any request under ``--kv-recompute-ratio``, gets ``(u, k)``: ``u = floor(ratio * prompt_tokens / page_size)`` pages (at most all but the
  page being decoded), fixed at its first decode step, and ``k`` recomputed layers;
- the installer's wants keep those ``u`` pages in no device layer
  (:attr:`PlacementInstaller.uncached`);
- the layered attention backend receives ``recompute_inputs[rid] = (u, k, token ids of the
  prefix)``: it appends the prefix tokens to the forward (``docs/recompute.md``).

Work per step is proportional to the batch (one dict lookup per request); a request's prefix
ids are cut once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sglang_ext.recompute_param import recompute_request


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
        self.backend = backend if hasattr(backend, "recompute_inputs") else None
        self._specs: dict[str, tuple[int, int, np.ndarray] | None] = {}
        self.steps = 0
        """Decode steps that recomputed something."""

    @property
    def enabled(self) -> bool:
        return self.backend is not None and getattr(self.installer, "layered", False)

    def prepare(self, plan: Any) -> None:
        """This step's recompute inputs and uncached prefixes (after SGLang built the batch)."""
        if not self.enabled:
            return
        batch = getattr(plan, "batch_to_run", plan)
        backend = self.backend
        if batch is None or not batch.forward_mode.is_decode():
            if backend.recompute_inputs:
                backend.recompute_inputs = {}
            return
        specs = self._specs
        inputs: dict[str, tuple[int, int, np.ndarray]] = {}
        live: dict[str, tuple[int, int, np.ndarray] | None] = {}
        for req in batch.reqs:
            rid = req.rid
            spec = specs[rid] if rid in specs else self._spec(req)
            live[rid] = spec
            if spec is not None:
                inputs[rid] = spec
                self.installer.set_uncached(rid, spec[0])
        for rid in specs.keys() - live.keys():  # finished, aborted or paused: chosen again later
            self.installer.set_uncached(rid, 0)
        self._specs = live
        backend.recompute_inputs = inputs
        self.steps += bool(inputs)

    def _spec(self, req: Any) -> tuple[int, int, np.ndarray] | None:
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        asked = recompute_request(params, self.layers, self.default_ratio, self.default_layers)
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
