"""ModelSupport: the model features ``--enable-layered-kv`` cannot serve, refused at launch.

The layered pool holds per-head K and V pages of every attention layer (MHA / GQA) in one pool,
and its attention backends apply what a layer's ``RadixAttention`` carries (scale, soft cap,
sliding window). A model needing anything else would fail after its weights load, with a message
about the pool class, or -- worse -- decode wrong without a word. So the launcher reads the
model's config through SGLang's own ``ModelConfig`` (as the scheduler will) and refuses, in one
line naming the feature and the model:

- **MLA** (DeepSeek-V2/V3, Kimi-K2, ...): the KV is one compressed latent per token, not per-head
  K/V pages.
- **Recurrent state** (hybrid SSM / linear-attention models: Qwen3-Next, Falcon-H1, Mamba, ...):
  SGLang keeps conv/SSM state beside the KV, which no layered placement covers.
- **Hybrid sliding-window memory** (gpt-oss, Llama-4, ...): SGLang serves these from two KV pools;
  the layered pool is one. ``--disable-hybrid-swa-memory`` gives one pool, and the window is then
  applied in attention (so a hybrid-SWA model without sinks is served with that flag).
- **Attention sinks** (gpt-oss, Granite-SWA, ...): per-head softmax sinks reach the attention call
  as an argument that the layered backends do not apply.
- **A head_dim over 256 where kvplane's Triton kernels serve** (:data:`kernels.paged_decode.MAX_HEAD_DIM`;
  the extend of the ``flashinfer`` and ``triton`` backends, the ``triton`` decode, on a GPU or
  under ``TRITON_INTERPRET=1``): their tiles would not fit a block's shared memory (FlashInfer's
  decode stops at 256 too). The ``torch_native`` backend takes any head_dim.
- **Chunked local attention** (Llama-4's ``attention_chunk_size``): its chunked layers carry no
  window the layered backends apply, so they would attend over the whole context.
- **K and V head dims that differ** (``has_asymmetric_kv``: MiMo-V2): the pool holds K and V
  pages of one head dim.
- **KV-shared layers** (Gemma-3n / Gemma-4 ``num_kv_shared_layers``): a layer reading another
  layer's KV would run that layer's fetch and write-back pipeline twice in one step. Gemma-3n and
  Gemma-4 are refused by name (:data:`PER_LAYER_KV_SHAPES`): their sliding and global layers also
  differ in KV head counts and head dims.
- **Architectures SGLang refuses on FlashInfer** (:data:`NO_FLASHINFER`: Olmo2, Exaone-4 with
  sliding windows): with no ``--attention-backend`` the launcher serves them on the layered
  ``triton`` backend instead of its ``flashinfer`` default, and says so; an explicit
  ``--attention-backend flashinfer`` is refused naming ``triton``.
- **Encoder-decoder models** (``is_encoder_decoder``: Whisper, Mllama, MossVL): SGLang puts a
  request's encoder slots ahead of its decoder's in its ``req_to_token`` row and reads
  self-attention from past them; kvplane's tables start at the row's head, so decoder layers read
  the encoder's KV (attention review, session 64: off by 1.3-5.5 against SGLang's own backend).
- **Bidirectional prompt attention** (:data:`BIDIRECTIONAL_PROMPT`, EmbeddingGemma's
  ``use_bidirectional_attention``): SGLang's Triton backend drops the causal mask at prefill;
  kvplane's extend keeps it (off by 2.2 on a 6-token prompt).
- **A checkpoint-quantized KV cache** (ModelOpt / compressed-tensors FP8 KV): with
  ``--kv-cache-dtype auto`` SGLang would store KV in fp8, which the layered pool does not hold
  (``--kv-cache-dtype fp8_*`` is refused by the flag check; ``LayeredTokenToKVPool`` refuses an
  fp8 dtype however it was reached).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kernels.paged_decode import MAX_HEAD_DIM
from sglang_ext import compat

BIDIRECTIONAL_PROMPT = ("HrmTextForCausalLM", "DiffusionGemmaForBlockDiffusion")
"""Architectures whose SGLang models build every attention layer ``DECODER_BIDIRECTIONAL``
(EmbeddingGemma's does so under ``use_bidirectional_attention``, read from its config)."""


def bidirectional_prompt(architecture: str, text_config: Any) -> bool:
    """Whether SGLang builds the model's attention ``DECODER_BIDIRECTIONAL``."""
    return architecture in BIDIRECTIONAL_PROMPT or bool(getattr(text_config, "use_bidirectional_attention", False))


@dataclasses.dataclass(frozen=True)
class ModelSupport:
    """What the launcher needs to know of a model to refuse it (module docstring)."""

    architecture: str
    """The model's architecture name (``config.json``'s ``architectures[0]``)."""
    mla: bool = False
    recurrent_state: bool = False
    hybrid_swa_memory: bool = False
    """SGLang would build two KV pools (False under ``--disable-hybrid-swa-memory``)."""
    sinks: bool = False
    kv_quant: str | None = None
    """The checkpoint's KV-cache quantization (``"FP8"``), None when it has none."""
    kv_cache_dtype: str = "auto"
    """``--kv-cache-dtype``: a checkpoint's KV quantization applies only under ``auto``."""
    head_dim: int = 0
    """The attention layers' head dim (SGLang's ``ModelConfig.head_dim``)."""
    triton_backend: str | None = None
    """The flag and attention backend whose layered version runs kvplane's Triton kernels
    (:func:`triton_kernel_backend`: ``--attention-backend flashinfer``), None when none does."""
    attention_chunk_size: int | None = None
    """Llama-4's chunked local attention span (None: none)."""
    asymmetric_kv: bool = False
    """K and V head dims differ (SGLang's ``ModelConfig.has_asymmetric_kv``)."""
    kv_shared_layers: int = 0
    """Layers that read another layer's KV (``num_kv_shared_layers``)."""
    encoder_decoder: bool = False
    """SGLang's ``ModelConfig.is_encoder_decoder`` (Whisper, Mllama, MossVL): a request's row holds
    its encoder's slots before its decoder's, which kvplane's self-attention tables do not skip."""
    bidirectional_prompt: bool = False
    """Prompt attention without the causal mask (``AttentionType.DECODER_BIDIRECTIONAL``: HRM-Text,
    DiffusionGemma, EmbeddingGemma's ``use_bidirectional_attention``); kvplane's extend is causal."""

    @classmethod
    def from_model_config(cls, model_config: Any, kv_cache_dtype: str | None,
                          triton_backend: str | None = None) -> ModelSupport:
        """From SGLang's ``ModelConfig`` of the launch (``ModelConfig.from_server_args``) and
        :func:`triton_kernel_backend` of its server arguments."""
        arch = compat.resolve(compat.ATTENTION_ARCH.path)
        uses_ssm_state = compat.resolve(compat.USES_SSM_STATE.path)
        architectures = getattr(model_config.hf_config, "architectures", None) or ["?"]
        text = getattr(model_config, "hf_text_config", model_config.hf_config)
        return cls(
            architecture=str(architectures[0]),
            mla=model_config.attention_arch == arch.MLA,
            recurrent_state=model_config.attention_arch != arch.MHA or bool(uses_ssm_state(model_config)),
            hybrid_swa_memory=bool(model_config.is_hybrid_swa),
            sinks=bool(model_config.has_attention_sinks),
            kv_quant=_kv_quant(model_config._parse_quant_hf_config()) or _modelopt_file_kv_quant(
                getattr(model_config, "model_path", None)),
            kv_cache_dtype=str(kv_cache_dtype or "auto"),
            head_dim=int(getattr(model_config, "head_dim", 0) or 0),
            triton_backend=triton_backend,
            attention_chunk_size=getattr(model_config, "attention_chunk_size", None) or None,
            asymmetric_kv=bool(getattr(model_config, "has_asymmetric_kv", False)),
            kv_shared_layers=int(getattr(text, "num_kv_shared_layers", 0) or 0),
            encoder_decoder=bool(getattr(model_config, "is_encoder_decoder", False)),
            bidirectional_prompt=bidirectional_prompt(str(architectures[0]), text),
        )

    def refusal(self) -> str | None:
        """The launch refusal (one line, naming the feature and the model), or None."""
        model = self.architecture
        if self.encoder_decoder:
            return (f"{model} is an encoder-decoder model (its requests' slots start with the encoder's, "
                    "and cross-attention reads them): not supported with --enable-layered-kv")
        if self.bidirectional_prompt:
            return (f"{model} attends over its prompt bidirectionally (no causal mask at prefill), which the "
                    "layered attention backends do not apply: not supported with --enable-layered-kv")
        if self.mla:
            return (f"{model} uses MLA attention (one compressed latent KV per token): --enable-layered-kv "
                    "places per-head K/V pages and supports MHA / GQA models only")
        if self.recurrent_state:
            return (f"{model} keeps recurrent (SSM / linear-attention) state beside its KV: hybrid and "
                    "state-space models are not supported with --enable-layered-kv")
        if self.sinks:
            return (f"{model} uses attention sinks, which the layered attention backends do not apply: "
                    "not supported with --enable-layered-kv")
        if self.attention_chunk_size:
            return (f"{model} uses chunked local attention (attention_chunk_size {self.attention_chunk_size}), "
                    "which the layered attention backends do not apply: not supported with --enable-layered-kv")
        if self.architecture.startswith(PER_LAYER_KV_SHAPES):
            return (f"{model} gives its sliding-window and global layers different KV shapes (head counts, "
                    "head dims) and shares KV across layers, and the layered KV pool holds pages of one "
                    "shape per layer-page: not supported with --enable-layered-kv")
        if self.kv_shared_layers:
            return (f"{model} has {self.kv_shared_layers} layers that read another layer's KV "
                    "(num_kv_shared_layers), which the layered pool places per layer: not supported with "
                    "--enable-layered-kv")
        if self.asymmetric_kv:
            return (f"{model} has K and V head dims that differ, and the layered KV pool holds pages of one "
                    "head dim: not supported with --enable-layered-kv")
        if self.hybrid_swa_memory:
            return (f"{model} is a hybrid sliding-window model, which SGLang serves from two KV pools; "
                    "the layered KV pool is one: add --disable-hybrid-swa-memory (the window is then "
                    "applied in attention)")
        if self.triton_backend is not None and self.head_dim > MAX_HEAD_DIM:
            return (f"{model} has head_dim {self.head_dim}: kvplane's Triton attention kernels, which serve "
                    f"{self.triton_backend} under --enable-layered-kv, take head_dim up to "
                    f"{MAX_HEAD_DIM} (their tiles would not fit a GPU's shared memory); --attention-backend "
                    "torch_native serves any head_dim")
        if self.kv_quant is not None and self.kv_cache_dtype == "auto":
            return (f"{model}'s checkpoint quantizes the KV cache ({self.kv_quant}), so --kv-cache-dtype "
                    "auto would store it in fp8: quantized KV caches are not supported with "
                    "--enable-layered-kv; pass --kv-cache-dtype bfloat16 to keep the KV unquantized")
        return None


PER_LAYER_KV_SHAPES = ("Gemma4", "Gemma3n")
"""Architecture prefixes whose layers differ in KV shape or share KV (SGLang's ``gemma4_causal``:
``swa_num_key_value_heads``, ``num_kv_shared_layers``), refused by name."""

NO_FLASHINFER = frozenset({"Olmo2ForCausalLM", "Exaone4ForCausalLM", "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM"})
"""Architectures SGLang 0.5.23 asserts against FlashInfer for (``arg_groups/model_hook.py``:
Olmo2 always, Exaone-4 with a sliding-window pattern; both take ``triton``)."""


def refuses_flashinfer(model_config: Any) -> bool:
    """Whether SGLang's launch would assert against ``--attention-backend flashinfer`` for this model."""
    hf = model_config.hf_config
    arch = str((getattr(hf, "architectures", None) or ["?"])[0])
    if arch.startswith("Exaone"):
        return arch in NO_FLASHINFER and getattr(hf, "sliding_window_pattern", None) is not None
    return arch in NO_FLASHINFER


def triton_kernel_backend(server_args: Any, environ: Mapping[str, str]) -> str | None:
    """The flag and backend of ``server_args`` (``--attention-backend`` and its prefill / decode
    variants: ``"--prefill-attention-backend triton"``) whose layered version runs kvplane's Triton
    kernels -- ``flashinfer`` or ``triton`` on a GPU, ``triton`` on the CPU under
    ``TRITON_INTERPRET=1`` (without it the CPU runs the kernels' torch references) -- or None."""
    names = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    chosen = [f"--{n.replace('_', '-')} {b}" for n in names
              if (b := getattr(server_args, n, None)) in ("flashinfer", "triton")]
    if not chosen:
        return None
    if getattr(server_args, "device", None) == "cpu" and environ.get("TRITON_INTERPRET", "0") != "1":
        return None
    return chosen[0]


def _kv_quant(quant: Any) -> str | None:
    """The KV quantization of SGLang's parsed quantization dict that makes SGLang store KV in fp8
    under ``--kv-cache-dtype auto`` (``configure_kv_cache_dtype``): ModelOpt's
    ``kv_cache_quant_algo`` ``FP8`` (other values keep the model's dtype), or a compressed-tensors
    ``kv_cache_scheme`` that SGLang takes (static symmetric per-tensor 8-bit float,
    ``CompressedTensorsKVCacheMethod.is_supported_scheme``)."""
    if not isinstance(quant, dict):
        return None
    algo = quant.get("kv_cache_quant_algo")
    if isinstance(algo, str) and algo.upper() == "FP8":
        return "FP8"
    scheme = quant.get("kv_cache_scheme")
    if (isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
            and scheme.get("strategy") == "tensor" and scheme.get("symmetric", True)
            and not scheme.get("dynamic", False)):
        return "FP8, compressed-tensors kv_cache_scheme"
    if str(quant.get("quant_method", "")).lower().startswith("modelopt") and (  # ModelOpt's flat exports
            (isinstance(scheme, str) and scheme.upper() == "FP8")
            or (isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8)):
        return "FP8, ModelOpt kv_cache_scheme"
    return None


def _modelopt_file_kv_quant(model_path: Any) -> str | None:
    """ModelOpt's standalone ``hf_quant_config.json`` (older FP8 checkpoints): SGLang's parsed dict
    drops its ``kv_cache_quant_algo``, its ``ModelOptFp8Config`` reads it from the file."""
    if not model_path:
        return None
    path = Path(str(model_path)) / "hf_quant_config.json"
    try:
        quant = json.loads(path.read_text()).get("quantization") if path.is_file() else None
    except (OSError, ValueError):
        return None
    return _kv_quant(quant)
