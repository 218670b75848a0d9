"""The pool copies' Triton kernels are compiled when the store is built, not on a request's path.

Triton compiles a kernel per specialisation (its compile-time arguments, its pointers' dtypes,
whether an integer argument is 1 or a multiple of 16, whether a pointer is 16-byte aligned --
each unless the kernel leaves it unspecialised). On a GPU the first launch of each costs a
compile (about a second, longer on a fresh container without Triton's cache), and before this
check the first offload, write-back and fetch of a server each paid one while serving. Here the
CUDA engine runs over CPU pools with simulated streams (``cuda_simulation.install``) and its real
kernels in Triton's interpreter, and every launch's specialisation is recorded: the ones the
store's construction launched must cover every one a served scenario launches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels import block_copy
from kernels.lazy_jit import LazyKernel
from sglang_ext.dataplane import cuda_transfer_engine as te
from sglang_ext.dataplane.page_fetch import PageFetch
from tests.dataplane.core_driver import PAGES, CoreDriver, make_core, offload_scenario
from tests.dataplane.cuda_simulation import install

pytest.importorskip("triton")

REAL_FETCH = PageFetch.__dict__["run_triton"]
"""The fetch's launch (``install`` replaces it with its reference)."""


def specialisation(kernel: LazyKernel, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What Triton compiles a launch of ``kernel`` for (module docstring): its keyword arguments
    (compile-time ones and ``num_warps``), each pointer's dtype and alignment, each integer's
    1 / multiple-of-16 classes, except what the kernel leaves unspecialised."""
    names = list(kernel.fn.__code__.co_varnames[: kernel.fn.__code__.co_argcount])
    plain = set(kernel.jit_options.get("do_not_specialize", ()))
    unaligned = set(kernel.jit_options.get("do_not_specialize_on_alignment", ()))
    key: list[Any] = [kernel.fn.__name__, tuple(sorted(kwargs.items()))]
    for name, value in zip(names, args, strict=False):
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, None if name in unaligned else value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and name not in plain:
            key.append((name, value == 1, value % 16 == 0))
    return tuple(key)


def _launches(monkeypatch: pytest.MonkeyPatch, budget: int | None, paged_reads: bool,
              warm: bool = True) -> tuple[set, set]:
    """(specialisations launched while the core was built, those its served scenario launched)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen: dict[str, set] = {"built": set(), "served": set()}
    phase = "built"
    real_getitem = LazyKernel.__getitem__

    def recording(self: LazyKernel, grid: Any) -> Any:
        launch = real_getitem(self, grid)

        def run(*args: Any, **kwargs: Any) -> Any:
            seen[phase].add(specialisation(self, args, kwargs))
            return launch(*args, **kwargs)

        return run

    with monkeypatch.context() as mp:
        install(mp)
        mp.setattr(te, "copy_segments", block_copy.copy_segments)  # the real kernels, interpreted
        mp.setattr(te, "fetch_pages_triton", block_copy.fetch_pages_triton)
        mp.setattr(PageFetch, "run_triton", REAL_FETCH)
        mp.setattr(LazyKernel, "__getitem__", recording)
        if not warm:
            mp.setattr(te.CudaTransferEngine, "warm_pool_copies", lambda self, map_row: None)
        core = make_core(budget)
        assert isinstance(core.store.engine, te.CudaTransferEngine) and core.store.engine.impl == "triton"
        phase = "served"
        offload_scenario(CoreDriver(core, seed=1, fast_decode=True, paged_reads=paged_reads))
    return seen["built"], seen["served"]


@pytest.mark.parametrize(("budget", "paged_reads", "kernels"), [
    (None, True, {"_copy_segments_kernel"}),
    (PAGES + 6, False, {"_copy_segments_kernel", "_fetch_pages_kernel"}),
    (PAGES + 6, True, {"_copy_segments_kernel", "_fetch_pages_kernel"}),
], ids=["identity", "staged-token-tables", "staged-paged-reads"])
def test_building_the_store_compiles_every_pool_copy_a_served_scenario_launches(monkeypatch, budget, paged_reads,
                                                                                 kernels):
    """Offloads, onloads, write-backs, a staged step's fetches and a decode step's parked tokens:
    every launch is a specialisation the store's construction already launched. The control:
    without the pool copies' warm-up the served launches are new ones (before it only the token
    rows' copy was warmed, and only for a staged store)."""
    built, served = _launches(monkeypatch, budget, paged_reads)
    assert {key[0] for key in served} == kernels
    assert served <= built, served - built
    built, served = _launches(monkeypatch, budget, paged_reads, warm=False)
    assert {key[0] for key in served - built} == kernels


def test_the_recorded_specialisation_tells_dtypes_alignment_and_integer_classes_apart() -> None:
    """The record is as fine as Triton's key: an int32 index list, a misaligned pointer, or an
    integer of 1 instead of 2 is another specialisation; what the kernel leaves unspecialised is not."""
    kernel = block_copy._copy_segments_kernel
    words = torch.zeros(4, 8, dtype=torch.int64)
    idx = torch.zeros(2, dtype=torch.int64)
    base = specialisation(kernel, (words, words, idx, idx, 2, 3), {"SEG": 8})
    assert specialisation(kernel, (words, words, idx.int(), idx, 2, 3), {"SEG": 8}) != base
    assert specialisation(kernel, (words[:, 1:], words, idx, idx, 2, 3), {"SEG": 8}) != base
    assert specialisation(kernel, (words, words, idx, idx, 2, 3), {"SEG": 16}) != base
    assert specialisation(kernel, (words, words, idx[1:], idx, 5, 7), {"SEG": 8}) == base  # unspecialised
