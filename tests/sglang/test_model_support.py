"""ModelSupport: models the layered pool cannot serve are refused at launch, naming the feature
and the model (issue 14, item 3), from SGLang's own ``ModelConfig`` of config-only model dirs.

Each unsupported model has a control that differs in the one feature and is accepted (a Llama,
the same gpt-oss under ``--disable-hybrid-swa-memory`` minus sinks, the fp8 checkpoint under an
explicit ``--kv-cache-dtype``). The launcher's path (one ``kvplane:`` line, exit 2, before any
weight loads) is ``test_launch_validation.py``'s; the pool's own fp8 refusal is here too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.sglang


@pytest.fixture(autouse=True)
def _environment_kept() -> Iterator[None]:
    """The environment as it was before each test: SGLang's model modules set variables when first
    imported (DeepSeek's: ``DG_JIT_*``, ``OMP_NUM_THREADS``, ``CUTE_DSL_CACHE_DIR``, ...). Left
    in ``os.environ``, every later server launch differed from the launch zygote's environment
    and ``test_launch_validation.py`` (run after this module) errored."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)

BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "intermediate_size": 64, "torch_dtype": "bfloat16"}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_key_value_heads": 4,
                    "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                    "v_head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "first_k_dense_replace": 2},
    "qwen3_next": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 4,
                   "head_dim": 16, "full_attention_interval": 4, "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32},
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": 16,
                "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32,
                "layer_types": ["sliding_attention", "full_attention"]},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 16,
               "attn_logit_softcapping": 50.0, "sliding_window": 32},
    "modelopt_flat_fp8": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                          "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                                  "kv_cache_scheme": {"dynamic": False, "num_bits": 8,
                                                                      "type": "float"}}},
    "modelopt_flat_str": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                          "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                  "kv_cache_scheme": "FP8", "group_size": 16}},
    "modelopt_flat_no_kv": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                            "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}},
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"},
    "exaone4_swa": {"architectures": ["Exaone4ForCausalLM"], "model_type": "exaone4", "head_dim": 16,
                    "sliding_window": 32, "sliding_window_pattern": "LLLG",
                    "layer_types": ["sliding_attention", "full_attention"]},
    "llama4_text": {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "num_hidden_layers": 4,
                    "head_dim": 16, "intermediate_size_mlp": 128, "num_local_experts": 2, "num_experts_per_tok": 1,
                    "attention_chunk_size": 32, "interleave_moe_layer_step": 1, "no_rope_layers": [1, 1, 1, 0]},
    "llama_head_dim_512": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 512},
    "llama_fp8_kv": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8",
                                             "kv_cache_quant_algo": "FP8"}},
    "llama_ct_fp8_kv": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                        "quantization_config": {"quant_method": "compressed-tensors", "config_groups": {},
                                                "kv_cache_scheme": {"type": "float", "num_bits": 8,
                                                                    "strategy": "tensor", "symmetric": True,
                                                                    "dynamic": False}}},
}


