"""Every CUDA launch configuration of the attention kernels fits the shared memory of the GPUs
kvplane serves on, checked with no GPU: the real launchers run on CPU tensors with their launches
recorded (:mod:`tests.kernels.offline_compile`), the launchers' CUDA options (``decode_launch_options``,
``extend_launch_options``: the extend's by the GPU's per-block limit) substituted for the
interpreter's, and each configuration is compiled by Triton for the GPU it is chosen for. A launch
that does not fit fails at its first run on such a GPU, mid-serving, with Triton's ``OutOfResources``.
The same compiles' ptxas reports must show no register spill for the 16-bit launches (the served
default; a spilling decode was the reason its dots moved to the tensor cores).

Every class is compiled for every target of :data:`~tests.kernels.offline_compile.SHARED_LIMITS`
-- T4 (sm_75), consumer Ampere (sm_86; A100's sm_80, whose TTGIR is sm_86's, is checked on sm_86's
compile against its own limit: :data:`SAME_CODE`; Ada's sm_89 is not compiled: its limit is sm_86's
and it compiled to the same bytes when measured), Hopper (sm_90), Blackwell (sm_100), consumer
Blackwell (sm_120), AMD CDNA 3 (gfx942) and CDNA 4 (gfx950) -- with the extend's tiles chosen by
that target's limit, and checked against it; on sm_100 the tensor memory too (Triton's 512
columns, which some launches use whole). 16-bit launches run on tensor cores (``mma.sync``; in
places ``wgmma`` on sm_90 and ``tcgen05`` on sm_100, as the extend at Llama's shapes; none on
sm_75, where Triton 3.8 compiles ``tl.dot`` to fp32 FMAs: read in the PTX); the
register reports of their sm_86, sm_90, sm_100, sm_120 (ptxas), gfx942 and gfx950 (the AMD
assembly's VGPR spill count and scratch size) compiles must show no spill (:data:`SPILL_CHECKED`).
Not checked, measured: the T4's 16-bit launches spill (255 registers, up to 10 KB of stores a
thread: FMA dots), as does A100's wide extend at head_dim 256 (80 B) and some fp32 launches.

Shared memory is set by a kernel's tiles, its element sizes and its warps, and by the head dim
within its power of two (a head dim of 200 compiles to less than 256: masked columns vectorise
less); the GQA group, page size and soft cap only mask and index (no compile of the review's
changed the bytes). So of the launches of the whole domain below, one per class (kernel, element
sizes, every compile-time argument but those) is compiled: the one of the largest ``BLOCK_D`` and,
within it, the largest head dim (a power of two: the full tile).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from tests.kernels.offline_compile import (
    SHARED_LIMITS,
    TENSOR_MEMORY_COLUMNS,
    Launch,
    amdgcn_report,
    compile_all,
    compile_for,
    ptxas_report,
    record,
)

pytest.importorskip("triton")
pd = importlib.import_module("kernels.paged_decode")
pe = importlib.import_module("kernels.paged_extend")

HEAD_DIMS = (32, 64, 80, 96, 128, 192, 256)
GROUPS = (1, 2, 4, 8, 16, 32, 64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MASKING = {"HEAD_DIM", "GROUP", "PAGE", "USE_CAP", "HEAD_BLOCKS", "Q_HEADS", "BLOCK_D"}
"""Compile-time arguments that mask or index, and ``BLOCK_D``, by which a class is ordered."""
SAME_CODE = {"sm_80": "sm_86"}
"""Targets compiled as another (measured, Triton 3.8: sm_80's TTGIR is sm_86's but for the target
name): a launch of theirs is compiled once, for the other, and checked against their own limit."""
SPILL_CHECKED = ("sm_86", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950")
"""Where the 16-bit launches must not spill (module docstring)."""


def _decode_launches(dtype: torch.dtype, head_dim: int, group: int) -> list[Launch]:
    """The decode's two launches as on CUDA: stage 1's interpreter options replaced by the CUDA ones."""
    q = torch.zeros(2, group, head_dim, dtype=dtype)
    cache = torch.zeros(3, 16, 1, head_dim, dtype=dtype)
    i32 = {"dtype": torch.int32}
    with record() as launches:
        pd.paged_decode_triton(q, cache, cache, torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1], **i32),
                               torch.tensor([5, 16], **i32), num_kv_splits=2)
    (kernel, args, kwargs), merge = launches
    cuda = pd.decode_launch_options(dtype, group, head_dim, cuda=True)
    assert set(pd.decode_launch_options(dtype, group, head_dim, cuda=False)) == set(cuda) - {"num_warps"}
    assert set(cuda) - {"num_warps"} <= set(kwargs)
    return [(kernel, args, {**kwargs, **cuda}), merge]


def _extend_launches(dtype: torch.dtype, head_dim: int, group: int) -> list[Launch]:
    """The extend launcher's recorded launches (under the interpreter's options)."""
    q = torch.zeros(4, group, head_dim, dtype=dtype)
    cache = torch.zeros(3, 16, 1, head_dim, dtype=dtype)
    i32 = {"dtype": torch.int32}
    with record() as launches:
        pe.paged_extend_triton(q, cache, cache, torch.tensor([0], **i32), torch.tensor([4], **i32),
                               torch.tensor([0, 1], **i32), torch.tensor([0], **i32), torch.tensor([9], **i32), 4)
    return launches


def _extend_launch(dtype: torch.dtype, head_dim: int, group: int, target: str) -> Launch:
    """The extend's launch as on a GPU of ``target``: the interpreter's tile options replaced by
    those the launcher picks for that GPU's shared memory per block."""
    (kernel, args, kwargs), = _extend_launches(dtype, head_dim, group)
    cuda = pe.extend_launch_options(dtype, head_dim, shared_per_block=SHARED_LIMITS[target])
    assert set(pe.extend_launch_options(dtype, head_dim, shared_per_block=None)) == set(cuda) - {"num_warps", "num_stages"}
    assert set(cuda) - {"num_warps", "num_stages"} <= set(kwargs)
    return kernel, args, {**kwargs, **cuda}


