"""Page fetch: the Triton kernel (interpreter on CPU, real on GPU) equals its index-list
reference, which equals a per-page loop; pages with a device copy and columns of requests
outside the launch are left alone."""

import numpy as np
import pytest
import torch

from kernels.block_copy import copy_segments_ref, fetch_page_indices, fetch_pages_triton

L, P, SEG, DEV = 3, 12, 40, 30


def _case(seed: int):
    rng = np.random.default_rng(seed)
    counts = np.array([3, 0, 5, 2], dtype=np.int64)
    starts = np.cumsum(counts) - counts
    n = int(counts.sum())
    flat = rng.choice(np.arange(1, P), size=n, replace=True)  # repeats: shared pages
    stage = rng.permutation(DEV // 2)[:n]
    map_row = np.where(rng.random(P) < 0.5, -1, rng.integers(0, DEV, P)).astype(np.int32)
    host = torch.arange(P * L * 2 * SEG, dtype=torch.float32).view(P * L * 2, SEG)
    return flat, stage, map_row, starts, counts, host


def _loop(host_rows, flat, stage, map_row, reqs, starts, counts, layer, dev):  # noqa: ANN001
    for r in reqs:
        for j in range(counts[r]):
            c = starts[r] + j
            if map_row[flat[c]] < 0:
                s = (flat[c] * L + layer) * 2
                dev[stage[c]] = host_rows[s]
                dev[stage[c] + DEV // 2] = host_rows[s + 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("reqs", [[0, 2, 3], [2], [1, 3]])
@pytest.mark.parametrize("programs", [None, 1])
def test_fetch_pages_kernel_matches_reference(triton_device, seed, reqs, programs):
    flat, stage, map_row, starts, counts, host = _case(seed)
    layer = 1
    src, dst = fetch_page_indices(flat, stage, map_row, reqs, starts, counts, 2 * layer, 2 * L, DEV // 2)
    expected = torch.full((DEV, SEG), -1.0)
    copy_segments_ref(host, expected, torch.from_numpy(src), torch.from_numpy(dst))
    looped = torch.full((DEV, SEG), -1.0)
    _loop(host, flat, stage, map_row, reqs, starts, counts, layer, looped)
    assert torch.equal(expected, looped)
    moved = int((map_row[flat[np.concatenate([np.arange(starts[r], starts[r] + counts[r]) for r in reqs])]] < 0).sum())
    assert src.size == 2 * moved
    dev = torch.full((DEV, SEG), -1.0, device=triton_device)
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int32, device=triton_device)  # noqa: E731
    fetch_pages_triton(host.to(triton_device), dev, t(flat), t(stage), t(map_row), t(reqs), t(starts), t(counts),
                       int(counts[reqs].max()), 2 * layer, 2 * L, DEV // 2, programs)
    assert torch.equal(dev.cpu(), expected)


def test_a_wrong_layer_is_caught(triton_device):
    """Control: the kernel at another layer's host segments differs from the reference."""
    flat, stage, map_row, starts, counts, host = _case(0)
    reqs = [0, 2, 3]
    src, dst = fetch_page_indices(flat, stage, map_row, reqs, starts, counts, 2, 2 * L, DEV // 2)
    expected = torch.full((DEV, SEG), -1.0)
    copy_segments_ref(host, expected, torch.from_numpy(src), torch.from_numpy(dst))
    dev = torch.full((DEV, SEG), -1.0, device=triton_device)
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int32, device=triton_device)  # noqa: E731
    fetch_pages_triton(host.to(triton_device), dev, t(flat), t(stage), t(map_row), t(reqs), t(starts), t(counts),
                       5, 0, 2 * L, DEV // 2)
    assert src.size and not torch.equal(dev.cpu(), expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_reader_entry_copies_nothing(triton_device, seed):
    """A negative staging entry (``-2 - s``: the column reads a page another column fetches,
    ``staging_columns.py``) copies nothing, in the kernel and in its index-list reference; the
    other columns copy as before. Control: the same launch with the entries decoded copies more."""
    flat, stage, map_row, starts, counts, host = _case(seed)
    reqs, layer = [0, 2, 3], 1
    readers = np.zeros(stage.size, dtype=bool)
    readers[1::2] = True
    entries = np.where(readers, -2 - stage, stage)
    src, dst = fetch_page_indices(flat, entries, map_row, reqs, starts, counts, 2 * layer, 2 * L, DEV // 2)
    expected = torch.full((DEV, SEG), -1.0)
    copy_segments_ref(host, expected, torch.from_numpy(src), torch.from_numpy(dst))
    looped = torch.full((DEV, SEG), -1.0)
    for r in reqs:
        for j in range(counts[r]):
            c = starts[r] + j
            if map_row[flat[c]] < 0 and not readers[c]:
                s = (flat[c] * L + layer) * 2
                looped[stage[c]], looped[stage[c] + DEV // 2] = host[s], host[s + 1]
    assert torch.equal(expected, looped)
    full, _ = fetch_page_indices(flat, stage, map_row, reqs, starts, counts, 2 * layer, 2 * L, DEV // 2)
    assert 0 < src.size < full.size
    dev = torch.full((DEV, SEG), -1.0, device=triton_device)
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int32, device=triton_device)  # noqa: E731
    fetch_pages_triton(host.to(triton_device), dev, t(flat), t(entries), t(map_row), t(reqs), t(starts), t(counts),
                       int(counts[reqs].max()), 2 * layer, 2 * L, DEV // 2)
    assert torch.equal(dev.cpu(), expected)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("listed", [0, 1, 2, 3])
def test_a_listed_launch_reads_its_count_and_extent_on_the_device(triton_device, seed, listed):
    """A graph's launch (``listed``: how many of ``reqs`` and their extent, read by the kernel)
    copies what an ordinary launch of those requests copies, whatever the buffer beyond them
    holds and however large the extent the launch was sized for; the same launch replayed after
    the device values change copies the new list. Control: with the count read as the buffer's
    length (an ordinary launch of the whole buffer), the stale requests past it are copied too."""
    flat, stage, map_row, starts, counts, host = _case(seed)
    t = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int32, device=triton_device)  # noqa: E731
    buffer = [2, 3, 0, 1]  # a fixed-size list: its first ``listed`` entries are the launch's

    def copied(reqs, through_kernel):  # noqa: ANN001, ANN202
        dev = torch.full((DEV, SEG), -1.0, device=triton_device)
        if through_kernel:
            n, widest = len(reqs), int(counts[reqs].max()) if reqs else 0
            fetch_pages_triton(host.to(triton_device), dev, t(flat), t(stage), t(map_row), t(buffer), t(starts),
                               t(counts), int(counts.max()) + 3, 2, 2 * L, DEV // 2, listed=t([n, widest]))
        elif reqs:
            fetch_pages_triton(host.to(triton_device), dev, t(flat), t(stage), t(map_row), t(reqs), t(starts),
                               t(counts), int(counts[reqs].max()), 2, 2 * L, DEV // 2)
        return dev.cpu()

    want = copied(buffer[:listed], False)
    assert torch.equal(copied(buffer[:listed], True), want)
    if listed < len(buffer):  # the control: the whole buffer copies what the list does not
        whole = copied(buffer, False)
        moved = int((map_row[flat[np.concatenate([np.arange(starts[r], starts[r] + counts[r])
                                                   for r in buffer[listed:]])]] < 0).sum())
        assert torch.equal(whole, want) == (moved == 0)
