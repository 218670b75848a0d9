"""RecomputeCheck: `kvplane gpu-check`'s recompute path (eLLM, docs/recompute.md) on the served core.

On the :class:`~sglang_ext.tools.gpu_check_batch.CheckBatch` after the placed phase, every
request's first ``u`` pages (a quarter of its context, whole pages) leave the device
(``RequestResidency.uncached_pages``) with every cached layer resident; each decode step then
recomputes them at layers ``< k = L/2`` and fetches them above, as SGLang's forward does:

- per layer: the stand-in layer body (:class:`CoreCheck`'s QKV / output / gated MLP) runs on the
  decode rows *plus* the recompute rows still active at this layer (the recompute compute);
  ``write_recompute`` puts the prefix K/V into the transient pages (the regenerated prefill K/V:
  recomputation is exact) before the paged decode reads them through ``tab[l]``;
- the step time is compared with ``controlplane.model.step_time_ms(..., recompute=(u, k))``: per
  layer compute = the resident step / L, ``recompute_ms_per_token`` = the measured slope of the
  layer body over the prefix tokens (a separate timing), the link bandwidth of the transfer check;
- the attention over the recomputed prefix is compared with the dense reference.

The prefix rows' own causal attention (SDPA per request in SGLang's forward) is not run: it does
not touch kvplane's path and the model has no term for it.
"""

from __future__ import annotations

from typing import Any

import torch

from controlplane.model import step_time_ms
from sglang_ext.dataplane import dense_attention
from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.dataplane.slot_results import RequestResidency
from sglang_ext.tools.gpu_check_measure import BF16_ATOL, BF16_RTOL
from sglang_ext.tools.gpu_check_report import Figure

RECOMPUTE_SHARE = 0.25
"""Uncached share of each request's context (whole pages)."""
RECOMPUTE_REL_ERR = 0.25
"""Target: |measured - model| / model step time, recompute steps."""


