"""Compile a recorded Triton launch for a named GPU, with no GPU here: Triton's own launch path
(``JITFunction.run``: its binder's specialisation of the arguments, ``_pack_args``, then
``triton.compile``) pointed at a named target -- ``GPUTarget("cuda", capability, 32)`` for an
NVIDIA GPU, ``GPUTarget("hip", arch, 64)`` for an AMD one -- instead of the current device.
ptxas and the AMD backend's linker ship in the Triton wheel, so the result is the kernel a GPU of
that kind would load, and its metadata says the shared memory (AMD: LDS) a block needs -- which
decides whether the launch can run there at all (Triton raises ``OutOfResources`` at the first
launch on a GPU whose per-block limit is smaller, mid-serving).

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

SHARED_LIMITS = {"sm_75": 65_536, "sm_80": 166_912, "sm_86": 101_376, "sm_90": 232_448, "sm_100": 232_448,
                 "sm_120": 101_376, "gfx942": 65_536, "gfx950": 163_840}
"""Shared memory a block may use (``cudaDevAttrMaxSharedMemoryPerBlockOptin``; AMD: LDS), bytes,
per compile target: Turing (T4), A100, consumer Ampere (RTX 30, A10, A40; Ada -- L4, L40S, RTX 40,
sm_89 -- compiles as sm_86 with the same limit), Hopper (H100, H200), Blackwell (B200, GB200),
consumer Blackwell (RTX 50, RTX PRO 6000), CDNA 3 (MI300X, MI325X; CDNA 2's gfx90a, MI200, has
the same 64 KB and compiled to the same bytes in every launch measured), CDNA 4 (MI355X)."""
TENSOR_MEMORY_COLUMNS = 512
"""Tensor memory a block may use on sm_100 (columns; Triton 3.8's ``CompiledKernel`` check)."""

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


def capability(target: str) -> int | None:
    """The compute capability of NVIDIA ``target`` (``"sm_86"``: 86), None for an AMD one."""
    return int(target[3:]) if target.startswith("sm_") else None


def compile_for(launch: Launch, target: str) -> Any:
    """``launch`` compiled by Triton for ``target`` (a key of :data:`SHARED_LIMITS`: ``"sm_86"``,
    ``"gfx942"``): the ``CompiledKernel`` (``.metadata.shared``: bytes of shared memory per block)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, args, kwargs = launch
    fn = triton.jit(kernel.fn, **kernel.jit_options)
    cap = capability(target)
    gpu = GPUTarget("cuda", cap, 32) if cap is not None else GPUTarget("hip", target, 64)
    backend = make_backend(gpu)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options.__dict__)


def ptxas_report(compiled: Any, target: str) -> dict[str, int]:
    """What ptxas reports of ``compiled`` (:func:`compile_for`) for NVIDIA ``target``: ``registers`` a
    thread, ``stack`` (bytes a thread) and ``spill_stores`` (bytes). Its PTX is assembled again with
    the flags Triton 3.8's ``make_cubin`` passes (``-lineinfo -v --regAllocOptLevel=2``), so a
    compile cache hit reports too."""
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    cap = capability(target)
    assert cap is not None, f"{target}: ptxas reports on NVIDIA targets only"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(cap).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(cap)}", str(src), "-o",
                              str(src.with_suffix(".o"))], capture_output=True, text=True, check=True).stderr

    return _numbers(log, {"registers": r"Used (\d+) registers", "stack": r"(\d+) bytes stack frame",
                          "spill_stores": r"(\d+) bytes spill stores"})


def amdgcn_report(compiled: Any) -> dict[str, int]:
    """What the AMD backend's assembly of ``compiled`` (:func:`compile_for`, an AMD target) says:
    ``registers`` (VGPRs a lane), ``stack`` (scratch bytes a lane) and ``spill_stores`` (VGPRs
    spilled to scratch; SGPR spills go to VGPR lanes, not memory), as :func:`ptxas_report` does."""
    return _numbers(compiled.asm["amdgcn"], {"registers": r"; NumVgprs: (\d+)", "stack": r"; ScratchSize: (\d+)",
                                             "spill_stores": r"\.vgpr_spill_count:\s+(\d+)"})


def _numbers(text: str, patterns: dict[str, str]) -> dict[str, int]:
    """Each pattern's first number in ``text`` (a compiler's report), by name."""
    import re

    found = {name: re.search(pattern, text) for name, pattern in patterns.items()}
    missing = [name for name, match in found.items() if match is None]
    assert not missing, f"{missing} not in: {text[:2000]}"
    return {name: int(match.group(1)) for name, match in found.items() if match is not None}


def register_report(compiled: Any, target: str) -> dict[str, int]:
    """:func:`ptxas_report` on an NVIDIA ``target``, :func:`amdgcn_report` on an AMD one."""
    return ptxas_report(compiled, target) if capability(target) is not None else amdgcn_report(compiled)


def compile_job(job: tuple[Launch, str, bool]) -> tuple[int, dict[str, int]]:
    """``(launch, target, report)`` compiled: bytes of shared memory per block, and ``tmem`` (the
    tensor-memory columns a block uses: sm_100, else 0) with, when ``report``, :func:`register_report`."""
    launch, target, report = job
    compiled = compile_for(launch, target)
    facts = {"tmem": int(getattr(compiled.metadata, "tmem_size", 0) or 0)}
    return compiled.metadata.shared, {**facts, **(register_report(compiled, target) if report else {})}


def compile_all(jobs: list[tuple[Launch, str, bool]]) -> list[tuple[int, dict[str, int]]]:
    """:func:`compile_job` of each job, in order: a few in this process, more over two spawned
    processes (the compiles are CPU-bound, a worker's start about 4 s; processes, not threads:
    Triton parses a kernel's source with ``ast.parse``, which Python 3.11 does not allow from two
    threads at once -- "AST constructor recursion depth mismatch", seen in a suite run). A failing
    job cancels those not started."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    if len(jobs) < POOL_FROM or (os.cpu_count() or 1) < 2:
        return [compile_job(job) for job in jobs]
    sent = [((_kernel_name(kernel), args, kwargs), target, report) for (kernel, args, kwargs), target, report in jobs]
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    try:
        return list(pool.map(_compile_sent, sent))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


POOL_FROM = 8
"""Fewest jobs :func:`compile_all` spreads over processes."""


def _kernel_name(kernel: LazyKernel) -> tuple[str, str]:
    """(module, attribute) naming ``kernel``: a ``LazyKernel`` is bound to the name of the function
    it wraps, so pickle cannot send the function by reference; the worker looks the kernel up."""
    import sys

    module = kernel.fn.__module__
    names = [name for name, value in vars(sys.modules[module]).items() if value is kernel]
    assert names, f"{kernel.fn.__name__} is not a module-level LazyKernel of {module}"
    return module, names[0]


def _compile_sent(job: tuple[tuple[tuple[str, str], tuple, dict], str, bool]) -> tuple[int, dict[str, int]]:
    """:func:`compile_job` in a worker, of a launch whose kernel comes by name (:func:`_kernel_name`)."""
    import importlib

    ((module, name), args, kwargs), target, report = job
    return compile_job(((getattr(importlib.import_module(module), name), args, kwargs), target, report))
