"""A slot space beyond the device without a server: the device pages it leaves
(:class:`~sglang_ext.device_capacity.DeviceCapacity`), the configurator hook's decisions
(:class:`~sglang_ext.capacity_hooks.CapacityHooks`) and the layered pool built over it. The real profile,
hook and pool in a served SGLang: ``test_slot_space_server.py``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from sglang_ext.args import LayeredKVArgs
from sglang_ext.capacity_hooks import CapacityHooks
from sglang_ext.device_capacity import DeviceCapacity

LAYERS, PAGE, PAGE_BYTES = 32, 16, 2 * 16 * 8 * 128 * 2
"""Llama-3-8B on one GPU: 32 layers, pages of 16 tokens, a layer-page of K and V, 8 KV heads x 128, bf16."""


def test_the_device_keeps_the_profiles_tokens_at_every_layer_less_the_page_map():
    """420k profiled tokens, a 1M-token slot space: 26,250 pages a layer on the device, less the
    page map's mirror (32 x 62,501 int32 = 8.0 MB = 123 layer-pages of 64 KiB)."""
    cap = DeviceCapacity(profiled_tokens=420_000, slot_tokens=1_000_000)
    logical = -(-(1_000_000 + PAGE) // PAGE)
    mirror = -(-(LAYERS * logical * 4) // PAGE_BYTES)
    assert mirror == 123
    pages = cap.device_pages(layers=LAYERS, page_size=PAGE, logical_pages=logical, layer_page_bytes=PAGE_BYTES,
                             budget_tokens=None)
    assert pages == 420_000 // PAGE * LAYERS - mirror
    # an explicit budget inside the profile is the budget; one page more than fits is refused
    budget = (pages) * PAGE
    assert cap.device_pages(layers=LAYERS, page_size=PAGE, logical_pages=logical, layer_page_bytes=PAGE_BYTES,
                            budget_tokens=budget) == pages
    with pytest.raises(ValueError, match=r"--kv-gpu-budget-tokens=.*does not fit the device.*--mem-fraction-static"):
        cap.device_pages(layers=LAYERS, page_size=PAGE, logical_pages=logical, layer_page_bytes=PAGE_BYTES,
                         budget_tokens=budget + PAGE)
    with pytest.raises(ValueError, match="below one page"):
        cap.device_pages(layers=LAYERS, page_size=PAGE, logical_pages=logical, layer_page_bytes=PAGE_BYTES,
                         budget_tokens=PAGE - 1)


def test_the_default_must_stage_one_layer_of_the_slot_space():
    """Without a budget the device must hold one layer of the slot space beside the maps (the
    staging room's premise). The figure the refusal names is the largest slot space that passes:
    it does, and one page more is refused. Under --kv-cuda-graphs on two maps are kept."""
    profiled = 4096

    def pages(slot: int, maps: int = 1) -> int:
        logical = slot // PAGE + 1
        return DeviceCapacity(profiled_tokens=profiled, slot_tokens=slot).device_pages(
            layers=LAYERS, page_size=PAGE, logical_pages=logical, layer_page_bytes=PAGE_BYTES, budget_tokens=None,
            maps=maps)

    for maps in (1, 2):
        with pytest.raises(ValueError, match=r"one layer of the slot space.*at most (\d+),") as refused:
            pages(10_000_000, maps)
        assert "--mem-fraction-static" in str(refused.value) and "--kv-gpu-budget-tokens" in str(refused.value)
        most = int(re.search(r"at most (\d+),", str(refused.value)).group(1))
        assert most > 0 and pages(most, maps) >= most // PAGE + 1  # the figure named is accepted
        with pytest.raises(ValueError, match="one layer of the slot space"):
            pages(most + PAGE, maps)  # and one page more is not
    one, two = pages(8192), pages(8192, maps=2)
    assert one - two == DeviceCapacity.map_pages(layers=LAYERS, logical_pages=8192 // PAGE + 1,
                                                 layer_page_bytes=PAGE_BYTES) > 0


@pytest.mark.parametrize("profiled", [16, 50, 333, 4096, 100_000])
@pytest.mark.parametrize(("layers", "page", "page_bytes"), [(32, 16, PAGE_BYTES), (4, 1, 256), (80, 16, 2 * 16 * 8 * 128 * 2)])
@pytest.mark.parametrize("maps", [1, 2])
def test_the_largest_slot_space_named_is_exactly_the_boundary(profiled, layers, page, page_bytes, maps):
    """Against a scan of :meth:`device_pages` itself: the figure passes, one page more fails (the
    review's sweep found the old estimate refused with two maps)."""
    cap = DeviceCapacity(profiled_tokens=profiled, slot_tokens=10**9)
    most = cap.largest_slot_tokens(layers=layers, page_size=page, layer_page_bytes=page_bytes, maps=maps)

    def accepted(tokens: int) -> bool:
        try:
            cap.device_pages(layers=layers, page_size=page, logical_pages=tokens // page + 1,
                             layer_page_bytes=page_bytes, budget_tokens=None, maps=maps)
        except ValueError:
            return False
        return True

    assert most % page == 0 and not accepted(most + page)
    assert accepted(most) if most else not accepted(0)


@pytest.mark.parametrize(("profiled", "slot"), [(0, 10), (10, 10), (11, 10), (True, 10), (5, 2.5)])
def test_a_capacity_the_device_fits_or_not_a_count_is_refused(profiled, slot):
    with pytest.raises(ValueError, match="DeviceCapacity"):
        DeviceCapacity(profiled_tokens=profiled, slot_tokens=slot)


@dataclass
class Config:
    """SGLang's ``MemoryPoolConfig`` fields the hook reads."""

    max_total_num_tokens: int
    full_max_total_num_tokens: int | None = None
    swa_max_total_num_tokens: int | None = None
    unified_total_bytes: int | None = None


def sizing(cell: int, cap: int | None, page: int = 1, **extra: int):
    """SGLang's plain MHA sizing (``config_from_budget``): whole pages of ``budget // cell``
    tokens, capped by ``--max-total-tokens`` (``cap``), the calls recorded."""
    calls: list[tuple[int, dict]] = []

    def original(self, budget_bytes, **kwargs):  # noqa: ANN001, ANN202
        calls.append((budget_bytes, kwargs))
        tokens = budget_bytes // cell
        if cap is not None:
            tokens = min(tokens, cap)
        return Config(tokens // page * page, **extra)

    return original, calls


def test_the_hook_widens_a_cap_above_the_profile_and_records_the_capacity():
    original, calls = sizing(cell=1024, cap=4096)
    configurator, hooks = SimpleNamespace(), CapacityHooks(wanted=lambda: 4096)
    wide = hooks.around_config_from_budget(original, configurator, 1024 * 1024)
    assert wide.max_total_num_tokens == 4096
    assert hooks.capacity_of(configurator) == DeviceCapacity(profiled_tokens=1024, slot_tokens=4096)
    assert len(calls) == 2 and calls[1][0] >= 4096 * 1024  # the second sizing's budget holds the cap
    # a new profile of the same configurator that fits forgets the capacity
    hooks.wanted = lambda: 512
    hooks.around_config_from_budget(original, configurator, 1024 * 1024)
    assert hooks.capacity_of(configurator) is None


@pytest.mark.parametrize(("requests", "seen"), [(None, 1024), (64, 4096)])
def test_the_request_count_of_a_widened_slot_space_is_the_profiles(requests, seen):
    """SGLang's request count (and the request table on the device) is sized from the profiled
    tokens unless --max-running-requests is given; an unwidened configurator's stays its own."""
    original, _ = sizing(cell=1024, cap=4096)
    widened, hooks = SimpleNamespace(), CapacityHooks(wanted=lambda: 4096, requests=lambda: requests)
    hooks.around_config_from_budget(original, widened, 1024 * 1024)
    asked: list[int] = []

    def resolve(self, token_capacity):  # noqa: ANN001, ANN202
        asked.append(token_capacity)
        return token_capacity // 2

    assert hooks.around_resolve_max_num_reqs(resolve, widened, 4096) == seen // 2
    assert hooks.around_resolve_max_num_reqs(resolve, SimpleNamespace(), 4096) == 2048
    assert asked == [seen, 4096]


@pytest.mark.parametrize(("why", "cap", "wanted", "args", "kwargs", "extra"), [
    ("no --max-total-tokens", None, None, (1 << 20,), {}, {}),
    ("the profile fits it", 512, 512, (1 << 20,), {}, {}),
    ("post-capture resize", 4096, 4096, (1 << 20,), {"cap_tokens": 2048}, {}),
    ("hybrid SWA pool", 4096, 4096, (1 << 20,), {}, {"swa_max_total_num_tokens": 100}),
    ("unified pool", 4096, 4096, (1 << 20,), {}, {"unified_total_bytes": 1 << 20}),
])
def test_the_hook_leaves_sglangs_sizing_alone(why, cap, wanted, args, kwargs, extra):
    original, calls = sizing(cell=1024, cap=cap, **extra)
    configurator, hooks = SimpleNamespace(), CapacityHooks(wanted=lambda: wanted)
    config = hooks.around_config_from_budget(original, configurator, *args, **kwargs)
    assert config.max_total_num_tokens == min(1024, cap or 1 << 30), why
    assert len(calls) == 1 and hooks.capacity_of(configurator) is None and not hooks.capacities, why


def test_a_cap_within_the_profiles_last_page_is_not_widened():
    """Pages of 16: a profile of 1,000 tokens is 992 of them, and a cap of 1,000 sizes 992 too."""
    original, _ = sizing(cell=1024, cap=1000, page=16)
    configurator, hooks = SimpleNamespace(), CapacityHooks(wanted=lambda: 1000)
    assert hooks.around_config_from_budget(original, configurator, 1000 * 1024).max_total_num_tokens == 992
    assert hooks.capacity_of(configurator) is None


def test_the_pool_over_a_wider_slot_space_keeps_the_profile_on_the_device():
    """``LayeredTokenToKVPool.for_capacity``: the class itself without a capacity; with one, a
    subclass (still a ``LayeredTokenToKVPool``) whose device pages are the capacity's, and whose
    too-large ``--kv-gpu-budget-tokens`` is refused at construction."""
    pytest.importorskip("sglang")
    from sglang_ext.layered_pool import LayeredTokenToKVPool

    assert LayeredTokenToKVPool.for_capacity(None) is LayeredTokenToKVPool
    cap = DeviceCapacity(profiled_tokens=64, slot_tokens=128)
    cls = LayeredTokenToKVPool.for_capacity(cap)

    def build(budget):  # noqa: ANN001, ANN202
        return cls(size=128, page_size=2, dtype=torch.float16, head_num=2, head_dim=4, layer_num=3, device="cpu",
                   enable_memory_saver=False,
                   layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=budget))

    pool = build(None)
    assert isinstance(pool, LayeredTokenToKVPool) and pool.device_capacity == cap
    # measured: the device pool and the page map's mirror take at most the profile's bytes
    # (64 tokens x 3 layers x K,V x 2 heads x 4 x fp16), and the pool holds one layer of the slots
    store = pool.store
    assert store.mirror is not None and not store.config.identity
    assert store.dev.nbytes + store.mirror.dev.nbytes <= 64 * 3 * 2 * 2 * 4 * 2
    assert store.dev.nbytes + store.mirror.dev.nbytes > 0.9 * 64 * 3 * 2 * 2 * 4 * 2
    assert store.config.device_pages >= store.config.logical_pages
    assert build(20).store.config.device_pages == 10
    with pytest.raises(ValueError, match="does not fit the device"):
        build(64 * 3)


def test_the_resolver_hands_the_layered_pool_its_configurators_capacity():
    """Kind ``mha`` gets the layered pool, bound to the capacity the same configurator's sizing
    recorded (or the plain class when it recorded none); other kinds keep SGLang's answer."""
    pytest.importorskip("sglang")
    from sglang_ext.layered_pool import LayeredTokenToKVPool

    original, _ = sizing(cell=1024, cap=4096)
    widened, plain, hooks = SimpleNamespace(), SimpleNamespace(), CapacityHooks(wanted=lambda: 4096)
    hooks.around_config_from_budget(original, widened, 1024 * 1024)

    def sglangs(self, *, kind, default):  # noqa: ANN001, ANN202
        return default

    cls = hooks.around_resolve_kv_pool_class(sglangs, widened, kind="mha", default=object)
    assert issubclass(cls, LayeredTokenToKVPool) and cls.device_capacity == hooks.capacity_of(widened)
    assert hooks.around_resolve_kv_pool_class(sglangs, plain, kind="mha", default=object) is LayeredTokenToKVPool
    assert hooks.around_resolve_kv_pool_class(sglangs, widened, kind="mla", default=dict) is dict
