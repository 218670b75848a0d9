"""The paged serving backends' per-layer attention on the CPU under the Triton interpreter, for
what they read of the GPU once rather than at every layer's launch (a device-property query each,
host time on every layer of every step): ``LayeredTritonDecode.decode_layer``'s split count,
worked out once per step shape from the SMs read at construction, and ``extend_layer``'s per-block
shared memory (the extend's tiles depend on it). The backends are built without their
constructors (they need a model runner); the device facts are an H200's SMs and an L4's shared
memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.sglang


def test_the_split_count_is_worked_out_once_per_step_shape_and_each_layer_reads_its_row(monkeypatch):
    import sglang_ext.layered_triton_decode as ltd
    from kernels.paged_decode import paged_decode_ref

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    worked, launched = [], []
    real_splits, real_decode = ltd.kv_splits, ltd.paged_decode

    def counting_splits(*args):  # noqa: ANN002, ANN202
        worked.append(args)
        return real_splits(*args)

    def recording_decode(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        launched.append((kwargs["num_kv_splits"], args[4]))
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(ltd, "kv_splits", counting_splits)
    monkeypatch.setattr(ltd, "paged_decode", recording_decode)
    backend = object.__new__(ltd.LayeredTritonDecode)
    backend.decode_layers, backend.sms, backend._splits = 0, 132, ((-1, -1, -1), 1)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(40, 16, 2, 16, generator=g)  # pages of 16 tokens, 2 kv heads
    layers = [SimpleNamespace(layer_id=i, scaling=0.25, logit_cap=0.0, sliding_window_size=-1) for i in range(3)]
    for step, batch in enumerate((2, 2, 3)):
        i32 = torch.int32
        tab = (torch.arange(3 * 8 * batch, dtype=i32).view(3, 8 * batch) * 7 + 5 * step) % 40  # 8 pages each
        tables = SimpleNamespace(kv_indptr=torch.arange(0, 8 * batch + 1, 8, dtype=i32), tab=tab,
                                 kv_lens=torch.full((batch,), 120, dtype=i32))
        backend.pool = SimpleNamespace(tables=tables, store=SimpleNamespace(dev=(kv, kv)))
        q = torch.randn(batch, 4, 16, generator=g)
        for index, layer in enumerate(layers):
            got = backend.decode_layer(q, layer, index)
            want = paged_decode_ref(q, kv, kv, tables.kv_indptr, tab[index], tables.kv_lens, sm_scale=0.25)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert worked == [(2, 2, 132, 16, 16, 1), (3, 2, 132, 24, 16, 1)]  # steps 0 and 1 share a shape; one head block
    counts = [n for n, _ in launched]
    assert counts == [real_splits(2, 2, 132, 16, 16)] * 6 + [real_splits(3, 2, 132, 24, 16)] * 3
    assert counts[0] == 4  # 8 pages a request: four 32-token tiles; the interpreter ran the split-merge path
    assert all(torch.equal(rows, tab_row) for (_, rows), tab_row in zip(launched[6:], tab, strict=True))
    assert not torch.equal(tab[0], tab[1])  # control: a layer reading another's row would differ



def test_the_split_count_counts_head_blocks_and_a_cpu_step_takes_one():
    """On a GPU an MQA-like group (32 q heads per kv head at head_dim 256: two head blocks of 16)
    halves the splits wanted, and the count follows the step's q heads; off CUDA (``sms`` None) a
    step takes one split whatever its head dim -- a head_dim of 512, which only the torch reference
    serves, included."""
    import sglang_ext.layered_triton_decode as ltd
    from kernels.paged_decode import kv_splits

    backend = object.__new__(ltd.LayeredTritonDecode)
    backend.sms, backend._splits = 132, ((-1, -1, -1), 1)
    cache = torch.Size((100, 16, 2, 256))
    mqa = backend.step_splits(torch.zeros(8, 64, 256), 400, cache)
    assert mqa == kv_splits(8, 2, 132, 400, 16, 2) == 9  # 264 programs wanted over 8 x 2 x 2
    assert backend.step_splits(torch.zeros(8, 4, 256), 400, cache) == kv_splits(8, 2, 132, 400, 16, 1) == 16  # control
    backend.sms, backend._splits = None, ((-1, -1, -1), 1)
    assert backend.step_splits(torch.zeros(2, 8, 512), 4, torch.Size((10, 16, 2, 512))) == 1

def test_the_extend_launches_with_the_shared_memory_read_at_construction(monkeypatch):
    """``extend_layer`` hands the kernel the GPU's per-block shared memory the backend read once
    (an L4's here), so no layer's launch queries the device; the kernel's output is the
    reference's (the interpreter ignores the limit)."""
    import sglang_ext.layered_paged_decode as lpd
    from kernels.paged_extend import paged_extend_ref

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen, real = [], lpd.paged_extend

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(kwargs["shared_per_block"])
        return real(*args, **kwargs)

    monkeypatch.setattr(lpd, "paged_extend", recording)
    backend = object.__new__(lpd.LayeredPagedDecode)
    backend.extend_layers, backend.shared_per_block, backend._max_new = 0, 101_376, 5
    kv = torch.randn(6, 4, 1, 16, generator=torch.Generator().manual_seed(5))
    i32 = torch.int32
    tables = SimpleNamespace(kv_indptr=torch.tensor([0, 2], dtype=i32), tab=torch.tensor([[3, 1], [0, 4]], dtype=i32),
                             kv_lens=torch.tensor([7], dtype=i32))
    backend.pool = SimpleNamespace(tables=tables, store=SimpleNamespace(dev=(kv, kv)))
    batch = SimpleNamespace(extend_start_loc=torch.tensor([0], dtype=i32), extend_seq_lens=torch.tensor([5], dtype=i32))
    q = torch.randn(5, 2, 16)
    layer = SimpleNamespace(scaling=0.25, logit_cap=0.0, sliding_window_size=-1)
    got = backend.extend_layer(q, layer, 1, batch)
    want = paged_extend_ref(q, kv, kv, batch.extend_start_loc, batch.extend_seq_lens, tables.kv_indptr,
                            tables.tab[1], tables.kv_lens, sm_scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert seen == [101_376]
