"""StoreCacheWriter: the served core's KV write in one launch a layer, with SGLang's own kernel.

SGLang's ``store_cache`` is a CUDA JIT kernel: it cannot run on this host. Its stand-in here,
:func:`store_cache_stand_in`, has its exact signature (checked against the installed SGLang)
and its semantics as the kernel's source states them (row ``i`` of K and V to row
``indices[i]`` of the caches, skipping ``reserved_skip_index``, which SGLang defaults to 0; the
source line is checked too). Driving the served core through the writer on the CPU then checks
what kvplane controls: the views and rows it passes, one call per layer, and ``-1`` as the skip
index -- with SGLang's default the core's device row 0 (real KV in the paged layout) is lost,
which the negative control shows.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from sglang_ext import store_cache_writer
from sglang_ext.store_cache_writer import StoreCacheWriter
from tests.dataplane.core_driver import HEADS, LAYERS, CoreDriver, make_core, offload_scenario

ROW_BYTES = HEADS * 4 * 4  # core_driver's heads x DIM 4 x float32


class StandIn:
    """SGLang's ``store_cache`` on the CPU (module docstring), recording the rows it wrote."""

    def __init__(self) -> None:
        self.rows_written: set[int] = set()
        self.calls = 0
        self.pool: torch.Tensor | None = None
        """The core's device pool: calls writing into it are counted in :attr:`pool_calls`."""
        self.pool_calls = 0
        self.drop_parks = False
        """Negative control: calls writing anywhere but the pool (parks) write nothing."""

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 indices: torch.Tensor, *, row_bytes: int = 0, v_row_bytes: int = 0, num_split: int = 0,
                 size_limit: int = 0, reserved_skip_index: int = 0) -> None:
        assert k.dim() == v.dim() == k_cache.dim() == v_cache.dim() == 2, "the kernel takes [n, H * D] rows"
        assert row_bytes == k.shape[1] * k.element_size() and v_row_bytes == v.shape[1] * v.element_size()
        limit = size_limit or k_cache.shape[0]
        assert bool(((indices >= 0) & (indices < limit)).all()), "the kernel asserts index < size_limit"
        into_pool = self.pool is not None and k_cache.untyped_storage().data_ptr() == self.pool.untyped_storage().data_ptr()
        keep = (indices != reserved_skip_index) & (into_pool or not self.drop_parks)
        k_cache[indices[keep]] = k[keep]
        v_cache[indices[keep]] = v[keep]
        self.calls += 1
        if into_pool:
            self.rows_written.update(indices[keep].tolist())
            self.pool_calls += 1


def store_cache_stand_in(k, v, k_cache, v_cache, indices, *, row_bytes=0, v_row_bytes=0, num_split=0,  # noqa: ANN001, ANN201
                         size_limit=0, reserved_skip_index=0):
    """The signature the stand-in must have (SGLang 0.5.23's ``store_cache``)."""


@pytest.mark.sglang
def test_the_stand_in_is_sglangs_store_cache_signature_and_skip_rule() -> None:
    """Same parameters, kinds and defaults as the installed ``store_cache``; its kernel source
    still skips ``reserved_skip_index``; ``can_use_store_cache`` takes the row widths first."""
    from sglang_ext import compat

    real = inspect.signature(compat.resolve(compat.KV_STORE_CACHE.path))
    ours = inspect.signature(store_cache_stand_in)
    strip = lambda sig: [(p.name, p.kind, p.default) for p in sig.parameters.values()]  # noqa: E731
    assert strip(real) == strip(ours)
    assert strip(inspect.signature(StandIn.__call__))[1:] == strip(ours)
    can_use = inspect.signature(compat.resolve(compat.KV_CAN_USE_STORE_CACHE.path))
    assert list(can_use.parameters)[:2] == ["k_row_bytes", "v_row_bytes"]
    module = inspect.getmodule(compat.resolve(compat.KV_STORE_CACHE.path))
    source = Path(module.__file__).parents[2] / "jit" / "csrc" / "elementwise" / "kvcache.cuh"
    assert "if (index != reserved_skip_index)" in source.read_text()


def _drive(device_pages: int | None, stand_in: StandIn) -> tuple[CoreDriver, StoreCacheWriter]:
    core = make_core(device_pages)
    writer = StoreCacheWriter(stand_in, ROW_BYTES)
    core.store.row_writer = writer
    stand_in.pool = core.store.dev
    driver = CoreDriver(core, seed=3)
    offload_scenario(driver)  # the shadow check inside every layer, and at rest
    return driver, writer


@pytest.mark.parametrize("device_pages", [None, 33 + 6], ids=["identity", "paged"])
def test_the_served_core_writes_each_layer_in_one_call(device_pages) -> None:
    """The scenario's prefill, decode steps, pause and resume: every layer's write into the pool
    is ONE kernel call, none falls back, and every token reads back exact (the driver's shadow
    checks inside each layer, and at rest from host memory). In the paged layout the writes
    reach device row 0, and the decode steps' new tokens of host-only layers are parked with
    one call a layer too (:class:`TokenWriteback`), not two copies."""
    stand_in = StandIn()
    driver, writer = _drive(device_pages, stand_in)
    assert writer.fallbacks == 0
    assert stand_in.pool_calls == LAYERS * driver.steps
    parks = stand_in.calls - stand_in.pool_calls
    assert writer.calls == stand_in.calls
    if device_pages is None:
        assert parks == 0  # the identity layout stages in place: nothing parks
    else:
        assert 0 in stand_in.rows_written
        assert parks > 0