def _class(launch: Launch) -> tuple:
    kernel, args, kwargs = launch
    sizes = tuple(a.element_size() for a in args if isinstance(a, torch.Tensor))
    return kernel.fn.__name__, sizes, tuple(sorted((k, v) for k, v in kwargs.items() if k not in MASKING))


def _widest(launches: list[Launch]) -> dict[tuple, Launch]:
    """One launch per class: the one of the largest ``BLOCK_D``, then ``HEAD_DIM``."""
    widest: dict[tuple, Launch] = {}

    def size(launch: Launch) -> tuple[int, int]:
        return launch[2]["BLOCK_D"], launch[2]["HEAD_DIM"]

    for launch in launches:
        key = _class(launch)
        if key not in widest or size(launch) > size(widest[key]):
            widest[key] = launch
    return widest


def _jobs() -> list[tuple[Launch, str]]:
    """(launch, target whose limit it must fit): every class of every target (module docstring)."""
    jobs: list[tuple[Launch, str]] = []
    for target in SHARED_LIMITS:
        launches: list[Launch] = []
        for dtype in DTYPES:
            for head_dim in HEAD_DIMS:
                for group in GROUPS:
                    launches += [*_decode_launches(dtype, head_dim, group), _extend_launch(dtype, head_dim, group, target)]
        jobs += [(launch, target) for launch in _widest(launches).values()]
    return jobs


def _compiled(jobs: list[tuple[Launch, str]]) -> list[tuple[int, dict[str, int]]]:
    """(shared memory per block, facts: ``tmem`` and ``register_report`` for a 16-bit launch on a
    :data:`SPILL_CHECKED` target) of each (launch, target); a launch is
    compiled once for the targets that share its code (:data:`SAME_CODE`)."""
    def key(launch: Launch, target: str) -> tuple:
        return _class(launch), launch[2]["BLOCK_D"], launch[2]["HEAD_DIM"], SAME_CODE.get(target, target)

    unique: dict[tuple, tuple[Launch, str, bool]] = {}
    for launch, target in jobs:  # a shared compile reports when any of its targets is spill-checked
        reported = unique.get(key(launch, target), (launch, "", False))[2]
        report = reported or (target in SPILL_CHECKED and _sixteen_bit(launch))
        unique[key(launch, target)] = (launch, SAME_CODE.get(target, target), report)
    results = dict(zip(unique, compile_all(list(unique.values())), strict=True))
    return [results[key(launch, target)] for launch, target in jobs]


def _sixteen_bit(launch: Launch) -> bool:
    return launch[1][1].element_size() == 2


def _name(launch: Launch) -> str:
    kernel, args, kwargs = launch
    tiles = {k: v for k, v in kwargs.items() if k.startswith("BLOCK") or k in ("num_warps", "num_stages", "PACK_GQA")}
    return f"{kernel.fn.__name__} {args[0].dtype} {tiles}"


