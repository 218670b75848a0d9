"""The Triton kernels' JIT options: what they leave unspecialized is named right, and the paged
attention kernels do not specialize on their tables' alignment, which varies from step to step
in the served path (each new alignment would be a compile on a request's path, on a GPU)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from kernels.lazy_jit import LazyKernel
from tests.dataplane.core_driver import CoreDriver, make_core

pytest.importorskip("triton")

KERNELS = {name: kernel for module in ("block_copy", "paged_decode", "paged_extend")
           for name, kernel in vars(importlib.import_module(f"kernels.{module}")).items()
           if isinstance(kernel, LazyKernel)}
TABLES = {"indptr_ptr", "indices_ptr", "lens_ptr"}
"""The paged attention kernels' table pointers (a step's page-table CSR)."""


def _runtime_params(kernel: LazyKernel) -> set[str]:
    return {name for name, p in inspect.signature(kernel.fn).parameters.items()
            if "constexpr" not in str(p.annotation)}


def _misnamed(kernel: LazyKernel) -> dict[str, set[str]]:
    """Per JIT option, the names ``kernel`` leaves unspecialized that are not its runtime parameters."""
    return {option: set(kernel.jit_options.get(option, ())) - _runtime_params(kernel)
            for option in ("do_not_specialize", "do_not_specialize_on_alignment")}


def test_unspecialized_names_are_runtime_parameters_of_their_kernels() -> None:
    """Every name a kernel leaves unspecialized is one of its runtime parameters: Triton ignores a
    misspelt one silently (its JIT only asks whether each parameter is listed), and the kernel
    stays specialized on what it was meant not to be. The control: a misspelt name is caught."""
    assert {"_decode_split_kernel", "_merge_splits_kernel", "_extend_kernel", "_copy_segments_kernel",
            "_fetch_pages_kernel"} <= set(KERNELS)
    for name, kernel in KERNELS.items():
        assert not any(_misnamed(kernel).values()), (name, _misnamed(kernel))
    misspelt = LazyKernel(KERNELS["_decode_split_kernel"].fn, do_not_specialize_on_alignment=["indices"])
    assert _misnamed(misspelt)["do_not_specialize_on_alignment"] == {"indices"}


def test_paged_attention_tables_vary_in_alignment_and_are_not_specialized_on_it() -> None:
    """In served decode steps (paged reads, the layout SGLang's paged backends get) the tables
    the kernels take -- ``kv_indptr``, ``kv_lens``, each layer's row of ``tab`` -- start at
    16-byte-aligned and unaligned addresses from step to step; the decode and extend kernels
    leave those pointers' alignment unspecialized."""
    aligned: dict[str, set[bool]] = {"kv_indptr": set(), "kv_lens": set(), "tab": set()}
    core = make_core(None, pages=65, page_size=2)

    def seen_in_layer(layer: int) -> None:
        tables = core.tables
        aligned["kv_indptr"].add(tables.kv_indptr.data_ptr() % 16 == 0)
        aligned["kv_lens"].add(tables.kv_lens.data_ptr() % 16 == 0)
        aligned["tab"].add(tables.tab[layer].data_ptr() % 16 == 0)

    d = CoreDriver(core, seed=3, on_layer=seen_in_layer, fast_decode=True, paged_reads=True)
    rids: list[str] = []
    for i in range(6):  # the batch grows: its table width, its row count and their offsets with it
        rids.append(f"r{i}")
        d.add(rids[-1])
        assert d.step([(rids[-1], 3)])
        for _ in range(3):
            assert d.step([(rid, 1) for rid in rids])
    d.check_at_rest()
    assert all(seen == {True, False} for seen in aligned.values()), aligned
    for name in ("_decode_split_kernel", "_extend_kernel"):
        assert TABLES <= set(KERNELS[name].jit_options["do_not_specialize_on_alignment"]), name