def model_dir(root: Path, name: str) -> Path:
    """A config-only model directory (what the launcher reads before any weight)."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**BASE, **CONFIGS[name]}))
    return path


def support(root: Path, name: str, *, kv_cache_dtype: str = "auto", disable_hybrid_swa_memory: bool = False,
            triton_backend: str | None = None):
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_ext.model_support import ModelSupport

    config = ModelConfig(str(model_dir(root, name)), disable_hybrid_swa_memory=disable_hybrid_swa_memory)
    return ModelSupport.from_model_config(config, kv_cache_dtype, triton_backend)


@pytest.mark.parametrize(("name", "fragment"), [
    ("deepseek_v3", "DeepseekV3ForCausalLM uses MLA attention (one compressed latent KV per token): "
                    "--enable-layered-kv places per-head K/V pages and supports MHA / GQA models only"),
    ("qwen3_next", "Qwen3NextForCausalLM keeps recurrent (SSM / linear-attention) state beside its KV"),
    ("gpt_oss", "GptOssForCausalLM uses attention sinks, which the layered attention backends do not apply"),
    ("llama_fp8_kv", "LlamaForCausalLM's checkpoint quantizes the KV cache (FP8), so --kv-cache-dtype auto "
                     "would store it in fp8"),
    ("llama_ct_fp8_kv", "quantizes the KV cache (FP8, compressed-tensors kv_cache_scheme)"),
    ("modelopt_flat_fp8", "quantizes the KV cache (FP8, ModelOpt kv_cache_scheme)"),
    ("modelopt_flat_str", "quantizes the KV cache (FP8, ModelOpt kv_cache_scheme)"),
])
def test_unsupported_models_are_refused_naming_feature_and_model(tmp_path: Path, name: str, fragment: str) -> None:
    refusal = support(tmp_path, name).refusal()
    assert refusal is not None and fragment in refusal and "\n" not in refusal


def test_a_standalone_modelopt_quant_file_with_fp8_kv_is_refused(tmp_path: Path) -> None:
    """Older ModelOpt FP8 checkpoints declare the KV quantization only in ``hf_quant_config.json``
    (SGLang's parsed dict drops it; its ModelOptFp8Config reads the file); without the KV entry
    the same checkpoint passes (control)."""
    path = model_dir(tmp_path / "kv", "llama")
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_ext.model_support import ModelSupport

    refusal = ModelSupport.from_model_config(ModelConfig(str(path)), "auto").refusal()
    assert refusal is not None and "quantizes the KV cache (FP8)" in refusal
    control = model_dir(tmp_path / "weights-only", "llama")
    (control / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}))
    assert ModelSupport.from_model_config(ModelConfig(str(control)), "auto").refusal() is None


@pytest.mark.parametrize(("quant", "expected"), [
    ({"kv_cache_quant_algo": "fp8"}, "FP8"),
    ({"kv_cache_quant_algo": "NVFP4"}, None),  # SGLang keeps the model's dtype for anything but FP8
    ({"kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor"}}, "FP8, compressed-tensors kv_cache_scheme"),
    ({"kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": True}}, None),
    ({"kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "channel"}}, None),
    ({"kv_cache_scheme": {"type": "int", "num_bits": 8, "strategy": "tensor"}}, None),
    (None, None),
])
def test_only_the_kv_quantizations_sglang_stores_in_fp8_count(quant, expected) -> None:
    """As SGLang's configure_kv_cache_dtype and is_supported_scheme decide (no false refusals)."""
    from sglang_ext.model_support import _kv_quant

    assert _kv_quant(quant) == expected


def test_supported_models_pass(tmp_path: Path) -> None:
    """Controls: a plain Llama; Gemma-2 (soft cap and sliding window are applied in attention); an
    fp8-KV checkpoint with an explicit unquantized --kv-cache-dtype."""
    llama = support(tmp_path, "llama")
    assert llama.refusal() is None and llama.architecture == "LlamaForCausalLM"
    assert not (llama.mla or llama.recurrent_state or llama.sinks or llama.hybrid_swa_memory or llama.kv_quant)
    assert support(tmp_path, "gemma2").refusal() is None
    assert support(tmp_path, "llama_fp8_kv", kv_cache_dtype="bfloat16").refusal() is None
    assert support(tmp_path, "modelopt_flat_no_kv").refusal() is None  # ModelOpt weights, KV unquantized


def test_a_head_dim_over_256_is_refused_where_the_triton_kernels_serve(tmp_path: Path) -> None:
    """head_dim 512 is refused where a layered backend runs kvplane's Triton kernels (flashinfer's
    extend or triton on a GPU; triton on the CPU under TRITON_INTERPRET=1), naming the head dim,
    the backend, the limit and the backend that serves it. Controls: torch_native on a GPU, triton
    on the CPU without the interpreter (the kernels' torch references) and Llama's head_dim 16
    under flashinfer pass."""
    from sglang_ext.model_support import triton_kernel_backend

    def args(device: str, backend: str, **more: str) -> SimpleNamespace:
        return SimpleNamespace(device=device, attention_backend=backend, prefill_attention_backend=None,
                               decode_attention_backend=None, **more)

    interpret = {"TRITON_INTERPRET": "1"}
    assert triton_kernel_backend(args("cuda", "flashinfer"), {}) == "--attention-backend flashinfer"
    assert triton_kernel_backend(args("cpu", "triton"), interpret) == "--attention-backend triton"
    assert triton_kernel_backend(args("cpu", "triton"), {}) is None
    assert triton_kernel_backend(args("cuda", "torch_native"), {}) is None
    mixed = SimpleNamespace(device="cuda", attention_backend="torch_native", prefill_attention_backend="triton",
                            decode_attention_backend=None)
    assert triton_kernel_backend(mixed, {}) == "--prefill-attention-backend triton"
    wide = support(tmp_path, "llama_head_dim_512", triton_backend="--attention-backend flashinfer")
    assert wide.head_dim == 512
    assert wide.refusal() == ("LlamaForCausalLM has head_dim 512: kvplane's Triton attention kernels, which serve "
                              "--attention-backend flashinfer under --enable-layered-kv, take head_dim up to 256 "
                              "(their tiles would not fit a GPU's shared memory); --attention-backend torch_native "
                              "serves any head_dim")
    assert support(tmp_path, "llama_head_dim_512", triton_backend=None).refusal() is None
    llama = support(tmp_path, "llama", triton_backend="--attention-backend flashinfer")
    assert llama.head_dim == 16 and llama.refusal() is None


def test_hybrid_swa_memory_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """A hybrid sliding-window model (two SGLang pools) is refused naming --disable-hybrid-swa-memory;
    under that flag gpt-oss is still refused, for its sinks (a control that each reason is its own)."""
    from sglang_ext.model_support import ModelSupport

    gpt_oss = support(tmp_path, "gpt_oss")
    assert gpt_oss.hybrid_swa_memory and gpt_oss.sinks
    no_sinks = ModelSupport(architecture="Llama4ForCausalLM", hybrid_swa_memory=True)
    assert "add --disable-hybrid-swa-memory (the window is then applied in attention)" in (no_sinks.refusal() or "")
    flagged = support(tmp_path, "gpt_oss", disable_hybrid_swa_memory=True)
    assert not flagged.hybrid_swa_memory and "attention sinks" in (flagged.refusal() or "")


def test_the_pool_refuses_an_fp8_dtype_however_it_was_reached() -> None:
    """``LayeredTokenToKVPool`` refuses an fp8 KV dtype (a checkpoint's KV quantization resolved by
    SGLang after the launcher); the same pool in fp16 builds (control)."""
    torch = pytest.importorskip("torch")
    from sglang_ext.args import LayeredKVArgs
    from sglang_ext.layered_pool import LayeredTokenToKVPool

    def pool(dtype: Any) -> Any:
        return LayeredTokenToKVPool(size=64, page_size=2, dtype=dtype, head_num=2, head_dim=4, layer_num=2,
                                    device="cpu", enable_memory_saver=False,
                                    layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=200))

    assert pool(torch.float16).store is not None
    with pytest.raises(ValueError, match=r"the KV cache dtype resolved to torch\.float8_e4m3fn .*--kv-cache-dtype bfloat16"):
        pool(torch.float8_e4m3fn)