def test_every_cuda_launch_fits_the_shared_memory_of_its_gpus() -> None:
    """Each class of the decode's, merge's and extend's CUDA launches over head dims 32-256, GQA
    groups 1-128 and bf16 / fp16 / fp32 caches compiles within the per-block shared memory of the
    GPUs it is chosen for; the classes include every extend tiling and every decode head tile of
    ``MAX_BLOCK_HEADS``."""
    jobs = _jobs()
    launches = [launch for launch, _ in jobs]
    assert {kw["HEAD_DIM"] for _, _, kw in launches} == {64, 128, 256}  # full tiles, the largest
    assert set(pd.MAX_BLOCK_HEADS.values()) <= {kw["BLOCK_H"] for _, _, kw in launches if "BLOCK_H" in kw}
    extend_tiles = {((kw["BLOCK_M"], kw["BLOCK_N"]), _sixteen_bit(launch)) for launch in launches
                    if "BLOCK_M" in (kw := launch[2])}
    assert extend_tiles == {(pe.CUDA_WIDE_ROW_BLOCKS, True),
                            (pe.CUDA_BLOCKS, True), (pe.CUDA_NARROW_BLOCKS, True), (pe.CUDA_SMALL_BLOCKS, True),
                            (pe.CUDA_FP32_BLOCKS, False), (pe.CUDA_FP32_WIDE_BLOCKS, False)}
    assert {pd.BLOCK_TOKENS, pd.FP32_WIDE_BLOCK_TOKENS} == {kw["BLOCK_N"] for _, _, kw in launches if "BLOCK_H" in kw}
    compiled = _compiled(jobs)
    over = [f"{_name(launch)} on {target}: {shared} B > {SHARED_LIMITS[target]} B"
            for (launch, target), (shared, _) in zip(jobs, compiled, strict=True) if shared > SHARED_LIMITS[target]]
    assert not over, "\n".join(over)
    tmem = [f"{_name(launch)} on {target}: {facts['tmem']} columns" for (launch, target), (_, facts)
            in zip(jobs, compiled, strict=True) if facts["tmem"] > TENSOR_MEMORY_COLUMNS]
    assert not tmem and any(facts["tmem"] for _, facts in compiled)  # sm_100's launches use tensor memory
    checked = [(launch, target, report) for (launch, target), (_, report) in zip(jobs, compiled, strict=True)
               if target in SPILL_CHECKED and _sixteen_bit(launch)]
    assert checked and all("spill_stores" in report for _, _, report in checked)
    spilling = [f"{_name(launch)} on {target}: {report}" for launch, target, report in checked
                if report["spill_stores"] or report["stack"]]
    assert not spilling, "\n".join(spilling)  # the served 16-bit launches: no register spill


@pytest.mark.parametrize(("dtype", "tiles"), [(torch.bfloat16, (64, 64)), (torch.float32, (32, 32))])
def test_negative_control_wider_tiles_at_head_dim_256_do_not_fit_99_kb(dtype: torch.dtype,
                                                                       tiles: tuple[int, int]) -> None:
    """Control: at head_dim 256 on sm_86 the extend's next wider tiles -- the 16-bit 64 x 64 it
    keeps on A100 / H100, the fp32 32 x 32 it took before -- compile to more shared memory than a
    block may use there (106,752 B and 102,656 B measured), so the check above can fail, and the
    narrower tiles the launcher picks there are needed. The 16-bit wide tiles are the A100's
    (``WIDE_TILES_SHARED``; sm_80 compiles as sm_86) and fit its 163 KB."""
    kernel, args, kwargs = _extend_launch(dtype, 256, 4, "sm_86")
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"]) != tiles
    shared: Any = compile_for((kernel, args, {**kwargs, "BLOCK_M": tiles[0], "BLOCK_N": tiles[1]}), "sm_86").metadata.shared
    assert shared > SHARED_LIMITS["sm_86"]
    if dtype == torch.bfloat16:
        a100 = pe.extend_launch_options(dtype, 256, shared_per_block=SHARED_LIMITS["sm_80"])
        assert (a100["BLOCK_M"], a100["BLOCK_N"]) == tiles and shared <= SHARED_LIMITS["sm_80"]


@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_a_head_dim_over_256_is_refused_by_the_launchers(kernel: str) -> None:
    """The Triton launchers refuse head_dim 512 (no tile of theirs fits a GPU there), naming the
    limit, before any launch; control: head_dim 256 launches."""
    def launch(head_dim: int) -> list[Launch]:
        if kernel == "decode":
            return _decode_launches(torch.bfloat16, head_dim, 4)
        return _extend_launches(torch.float32, head_dim, 4)

    with pytest.raises(ValueError, match="head_dim 512 is over 256, the largest the layered Triton kernels take"):
        launch(512)
    assert launch(256)


