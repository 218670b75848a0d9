"""The page tables a graph gathers from the map mirror (:mod:`kernels.table_gather`): the Triton
kernel (interpreter) and the torch reference against a loop over (layer, column), with resident,
host-only, staged-reader and padded columns; the kernel stops at the device-held bound. Controls:
a bound one column short leaves that column unwritten; a mirror of the wrong height is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.table_gather import gather_tables_ref, gather_tables_triton

LAYERS, PAGES, WIDTH = 5, 40, 70
SEEDS = (0, 1, 2)
SENTINEL = -7


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(seed: int, n: int) -> tuple[torch.Tensor, ...]:
    """A mirror with host-only layer-pages (-1); ``n`` used columns: pages, a few -1 (padded
    rows'), staging entries (-1 none, ``s`` an owner's, ``-2 - s`` a reader's); past ``n``, stale
    values an earlier step left."""
    rng = np.random.default_rng(seed)
    mirror = rng.integers(0, 500, size=(LAYERS, PAGES)).astype(np.int32)
    mirror[rng.random((LAYERS, PAGES)) < 0.3] = -1
    flat = rng.integers(0, PAGES, size=WIDTH).astype(np.int32)
    flat[rng.random(WIDTH) < 0.1] = -1
    stage = rng.integers(600, 700, size=WIDTH).astype(np.int32)
    kind = rng.integers(0, 3, size=WIDTH)
    stage[kind == 1] = -1
    stage[kind == 2] = -2 - stage[kind == 2]
    stage[flat < 0] = 999  # a padded row's column: the sink page
    flat[n:] = rng.integers(-1, 3 * PAGES, size=WIDTH - n)  # stale, possibly out of the mirror's width
    return tuple(torch.from_numpy(a) for a in (mirror, flat, stage))


def _loop(mirror: np.ndarray, flat: np.ndarray, stage: np.ndarray, n: int) -> np.ndarray:
    out = np.full((LAYERS, n), SENTINEL, dtype=np.int32)
    for layer in range(LAYERS):
        for c in range(n):
            s = stage[c] if stage[c] >= -1 else -2 - stage[c]
            g = mirror[layer, flat[c]] if flat[c] >= 0 else -1
            out[layer, c] = g if g >= 0 else s
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [1, 33, WIDTH])
def test_both_gathers_equal_the_loop_over_the_used_columns(seed, n):
    """Resident columns read the mirror, host-only and padded ones their decoded staging entry;
    the kernel writes the first ``bound`` columns only, the reference every column."""
    mirror, flat, stage = _inputs(seed, n)
    want = _loop(mirror.numpy(), flat.numpy(), stage.numpy(), n)
    ref = torch.full((LAYERS, WIDTH), SENTINEL, dtype=torch.int32)
    gather_tables_ref(mirror, flat, stage, ref)
    np.testing.assert_array_equal(ref[:, :n].numpy(), want)
    tri = torch.full((LAYERS, WIDTH), SENTINEL, dtype=torch.int32)
    gather_tables_triton(mirror, flat, stage, tri, torch.tensor([n], dtype=torch.int32))
    np.testing.assert_array_equal(tri[:, :n].numpy(), want)
    assert (tri[:, n:] == SENTINEL).all()
    assert torch.equal(mirror, _inputs(seed, n)[0]) and torch.equal(flat, _inputs(seed, n)[1])  # inputs unchanged


@pytest.mark.parametrize("programs", [1, 2, 3])
def test_capped_programs_loop_over_every_block_below_the_bound(programs):
    """With fewer programs a layer than blocks (16-column blocks, 70 columns: five blocks), each
    program loops over its blocks: every used column gathered, none past the bound, nor past the
    table's width for a bound beyond it (session 86: the grid no longer spans the width; with each
    program gathering one block only, all three cases fail: checked by hand)."""
    for n in (1, 33, WIDTH):
        mirror, flat, stage = _inputs(0, n)
        tri = torch.full((LAYERS, WIDTH), SENTINEL, dtype=torch.int32)
        gather_tables_triton(mirror, flat, stage, tri, torch.tensor([n], dtype=torch.int32), block=16, programs=programs)
        np.testing.assert_array_equal(tri[:, :n].numpy(), _loop(mirror.numpy(), flat.numpy(), stage.numpy(), n))
        assert (tri[:, n:] == SENTINEL).all()
    mirror, flat, stage = _inputs(1, WIDTH)
    tri = torch.full((LAYERS, WIDTH), SENTINEL, dtype=torch.int32)
    gather_tables_triton(mirror, flat, stage, tri, torch.tensor([WIDTH + 50], dtype=torch.int32), block=16,
                         programs=programs)
    np.testing.assert_array_equal(tri.numpy(), _loop(mirror.numpy(), flat.numpy(), stage.numpy(), WIDTH))


def test_control_a_bound_one_short_leaves_the_last_column():
    """Control: the kernel reads its extent from the bound only -- one column short, the last
    used column keeps what it held, and the comparison above would fail."""
    mirror, flat, stage = _inputs(0, WIDTH)
    tri = torch.full((LAYERS, WIDTH), SENTINEL, dtype=torch.int32)
    gather_tables_triton(mirror, flat, stage, tri, torch.tensor([WIDTH - 1], dtype=torch.int32))
    want = _loop(mirror.numpy(), flat.numpy(), stage.numpy(), WIDTH)
    assert (tri[:, -1] == SENTINEL).all() and not np.array_equal(tri.numpy(), want)


def test_shapes_are_checked():
    """A mirror whose height is not the table's, or page lists not of the table's width: a
    ValueError naming the shapes."""
    mirror, flat, stage = _inputs(0, 10)
    tab = torch.zeros((LAYERS + 1, WIDTH), dtype=torch.int32)
    with pytest.raises(ValueError, match="share L"):
        gather_tables_ref(mirror, flat, stage, tab)
    with pytest.raises(ValueError, match=f"W={WIDTH}"):
        gather_tables_ref(mirror, flat[:-1], stage, torch.zeros((LAYERS, WIDTH), dtype=torch.int32))


@pytest.mark.parametrize("n", [1023, 1024, 1025, 2049, 2600])
def test_the_kernel_spans_several_programs_of_columns(n):
    """Past one program's block of columns (``GATHER_BLOCK``): every used column of a wide table,
    none past the bound; a bound past the width writes nothing past it."""
    rng = np.random.default_rng(n)
    layers, pages, width = 2, 5000, 2600
    mirror = rng.integers(0, 900, size=(layers, pages)).astype(np.int32)
    mirror[rng.random((layers, pages)) < 0.2] = -1
    flat = torch.from_numpy(rng.integers(0, pages, size=width).astype(np.int32))
    stage = torch.from_numpy(np.where(rng.random(width) < 0.5, -1, rng.integers(0, 100, size=width)).astype(np.int32))
    mirror_t = torch.from_numpy(mirror)
    ref = torch.full((layers, width), SENTINEL, dtype=torch.int32)
    gather_tables_ref(mirror_t, flat, stage, ref)
    for bound in (n, width + 700):
        memory = torch.full((layers * width + 1024,), SENTINEL, dtype=torch.int32)  # a guard after the table
        tri = memory[: layers * width].view(layers, width)
        gather_tables_triton(mirror_t, flat, stage, tri, torch.tensor([bound], dtype=torch.int32))
        used = min(bound, width)
        assert torch.equal(tri[:, :used], ref[:, :used]) and (tri[:, used:] == SENTINEL).all()
        assert (memory[layers * width:] == SENTINEL).all()
