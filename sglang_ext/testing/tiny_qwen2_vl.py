"""Build a tiny random-weight Qwen2-VL model directory (a vision-language model) that SGLang
serves on the CPU: the multimodal model of ``tests/sglang/test_vlm_serving.py``.

Nothing is downloaded. The weights are transformers' own random initialization
(``Qwen2VLForConditionalGeneration(config)`` under a fixed seed, saved by ``save_pretrained``:
the legacy checkpoint names ``model.*``, ``visual.*``, ``lm_head.*`` that SGLang's loader reads);
the tokenizer is the tiny Llama's byte-level BPE
(:func:`sglang_ext.testing.tiny_model.build_tiny_model`) with Qwen2-VL's special tokens
(``<|vision_start|>``, ``<|image_pad|>``, ...) appended, and the processor files
(``preprocessor_config.json``, ``video_preprocessor_config.json``, ``processor_config.json``,
the chat template) are those of transformers' ``Qwen2VLProcessor``, which SGLang's Qwen-VL
multimodal processor loads through ``AutoProcessor``.

``config.json`` is written flat, as the published Qwen2-VL checkpoints are (text fields at the top
level, ``rope_scaling: {"type": "mrope", "mrope_section": ...}``, ``vision_config.in_chans``):
SGLang's ``Qwen2VLForConditionalGeneration`` reads those names.

Shapes: 4 decoder layers of width 64 (4 query heads, 2 KV heads, head_dim 16, M-RoPE sections
[2, 3, 3]), a 1-block vision tower of width 32 (patch 14, 2x2 merge). An image of 56x56 pixels is
4x4 patches, 4 image tokens after the merge; 112x112 is 16.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
"""Qwen2-VL's special tokens, appended to the tiny Llama tokenizer in this order."""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL's chat template, shortened (no video, no system default)."""

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
"""One image in a ``/generate`` prompt's text; SGLang expands ``<|image_pad|>`` to the image's tokens."""

MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112
"""The image processor's bounds: at most 16 image tokens per image (SGLang's own lower bound is 4
merged patches, 56x56)."""

SEED = 0
INIT_STD = 0.05
"""``initializer_range`` of text and vision weights (the tiny Llama's ``init_std``)."""


def _tokenizer(out: Path) -> dict[str, int]:
    """The tiny Llama's tokenizer files with :data:`SPECIAL_TOKENS` added, into ``out``; their ids."""
    from tokenizers import AddedToken, Tokenizer

    from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory(prefix="tiny-llama-tok-") as tmp:
        llama = build_tiny_model(Path(tmp), TinyModelSpec())
        tok = Tokenizer.from_file(str(llama / "tokenizer.json"))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        tok.save(str(out / "tokenizer.json"))
        config = json.loads((llama / "tokenizer_config.json").read_text())
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tok.token_to_id(token)
        if token_id is None:
            raise RuntimeError(f"{token} was not added to the tiny tokenizer")
        ids[token] = token_id
    config.update({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "extra_special_tokens": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                 "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
    })
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return ids


def _config(ids: dict[str, int]) -> dict:
    vocab = -(-(max(ids.values()) + 1) // 64) * 64
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "max_window_layers": 4,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 2048,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": {
            "depth": 1, "embed_dim": 32, "hidden_size": 64, "hidden_act": "quick_gelu", "mlp_ratio": 4,
            "num_heads": 2, "in_chans": 3, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
            "temporal_patch_size": 2, "initializer_range": INIT_STD,
        },
        "torch_dtype": "float32",
    }


def _weights(config: dict, out: Path) -> None:
    """transformers' random initialization of ``config`` under :data:`SEED`, as ``model.safetensors``
    (the flat ``config.json`` is rewritten afterwards: ``save_pretrained`` writes the nested form)."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(SEED)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(**config)).eval()
    model.save_pretrained(out, safe_serialization=True)


def _processor(out: Path) -> None:
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    image = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    video = Qwen2VLVideoProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    Qwen2VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video,
                     chat_template=CHAT_TEMPLATE).save_pretrained(str(out))


def build_tiny_qwen2_vl(directory: str | Path) -> Path:
    """Write config, weights, tokenizer and processor files of the tiny Qwen2-VL into
    ``directory``; return its path. Deterministic (fixed seed); rebuilt on every call."""
    out = Path(directory)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ids = _tokenizer(out)
    config = _config(ids)
    _weights(config, out)
    _processor(out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out
