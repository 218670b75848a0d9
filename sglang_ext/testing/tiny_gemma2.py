"""Build a tiny random-weight Gemma-2 model directory (attention logit soft cap, sliding window)
that SGLang and transformers both load: the soft-capped model of ``tests/sglang/test_soft_cap_server.py``.

The weights are transformers' own random initialization (``Gemma2ForCausalLM(config)``), so the
checkpoint's layout is whatever transformers writes; the tokenizer is the tiny Llama's
(:func:`sglang_ext.testing.tiny_model.build_tiny_model`). ``initializer_range`` is large so that
attention scores (~6) are far above the cap: with the cap ignored, logprobs move by whole units.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SOFT_CAP = 0.3
"""``attn_logit_softcapping``: well below the random model's attention scores."""


def build_tiny_gemma2(directory: str | Path, tokenizer_from: str | Path, *, seed: int = 0) -> Path:
    """Write a 2-layer Gemma-2 (a sliding-window layer of 8 tokens, then a full attention layer) with the tokenizer files of
    the tiny model at ``tokenizer_from`` into ``directory``; return its path."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    out, tok = Path(directory), Path(tokenizer_from)
    vocab = int(json.loads((tok / "config.json").read_text())["vocab_size"])
    config = Gemma2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, attn_logit_softcapping=SOFT_CAP,
        final_logit_softcapping=None, sliding_window=8, query_pre_attn_scalar=16, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    Gemma2ForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["hidden_act"] = saved.get("hidden_activation", "gelu_pytorch_tanh")  # SGLang's gemma2 reads this name
    saved["torch_dtype"] = "float32"
    config_path.write_text(json.dumps(saved, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tok / name, out / name)
    return out
