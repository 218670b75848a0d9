"""The two adapters of this check, written by the suite's writer (byte-for-byte the weights the
session 81 runs used: same seeds, ranks and draw order)."""

from pathlib import Path

from sglang_ext.testing.lora_adapter import write_lora_adapter

model = Path("/tmp/lora81/model")
write_lora_adapter(model, Path("/tmp/lora81/loraA"), seed=1, rank=8)
write_lora_adapter(model, Path("/tmp/lora81/loraB"), seed=2, rank=4)
print("ok")