def test_negative_control_the_64_kb_tiles_are_needed() -> None:
    """Control for the 64 KB GPUs: the 16-bit extend's 99 KB tiles at head_dim 256 (64 x 32)
    compile to more than a T4 block may use (98,304 B measured on sm_75), and the fp32 decode's
    32-token tile at head_dim 256 to more than an MI300's LDS (67,584 B on gfx942): the launchers
    pick 32 x 32 and 16 tokens there, which the check above compiles."""
    kernel, args, kwargs = _extend_launch(torch.float16, 256, 4, "sm_75")
    assert (kwargs["BLOCK_M"], kwargs["BLOCK_N"]) == pe.CUDA_SMALL_BLOCKS
    narrow = {**kwargs, "BLOCK_M": pe.CUDA_NARROW_BLOCKS[0], "BLOCK_N": pe.CUDA_NARROW_BLOCKS[1]}
    (split, decode_args, decode_kwargs), _ = _decode_launches(torch.float32, 256, 4)
    assert decode_kwargs["BLOCK_N"] == pd.FP32_WIDE_BLOCK_TOKENS
    wide = {**decode_kwargs, "BLOCK_N": pd.BLOCK_TOKENS}
    shared = compile_all([((kernel, args, narrow), "sm_75", False), ((split, decode_args, wide), "gfx942", False)])
    assert all(bytes_ > SHARED_LIMITS[target] for (bytes_, _), target in zip(shared, ("sm_75", "gfx942"), strict=True))


def test_negative_control_the_decode_head_tile_cap_is_needed() -> None:
    """Control: stage 1 of the fp32 decode at head_dim 128 with an MQA-like group of 128 in one
    128-head tile, over its ``MAX_BLOCK_HEADS`` of 64, compiles to more shared memory than sm_86
    allows (115,328 B measured; 98,816 B on sm_75, over its 64 KB)."""
    (kernel, args, kwargs), _ = _decode_launches(torch.float32, 128, 128)
    assert kwargs["BLOCK_H"] == pd.MAX_BLOCK_HEADS[128] == 64 and kwargs["HEAD_BLOCKS"] == 2
    wider = {**kwargs, "BLOCK_H": 128, "HEAD_BLOCKS": 1}
    shared = compile_all([((kernel, args, wider), target, False) for target in ("sm_86", "sm_75")])
    assert all(bytes_ > SHARED_LIMITS[target] for (bytes_, _), target in zip(shared, ("sm_86", "sm_75"), strict=True))


def test_the_copy_kernels_compile_for_the_gpus() -> None:
    """The served copy kernels -- the pool's gather / scatter, the per-layer fetch of host-only
    pages, the page-to-slot expansion, the first two's graph launches (counts read on the
    device) and the one-launch KV row write -- compile for sm_86 and sm_90 at Llama-3-8B's page segment
    (16 tokens x 8 kv heads x 128, bf16: 32 KiB, 4,096 int64 words a segment) within the limit:
    CI runs them only in Triton's interpreter, which accepts code the compiler may not."""
    bc = importlib.import_module("kernels.block_copy")
    pi = importlib.import_module("kernels.page_index")
    rw = importlib.import_module("kernels.row_write")
    host, dev = torch.zeros(12, 16 * 8 * 128, dtype=torch.bfloat16), torch.zeros(10, 16 * 8 * 128, dtype=torch.bfloat16)
    i64, i32 = {"dtype": torch.int64}, {"dtype": torch.int32}
    with record() as launches:
        bc.copy_segments_triton(host, dev, torch.tensor([1, 4], **i64), torch.tensor([0, 2], **i64))
        bc.fetch_pages_triton(host, dev, torch.tensor([0, 3, 1], **i32), torch.tensor([5, 6, 7], **i32),
                              torch.tensor([-1, 2, -1, -1], **i32), torch.tensor([0, 1], **i32),
                              torch.tensor([0, 2], **i32), torch.tensor([2, 1], **i32), 2, 0, 2, 1)
        pi.pages_to_token_locs_triton(torch.tensor([0, 2], **i32), torch.tensor([3, 1], **i32),
                                      torch.tensor([20], **i32), 16)
        # the launches a CUDA graph replays: counts read from device memory (graph_staging.py)
        bc.copy_segments_triton(host, dev, torch.tensor([1, 4], **i64), torch.tensor([0, 2], **i64),
                                count=torch.tensor([1], **i32))
        bc.fetch_pages_triton(host, dev, torch.tensor([0, 3, 1], **i32), torch.tensor([5, 6, 7], **i32),
                              torch.tensor([-1, 2, -1, -1], **i32), torch.tensor([0, 1], **i32),
                              torch.tensor([0, 2], **i32), torch.tensor([2, 1], **i32), 2, 0, 2, 1,
                              listed=torch.tensor([2, 2], **i32))
        rw.write_rows_triton(dev.view(-1, 8, 128)[:20], dev.view(-1, 8, 128)[20:40], torch.tensor([1, 3], **i64),
                             torch.zeros(2, 8, 128, dtype=torch.bfloat16), torch.zeros(2, 8, 128, dtype=torch.bfloat16))
    assert [launch[0].fn.__name__ for launch in launches] == ["_copy_segments_kernel", "_fetch_pages_kernel",
                                                               "_pages_to_locs_kernel", "_copy_segments_kernel",
                                                               "_fetch_pages_kernel", "_write_rows_kernel"]
    assert [launch[2]["COUNTED"] for launch in launches[::3]] == [False, True]
    assert [launch[2]["LISTED"] for launch in launches[1::3]] == [False, True]
    assert launches[0][2]["BLOCK"] == 4096
    jobs = [(launch, target) for launch in launches for target in ("sm_86", "sm_90", "gfx942")]
    shared = [bytes_ for bytes_, _ in compile_all([(launch, target, False) for launch, target in jobs])]
    assert all(s <= SHARED_LIMITS[target] for (_, target), s in zip(jobs, shared, strict=True)), shared