def test_sglangs_default_skip_index_would_lose_row_zero(monkeypatch) -> None:
    """Negative control: with SGLang's default ``reserved_skip_index`` (0) the paged layout's
    device row 0 is never written, and the shadow check fails."""
    monkeypatch.setattr(store_cache_writer, "NO_SKIP", 0)
    with pytest.raises(AssertionError, match=r"\('[ab]', \d\)"):  # the driver's shadow check: (rid, layer)
        _drive(33 + 6, StandIn())


def test_parks_through_the_writer_are_what_reaches_host_memory() -> None:
    """Negative control of the parked path: a writer whose parks write nothing leaves the decode
    tokens of host-only layers out of host memory, and the driver's checks fail."""
    stand_in = StandIn()
    stand_in.drop_parks = True
    with pytest.raises(AssertionError, match=r"\('[ab]', \d\)"):  # a later step reads the host copy
        _drive(33 + 6, stand_in)


def test_rows_that_are_not_contiguous_go_through_two_index_copies() -> None:
    """A source whose ``H x D`` rows are not contiguous cannot be viewed as the kernel's rows:
    two ``index_copy_`` write it (counted), with the same result; contiguous rows take the kernel."""
    stand_in = StandIn()
    writer = StoreCacheWriter(stand_in, ROW_BYTES)
    k_dst, v_dst = torch.zeros(8, HEADS, 4), torch.zeros(8, HEADS, 4)
    rows = torch.tensor([5, 0, 2])
    k = torch.randn(3, 4, HEADS).transpose(1, 2)  # [3, H, D], not row-contiguous
    v = torch.randn(3, HEADS, 4)
    writer(k_dst, v_dst, rows, k, v)
    assert (writer.fallbacks, writer.calls, stand_in.calls) == (1, 0, 0)
    assert torch.equal(k_dst[rows], k) and torch.equal(v_dst[rows], v)
    writer(k_dst, v_dst, rows, k.contiguous() + 1, v + 1)
    assert (writer.fallbacks, writer.calls, stand_in.calls) == (1, 1, 1)
    assert torch.equal(k_dst[rows], k + 1) and torch.equal(v_dst[rows], v + 1)


def test_for_device_asks_sglang_only_on_cuda(monkeypatch) -> None:
    """Off CUDA: None, SGLang not asked. On CUDA: the writer when SGLang builds the kernel for
    the row width, None (two launches) when it refuses or cannot be resolved."""
    from sglang_ext import compat

    asked: list[tuple[int, int]] = []
    answer = {"usable": True, "raise": False}

    def resolve(path: str):  # noqa: ANN202
        if answer["raise"]:
            raise ImportError("no sglang.kernels here")
        if path == compat.KV_CAN_USE_STORE_CACHE.path:
            return lambda k_row, v_row: asked.append((k_row, v_row)) or answer["usable"]
        assert path == compat.KV_STORE_CACHE.path
        return StandIn()

    monkeypatch.setattr(compat, "resolve", resolve)
    assert StoreCacheWriter.for_device(torch.device("cpu"), 512) is None
    assert asked == []
    writer = StoreCacheWriter.for_device(torch.device("cuda"), 512)
    assert isinstance(writer, StoreCacheWriter) and writer.row_bytes == 512 and asked == [(512, 512)]
    answer["usable"] = False
    assert StoreCacheWriter.for_device(torch.device("cuda"), 512) is None
    answer["raise"] = True
    assert StoreCacheWriter.for_device(torch.device("cuda"), 512) is None
    with pytest.raises(ValueError, match="row_bytes"):
        StoreCacheWriter(StandIn(), 0)


def test_parks_take_their_rows_from_one_kept_tensor() -> None:
    """A writer's parks write to rows ``0..m-1`` that the store keeps (a view per step, no device
    op): the same storage step after step, grown by doubling when a batch is larger."""
    store = make_core(None).store
    a, b = store.row_ids(5), store.row_ids(3)
    assert a.tolist() == list(range(5)) and b.tolist() == list(range(3))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    c = store.row_ids(11)
    assert c.tolist() == list(range(11)) and c.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert store.row_ids(9).untyped_storage().data_ptr() == c.untyped_storage().data_ptr()  # kept: 11 rows
    d = store.row_ids(12)  # doubled: 22 rows kept
    assert store.row_ids(22).untyped_storage().data_ptr() == d.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()


@pytest.mark.sglang
def test_the_layered_pool_installs_the_writer_sglang_writes_through(monkeypatch) -> None:
    """The served adapter: ``LayeredTokenToKVPool`` asks for the writer of its device and row width
    at construction and installs it as the core's ``row_writer``; SGLang's ``set_kv_buffer``
    calls (the harness's steps, shadow-checked) then go through it, one call a layer. On the CPU
    SGLang's kernel is not asked for (the control: no writer, the writes still exact)."""
    from tests.sglang.test_layered_pool import DIM, HEADS, LAYERS, Harness, make_pool, wants

    asked: list[tuple[str, int]] = []
    stand_in = StandIn()

    def for_device(cls, device, row_bytes):  # noqa: ANN001, ANN202
        asked.append((device.type, row_bytes))
        return StoreCacheWriter(stand_in, row_bytes)

    plain = make_pool()
    assert plain.store.row_writer is None
    monkeypatch.setattr(StoreCacheWriter, "for_device", classmethod(for_device))
    pool = make_pool()
    assert asked == [("cpu", HEADS * DIM * 2)]  # float16 rows
    writer = pool.store.row_writer
    assert isinstance(writer, StoreCacheWriter)
    stand_in.pool = pool.store.dev
    h = Harness(pool, seed=4)
    h.step("a", 5)
    h.step("b", 3)
    pool.update_residency({"a": wants(pool, h, "a", [True, False, True])})
    for _ in range(3):
        h.step("a", 1)
        h.step("b", 1)
    h.check()
    assert stand_in.pool_calls == LAYERS * 8 and writer.fallbacks == 0