class RecomputeCheck:
    """The recompute phase of :class:`~sglang_ext.tools.gpu_check_measure.CoreCheck`."""

    def __init__(self, check: Any) -> None:
        self.check = check
        b, c = check.batch, check.config
        ps = c.page_size
        self.k = max(1, c.layers // 2)
        self.u = [max(1, int(RECOMPUTE_SHARE * n) // ps) for n in b.lens]
        self.tokens = [u * ps for u in self.u]
        gen = torch.Generator(device="cpu").manual_seed(c.seed + 7)
        self.x_rec = (torch.randn((sum(self.tokens), c.hidden), generator=gen)).to(check.device, c.torch_dtype)
        self.details: dict[str, Any] = {"u_pages": self.u, "k": self.k}

    def _prefix_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix K/V of every request at ``layer``, in the recompute token order (one ``k``
        for all: batch order, ``RecomputeRows``)."""
        b = self.check.batch
        ks, vs = [], []
        for i, t in enumerate(self.tokens):
            k, v = b.prefill_kv(i, layer)
            ks.append(k[:t])
            vs.append(v[:t])
        return torch.cat(ks), torch.cat(vs)

    def _body(self, x: torch.Tensor) -> None:
        ch = self.check
        qkv = x @ ch.w_qkv
        hq = ch.config.q_heads * ch.config.head_dim
        gate_up = qkv[:, :hq] @ ch.w_o @ ch.w_gate_up
        i = ch.config.intermediate
        (torch.nn.functional.silu(gate_up[:, :i]) * gate_up[:, i:]) @ ch.w_down

    def step(self, capture: Any = None) -> None:
        """One decode step with the recompute rows (module docstring)."""
        ch, b = self.check, self.check.batch
        core = b.core
        recompute = torch.tensor([[u, self.k] for u in self.u], dtype=torch.int64).numpy()
        loc = b.begin_decode(recompute=recompute)
        rows = core.tables.recompute
        ch.backends.plan_step(core.tables.plan_view(b.layer_view(0)))  # host CSR, as serving plans
        idle, last = core.layers_idle, ch.config.layers - 1  # as served
        for layer in range(ch.config.layers):
            active = rows.active[layer]
            self._body(torch.cat([ch.x, self.x_rec[:active]]) if active else ch.x)
            if not idle:
                core.enter_layer(layer)
            core.write(layer, loc, b.k1, b.v1)
            if active:
                k, v = self.kv[layer]
                core.write_recompute(layer, k, v)
            view = b.layer_view(layer)
            out = ch.backends.run(ch.backends.primary, ch.q, view)
            if capture is not None:
                capture(layer, out)
            if not idle or layer == last:
                core.exit_layer(layer)

    def per_token_ms(self) -> float:
        """Measured slope of the layer body over the prefix tokens (ms per token per layer)."""
        ch = self.check
        n = self.x_rec.shape[0]
        with_rec = time_ms(lambda: self._body(torch.cat([ch.x, self.x_rec])), ch.device, ch.config.repeat)
        without = time_ms(lambda: self._body(ch.x), ch.device, ch.config.repeat)
        return max(with_rec - without, 0.0) / n

    def run(self, comp_ms: list[float], bw_blocks_per_ms: float) -> list[Figure]:
        ch, b, c = self.check, self.check.batch, self.check.config
        cuda = ch.device.startswith("cuda")
        b.core.update_residency({
            rid: RequestResidency(pages=b.pages(i), gpu_layers=(True,) * c.layers, planned=True,
                                  uncached_pages=min(self.u[i], len(b.pages(i)) - 1))
            for i, rid in enumerate(b.rids)
        })
        b.core.store.engine.quiesce()
        self.kv = [self._prefix_kv(layer) for layer in range(c.layers)]
        sync(ch.device)
        per_token = self.per_token_ms()
        measured = time_ms(self.step, ch.device, c.repeat)
        rows = [(1,) * c.layers for _ in b.rids]
        predicted = step_time_ms(rows, b.blocks(1), comp_ms, bw_blocks_per_ms,
                                 recompute=[(u, self.k) for u in self.u],
                                 recompute_ms_per_token=[per_token] * c.layers, block_size=c.page_size)
        err, tolerance = self._attention_error()
        rel = abs(measured - predicted) / predicted if predicted > 0 else float("inf")
        self.details.update({"step_ms": measured, "predicted_step_ms": predicted,
                             "recompute_ms_per_token": per_token, "attention_max_abs_err": err,
                             "recompute_tokens": sum(self.tokens)})
        cpu_note = "" if cuda else "CPU: copies are synchronous and the step is CPU compute; not meaningful"
        return [
            Figure.graded(
                "recompute_step_rel_err", "recompute step vs the placement model", rel, "ratio", "<=",
                RECOMPUTE_REL_ERR, f"every request's first {RECOMPUTE_SHARE:.0%} of pages recomputed at layers < "
                f"{self.k} and fetched above: |measured - step_time_ms(recompute)| / model; per-token recompute "
                "from the layer body's measured slope", meaningful=cuda,
                note=cpu_note or f"measured {measured:.3f} ms, model {predicted:.3f} ms"),
            Figure.graded(
                "recompute_attention_max_abs_err", "attention over recomputed prefixes vs dense reference", err,
                "abs", "<=", tolerance, "one recompute step, every layer: the decode rows read the transient "
                f"pages (layers < {self.k}) and the fetched prefix (above) through tab[l]; bf16 tolerance on "
                "the output's scale, as for the placed step"),
        ]

    def _attention_error(self) -> tuple[float, float]:
        """(max abs error, its bf16 tolerance) of one recompute step's attention, every layer."""
        ch, b = self.check, self.check.batch
        outs: list[torch.Tensor] = []
        self.step(capture=lambda layer, out: outs.append(out.float().clone()))
        sync(ch.device)
        q = ch.q.float()
        worst = ref_max = 0.0
        for layer, out in enumerate(outs):
            for i in range(len(b.rids)):
                k, v = b.reference_kv(i, layer)
                ref = dense_attention(q[i: i + 1], k, v)[0]
                worst = max(worst, float((out[i] - ref).abs().max()))
                ref_max = max(ref_max, float(ref.abs().max()))
        return worst, BF16_ATOL + BF16_RTOL * ref_max
