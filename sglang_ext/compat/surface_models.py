"""The SGLang model-config objects the launcher reads to refuse models it cannot serve
(``sglang_ext/model_support.py``), the device SGLang gives a launch without ``--device``, and the
attention layer (``RadixAttention``) whose parameters the layered backends read.

Part of :mod:`sglang_ext.compat.surface` (imported there, so in its ``TARGETS``).
"""

from __future__ import annotations

from sglang_ext.compat.target import Target

_SRT = "sglang.srt"

MODEL_CONFIG_SUPPORT = Target(
    f"{_SRT}.configs.model_config.ModelConfig",
    attrs=("attention_arch", "is_hybrid_swa", "has_attention_sinks", "hf_config", "hf_text_config",
           "_parse_quant_hf_config", "model_path", "is_multimodal", "model_is_mrope", "use_ngram_embedding",
           "use_engram"),
    used_by=("model_support", "recompute_forward"),
)
"""``attention_arch`` (MHA / MLA / SSM), ``is_hybrid_swa`` (already False under
``--disable-hybrid-swa-memory``), ``has_attention_sinks``, the architecture name and the private
``_parse_quant_hf_config`` (the checkpoint's quantization dict, as SGLang reads it); ``is_multimodal``,
``model_is_mrope``, ``use_ngram_embedding`` and ``use_engram``, where eLLM's recompute rows cannot rebuild a prefix's KV from its token ids
(``RecomputeForward.inputs_reason``)."""
ATTENTION_ARCH = Target(f"{_SRT}.configs.model_config.AttentionArch", attrs=("MHA", "MLA"),
                        used_by=("model_support",))
USES_SSM_STATE = Target(f"{_SRT}.mem_cache.kv_cache_builder.uses_ssm_state", params=("model_config",),
                        used_by=("model_support",))
"""SGLang's own test for a model keeping recurrent (SSM / linear-attention) state beside its KV."""
DEFAULT_DEVICE = Target(f"{_SRT}.utils.common.get_device", params=("device_id",), used_by=("plugin",))
"""What SGLang resolves an unset ``--device`` to (after the launcher's decision: ``cpu`` under
``SGLANG_USE_CPU_ENGINE``, ``xpu``/``npu``/... on those hosts), so the decision is for that device."""
RADIX_ATTENTION = Target(
    f"{_SRT}.layers.radix_attention.RadixAttention",
    attrs=("layer_id", "is_cross_attention", "tp_q_head_num", "tp_k_head_num", "qk_head_dim", "v_head_dim",
           "scaling", "logit_cap", "sliding_window_size", "logit_capping_method", "xai_temperature_len",
           "attn_type"),
    used_by=("layered_attention", "layered_pool", "recompute_forward", "layered_triton_decode", "layered_paged_decode",
             "layered_graph_decode", "layered_flashinfer_decode", "dataplane.flashinfer_attention"),
)
