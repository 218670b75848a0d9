"""The SGLang model-forward objects eLLM's recompute reaches into (``sglang_ext/recompute_forward.py``).

Part of :mod:`sglang_ext.compat.surface` (imported there, so in its ``TARGETS``): the step boundary
where the recompute rows join the forward's inputs, the logits processor that must not see them,
and the decoder-layer stack and residual stream where they are cut above their ``k``.
"""

from __future__ import annotations

from sglang_ext.compat.target import Target

_SRT = "sglang.srt"

EAGER_EXECUTE_DECODE = Target(
    f"{_SRT}.model_executor.runner.eager_runner.EagerRunner._execute_decode",
    params=("self", "forward_batch"),
    used_by=("recompute_forward",),
)
"""Calls ``attn_backend.init_forward_metadata(forward_batch)`` before the model reads
``forward_batch.input_ids`` / ``positions``: the recompute rows are appended there."""
LOGITS_PROCESSOR = Target(
    f"{_SRT}.layers.logits_processor.LogitsProcessor.forward",
    params=("self", "input_ids", "hidden_states"),
    used_by=("recompute_forward",),
)
"""A model's ``logits_processor`` (an instance attribute of the CausalLM) is wrapped to see only
the decode rows of a recompute step."""
LLAMA_MODEL = Target(f"{_SRT}.models.llama.LlamaModel", attrs=("layers", "start_layer"),
                     used_by=("recompute_forward",))
"""``model.model.layers``: each decoder layer but the first has its ``forward`` wrapped to cut the
rows of prefixes recomputed only below it (eLLM §4.3.1, ``docs/recompute.md``)."""
LLAMA_DECODER_LAYER = Target(f"{_SRT}.models.llama.LlamaDecoderLayer.forward",
                             params=("self", "positions", "hidden_states", "forward_batch"),
                             used_by=("recompute_forward",))
TRANSFORMERS_BASE = Target(f"{_SRT}.models.transformers.TransformersBase", used_by=("recompute_forward",))
"""SGLang's Transformers backend (``--model-impl transformers``, or ``auto`` for an architecture
SGLang has no model of): every such model class derives from it. Its decoder layers are Hugging
Face's, which recompute's per-layer cut does not bind: recompute is not offered there."""
RESIDUAL_STREAM = Target(f"{_SRT}.layers.layer_boundary.residual.stream.ResidualStream",
                         attrs=("residual", "pending", "transport"), used_by=("recompute_forward",))
"""``forward_batch.residual_stream`` between layers: its residual and pending contribution are cut
with the hidden states."""
RESIDUAL_CONTRIBUTION = Target(f"{_SRT}.layers.layer_boundary.residual.stream.Contribution",
                               attrs=("value", "update", "owed", "complete"), used_by=("recompute_forward",))
RESIDUAL_PLAIN_ADD = Target(f"{_SRT}.layers.layer_boundary.residual.add_norm.PlainAdd",
                            attrs=("is_plain_add", "applied_at_exit"), used_by=("recompute_forward",))
FORWARD_BATCH_RESIDUAL = Target(f"{_SRT}.model_executor.forward_batch_info.ForwardBatch",
                                attrs=("residual_stream",), used_by=("recompute_forward",))
