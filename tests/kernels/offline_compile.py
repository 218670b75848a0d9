"""Compile a recorded Triton launch for a named GPU, with no GPU here: Triton's own launch path
(``JITFunction.run``: its binder's specialisation of the arguments, ``_pack_args``, then
``triton.compile``) pointed at ``GPUTarget("cuda", capability, 32)`` instead of the current
device. ptxas ships in the Triton wheel, so the result is the kernel a GPU of that capability
would load, and its metadata says the shared memory a block needs -- which decides whether the
launch can run there at all (Triton raises ``OutOfResources`` at the first launch on a GPU whose
per-block limit is smaller, mid-serving).

:func:`record` runs a real launcher (its checks, its choice of grid and compile-time arguments)
with every ``LazyKernel`` launch recorded instead of run, so a test compiles exactly what the
served code passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from kernels.lazy_jit import LazyKernel

SHARED_LIMITS = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
"""Shared memory a block may use (``cudaDevAttrMaxSharedMemoryPerBlockOptin``), bytes: A100,
consumer Ampere (RTX 30, A10, A40), Ada (L4, L40S, RTX 40), Hopper (H100, H200). sm_80..89
compile to the same code, so a launch that fits 86's limit fits the family."""

Launch = tuple[LazyKernel, tuple, dict]
"""A recorded launch: the kernel, its positional arguments, its keyword arguments."""


@contextlib.contextmanager
def record() -> Iterator[list[Launch]]:
    """Within: every ``LazyKernel`` launch is appended to the yielded list, not run."""
    launches: list[Launch] = []
    real = LazyKernel.__getitem__

    def recording(self: LazyKernel, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> None:
            launches.append((self, args, dict(kwargs)))
        return run

    LazyKernel.__getitem__ = recording  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        LazyKernel.__getitem__ = real  # type: ignore[method-assign]


def compile_for(launch: Launch, capability: int) -> Any:
    """``launch`` compiled by Triton for an NVIDIA GPU of ``capability`` (86: sm_86): the
    ``CompiledKernel`` (``.metadata.shared``: bytes of shared memory per block)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, args, kwargs = launch
    fn = triton.jit(kernel.fn, **kernel.jit_options)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def ptxas_report(compiled: Any, capability: int) -> dict[str, int]:
    """What ptxas reports of ``compiled`` (:func:`compile_for`) for ``capability``: ``registers`` a
    thread, ``stack`` (bytes a thread) and ``spill_stores`` (bytes). Its PTX is assembled again with
    the flags Triton 3.8's ``make_cubin`` passes (``-lineinfo -v --regAllocOptLevel=2``), so a
    compile cache hit reports too."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(capability)}", str(src), "-o",
                              str(src.with_suffix(".o"))], capture_output=True, text=True, check=True).stderr

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        assert found, f"ptxas said: {log}"
        return int(found.group(1))

    return {"registers": number(r"Used (\d+) registers"), "stack": number(r"(\d+) bytes stack frame"),
            "spill_stores": number(r"(\d+) bytes spill stores")}
