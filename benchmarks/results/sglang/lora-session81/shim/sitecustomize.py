# Test-only shim (NOT part of kvplane): SGLang 0.5.23's LoRA layers/backends request
# pin_memory=True unconditionally, which raises "Found no NVIDIA driver" on a CPU-only host.
# Drop pin_memory when CUDA is unavailable so LoRA can be exercised on CPU.
import os

if os.environ.get("LORA81_SHIM") == "1":
    import functools

    import torch

    if not torch.cuda.is_available():

        def _wrap(fn):
            @functools.wraps(fn)
            def inner(*a, **k):
                k.pop("pin_memory", None)
                return fn(*a, **k)

            return inner

        for _n in (
            "tensor",
            "empty",
            "zeros",
            "ones",
            "arange",
            "full",
            "as_tensor",
            "empty_like",
            "zeros_like",
            "ones_like",
        ):
            setattr(torch, _n, _wrap(getattr(torch, _n)))
        torch.Tensor.pin_memory = lambda self, *a, **k: self