def test_the_table_gather_compiles_for_the_gpus() -> None:
    """The page-table gather a graph replays (:mod:`kernels.table_gather`: its column bound read on
    the device, a loop over blocks since session 86 caps its programs a layer) compiles for sm_86,
    sm_90 and gfx942 within their shared memory: CI runs it only in Triton's interpreter."""
    tg = importlib.import_module("kernels.table_gather")
    i32 = {"dtype": torch.int32}
    with record() as launches:
        tg.gather_tables_triton(torch.zeros(4, 10, **i32), torch.zeros(3000, **i32), torch.zeros(3000, **i32),
                                torch.zeros(4, 3000, **i32), torch.tensor([2500], **i32))
    assert [launch[0].fn.__name__ for launch in launches] == ["_gather_tables_kernel"]
    jobs = [(launches[0], target) for target in ("sm_86", "sm_90", "gfx942")]
    shared = [bytes_ for bytes_, _ in compile_all([(launch, target, False) for launch, target in jobs])]
    assert all(s <= SHARED_LIMITS[target] for (_, target), s in zip(jobs, shared, strict=True)), shared


def test_negative_control_the_fp32_dots_over_a_16_bit_cache_spill() -> None:
    """Control for the spill check above: stage 1 of the decode over a bf16 cache at head_dim 256
    with the fp32 FMA dots it took before (``LOW_PRECISION`` off, 4 warps) spills on sm_86 (about
    9.7 KB of spill stores measured), where its tensor-core launch does not."""
    (kernel, args, kwargs), _ = _decode_launches(torch.bfloat16, 256, 4)
    assert kwargs["LOW_PRECISION"]
    served = ptxas_report(compile_for((kernel, args, kwargs), "sm_86"), "sm_86")
    before = ptxas_report(compile_for((kernel, args, {**kwargs, "LOW_PRECISION": False, "num_warps": 4}), "sm_86"),
                          "sm_86")
    assert served["spill_stores"] == served["stack"] == 0 and before["spill_stores"] > 1000, (served, before)


def test_negative_control_the_amd_report_sees_a_spill() -> None:
    """Control for the AMD half of the spill check: stage 1 of the bf16 decode at head_dim 256 with
    a 64-head tile on one warp (a wavefront of 64 lanes) spills VGPRs to scratch on gfx942 (576
    spilled, 1,220 B of scratch a lane measured), where the served launch does not."""
    (kernel, args, kwargs), _ = _decode_launches(torch.bfloat16, 256, 4)
    served = amdgcn_report(compile_for((kernel, args, kwargs), "gfx942"))
    crowded = amdgcn_report(compile_for((kernel, args, {**kwargs, "BLOCK_H": 64, "num_warps": 1}), "gfx942"))
    assert served["spill_stores"] == served["stack"] == 0 and crowded["spill_stores"] > 100, (served, crowded)