def test_encoder_decoder_and_bidirectional_prompt_models_are_refused(tmp_path: Path) -> None:
    """Encoder-decoder models (a request's row starts with its encoder's slots, which kvplane's
    self-attention tables read: 1.3-5.5 off SGLang's own backend) and bidirectional prompt
    attention (kvplane's extend is causal: 2.2 off) are refused naming the feature; found by the
    attention review of session 64. Controls: Gemma-3 without ``use_bidirectional_attention``,
    and a Llama, pass."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_ext.model_support import ModelSupport

    whisper = tmp_path / "whisper"  # a Llama config named as Whisper: SGLang decides by architecture
    whisper.mkdir()
    (whisper / "config.json").write_text(json.dumps(
        {**BASE, **CONFIGS["llama"], "architectures": ["WhisperForConditionalGeneration"]}))
    refusal = ModelSupport.from_model_config(ModelConfig(str(whisper)), "auto").refusal() or ""
    assert refusal.startswith("WhisperForConditionalGeneration is an encoder-decoder model"), refusal
    from sglang_ext.model_support import bidirectional_prompt

    for arch in ("HrmTextForCausalLM", "DiffusionGemmaForBlockDiffusion"):
        assert bidirectional_prompt(arch, SimpleNamespace()), arch
    assert bidirectional_prompt("Gemma3TextModel", SimpleNamespace(use_bidirectional_attention=True))
    assert not bidirectional_prompt("Gemma3ForCausalLM", SimpleNamespace(use_bidirectional_attention=False))
    refusal = ModelSupport(architecture="HrmTextForCausalLM", bidirectional_prompt=True).refusal() or ""
    assert refusal.startswith("HrmTextForCausalLM attends over its prompt bidirectionally"), refusal
    assert not support(tmp_path, "gemma2", disable_hybrid_swa_memory=True).bidirectional_prompt  # control
    assert support(tmp_path, "llama").refusal() is None  # control, from SGLang's ModelConfig


def test_chunked_attention_kv_sharing_and_asymmetric_kv_are_refused(tmp_path: Path) -> None:
    """Llama-4's chunked local attention (its layers would attend over the whole context), layers
    reading another layer's KV (Gemma-3n / -4) and K/V head dims that differ (MiMo-V2) are
    refused naming the feature. Control: the same fields unset pass."""
    from sglang_ext.model_support import ModelSupport

    llama4 = support(tmp_path, "llama4_text")
    assert llama4.attention_chunk_size == 32
    assert (llama4.refusal() or "").startswith("Llama4ForCausalLM uses chunked local attention "
                                               "(attention_chunk_size 32)")
    shared = ModelSupport(architecture="SomeForCausalLM", kv_shared_layers=6).refusal()
    assert shared is not None and "6 layers that read another layer's KV (num_kv_shared_layers)" in shared
    for arch in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma3nForConditionalGeneration"):
        gemma = ModelSupport(architecture=arch, hybrid_swa_memory=False).refusal()
        assert gemma is not None and gemma.startswith(f"{arch} gives its sliding-window and global layers"), arch
    assert ModelSupport(architecture="Gemma3ForCausalLM").refusal() is None  # control: Gemma-3 is served
    asym = ModelSupport(architecture="MiMoV2FlashForCausalLM", asymmetric_kv=True).refusal()
    assert asym is not None and "K and V head dims that differ" in asym
    assert ModelSupport(architecture="LlamaForCausalLM").refusal() is None
    llama = support(tmp_path, "llama")
    assert (llama.attention_chunk_size, llama.kv_shared_layers, llama.asymmetric_kv) == (None, 0, False)


def test_models_sglang_refuses_on_flashinfer_are_served_on_triton(tmp_path: Path) -> None:
    """Olmo2 and Exaone-4 with sliding windows: SGLang asserts against FlashInfer at launch. Where
    kvplane chose flashinfer (no --attention-backend), the launch switches to the layered triton
    backend and says so; an explicit --attention-backend flashinfer is refused naming triton.
    Controls: a Llama keeps flashinfer; triton is left as is."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_ext.launch_decision import LaunchDecision
    from sglang_ext.model_support import refuses_flashinfer
    from sglang_ext.plugin import KvplanePlugin
    from tests.sglang.test_launch_decision import KVPLANE_STOCK, STOCK

    implied = LaunchDecision.decide({**STOCK, **KVPLANE_STOCK})
    chosen = LaunchDecision.decide({**STOCK, **KVPLANE_STOCK, "attention_backend": "flashinfer"})
    for name, refused in (("olmo2", True), ("exaone4_swa", True), ("llama", False)):
        config = ModelConfig(str(model_dir(tmp_path, name)))
        assert refuses_flashinfer(config) is refused, name
        args = SimpleNamespace(attention_backend="flashinfer")
        notes = KvplanePlugin._avoid_flashinfer(config, args, implied)
        assert args.attention_backend == ("triton" if refused else "flashinfer"), name
        assert bool(notes) is refused and all("--attention-backend triton for " in n for n in notes)
        if refused:
            with pytest.raises(SystemExit):
                KvplanePlugin._avoid_flashinfer(config, SimpleNamespace(attention_backend="flashinfer"), chosen)
        kept = SimpleNamespace(attention_backend="triton")
        assert KvplanePlugin._avoid_flashinfer(config, kept, chosen) == [] and kept.attention_backend == "triton"
