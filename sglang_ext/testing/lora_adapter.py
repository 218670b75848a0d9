"""Write a PEFT LoRA adapter for a tiny model (:mod:`sglang_ext.testing.tiny_model`): q/k/v/o of
every layer, random weights from a fixed seed, large enough to change the model's outputs.

Used by ``tests/sglang/test_lora_server.py`` and ``benchmarks/results/sglang/lora-session81/``.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_lora_adapter(model_dir: Path, out: Path, seed: int, rank: int) -> Path:
    """A PEFT LoRA adapter on q/k/v/o of every layer, random weights large enough to change outputs."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden = cfg["hidden_size"]
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in dims.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.07).contiguous()
            tensors[f"{name}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.07).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": list(dims), "base_model_name_or_path": str(model_dir),
        "fan_in_fan_out": False, "inference_mode": True}))
    return out
