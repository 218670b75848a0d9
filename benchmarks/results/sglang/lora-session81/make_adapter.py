import json
from pathlib import Path

import torch
from safetensors.torch import save_file

cfg = json.load(open("/tmp/lora81/model/config.json"))
h = cfg["hidden_size"]
kv = cfg["num_key_value_heads"] * cfg["head_dim"]


def make(out, seed, r=8, alpha=16, scale=0.07):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h)}
    t = {}
    for i in range(cfg["num_hidden_layers"]):
        for m, (i_n, o_n) in dims.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{m}"
            t[p + ".lora_A.weight"] = (torch.randn(r, i_n, generator=g) * scale).contiguous()
            t[p + ".lora_B.weight"] = (torch.randn(o_n, r, generator=g) * scale).contiguous()
    save_file(t, str(out / "adapter_model.safetensors"))
    json.dump(
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": r,
            "lora_alpha": alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": list(dims),
            "base_model_name_or_path": "/tmp/lora81/model",
            "fan_in_fan_out": False,
            "inference_mode": True,
        },
        open(out / "adapter_config.json", "w"),
        indent=2,
    )


make("/tmp/lora81/loraA", 1)
make("/tmp/lora81/loraB", 2, r=4, alpha=8)
print("ok")
