"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

``kernels.lazy_jit.LazyKernel`` reads TRITON_INTERPRET at launch, so setting it here works even
if another test module imported the kernels first.
"""

import os

import pytest
import torch


@pytest.fixture
def triton_device(monkeypatch: pytest.MonkeyPatch) -> str:
    """``cuda`` when available, else ``cpu`` with TRITON_INTERPRET=1 for this test."""
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert os.environ["TRITON_INTERPRET"] == "1"
    return "cpu"
