"""Test-only (never installed): lets SGLang's LoRA serving run on a host without CUDA.

SGLang 0.5.23's LoRA layers and backends allocate with ``pin_memory=True`` unconditionally, which
raises "Found no NVIDIA driver" on a CPU-only host. On a server's ``PYTHONPATH`` (the LoRA server
test, stock and layered alike) this drops ``pin_memory`` from torch's allocating calls while CUDA
is absent; with CUDA it does nothing. Used by ``tests/sglang/test_lora_server.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_ALLOCATING = ("tensor", "empty", "zeros", "ones", "arange", "full", "as_tensor", "empty_like", "zeros_like",
               "ones_like")


def _unpinned(fn: Any) -> Any:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return call


if not torch.cuda.is_available():
    for _name in _ALLOCATING:
        setattr(torch, _name, _unpinned(getattr(torch, _name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
