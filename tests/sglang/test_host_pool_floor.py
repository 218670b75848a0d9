"""HostPoolFloor: the launcher's smallest host KV pool equals what the layered pool builds (issue 17).

The scheduler's pool (``LayeredTokenToKVPool``) holds ``ceil((size + page) / page)`` pages of
every layer (``SlotStoreConfig.host_bytes``); with ``--max-total-tokens T`` the launcher's floor
must be exactly that for ``size = T`` (page-aligned), so a cap below it is refused at launch and
a cap at it is accepted by both (``test_request_slo_server.py`` launches at the floor).
"""

from __future__ import annotations

import argparse

import pytest

from sglang_ext.host_pool_floor import HostPoolFloor

TINY = {"layers": 4, "kv_heads": 2, "head_dim": 16, "dtype_bytes": 2}
"""The tiny test model served in fp16."""


@pytest.mark.parametrize(("page_size", "max_total_tokens"), [(1, 4096), (16, 4096), (16, 4000), (64, 100), (1, 1)])
def test_floor_equals_the_pools_host_bytes(page_size: int, max_total_tokens: int) -> None:
    """With --max-total-tokens, the floor is the host pool SlotStoreConfig sizes for that pool."""
    torch = pytest.importorskip("torch")
    from sglang_ext.dataplane.slot_store_config import SlotStoreConfig

    floor = HostPoolFloor(**TINY, page_size=page_size, max_total_tokens=max_total_tokens)
    size = max_total_tokens // page_size * page_size  # SGLang page-aligns the pool's token count
    config = SlotStoreConfig(
        layers=4, page_size=page_size, kv_heads=2, head_dim=16,
        logical_pages=-(-(size + page_size) // page_size),  # as LayeredTokenToKVPool
        device_pages=1, dtype=torch.float16, device="cpu",
    )
    assert floor.min_bytes == config.host_bytes


def test_cap_at_the_floor_passes_and_just_below_is_refused() -> None:
    """min_gb (rounded up to the kB) is accepted; 1 kB less is refused naming the flag and range."""
    floor = HostPoolFloor(**TINY, page_size=1, max_total_tokens=4096)
    assert floor.min_bytes == 4097 * 4 * 2 * 2 * 16 * 2 == 2_097_664
    floor.check(floor.min_gb)
    floor.check(65536.0)
    with pytest.raises(ValueError) as info:
        floor.check(floor.min_gb - 1e-6)
    assert str(info.value).startswith(f"--kv-host-pool-gb={floor.min_gb - 1e-6:g} is out of range [0.002098, 65536] (GB)")
    with pytest.raises(ValueError) as info:
        floor.check(0.0001)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("--kv-host-pool-gb=0.0001 is out of range [0.002098, 65536] (GB) for this launch")
    assert "--max-total-tokens 4096" in message and "= 2097664 B" in message


def test_without_max_total_tokens_the_floor_is_two_pages() -> None:
    """Without --max-total-tokens only the least any pool holds is known: one page plus padding."""
    floor = HostPoolFloor(**TINY, page_size=16, max_total_tokens=None)
    assert floor.min_pages == 2 and floor.min_bytes == 2 * 16 * 4 * 2 * 2 * 16 * 2
    floor.check(floor.min_gb)
    with pytest.raises(ValueError, match="one page of 16 token"):
        floor.check(1e-6)


@pytest.mark.parametrize("field", ["layers", "kv_heads", "head_dim", "dtype_bytes", "page_size", "max_total_tokens"])
def test_fields_are_validated(field: str) -> None:
    """Every field must be an int in [1, 2**40] (max_total_tokens may be None)."""
    values = {**TINY, "page_size": 1, "max_total_tokens": 16}
    with pytest.raises(ValueError, match=rf"HostPoolFloor\.{field}=0 is out of range"):
        HostPoolFloor(**{**values, field: 0})


@pytest.mark.sglang
def test_from_server_args_reads_the_models_kv_shape(tiny_model_dir) -> None:
    """From SGLang's parsed ServerArgs for the tiny model (CPU recipe): 4 layers, 2 KV heads x 16,
    fp16 (SGLang serves the fp32 checkpoint in fp16), page 1, 4096 tokens; bf16 KV is 2 bytes."""
    from sglang_ext import compat
    from sglang_ext.testing.server import CPU_ARGS

    server_args_cls = compat.resolve(compat.SERVER_ARGS.path)
    parser = argparse.ArgumentParser()
    server_args_cls.add_cli_args(parser)

    def floor_for(*extra: str) -> HostPoolFloor:
        namespace = parser.parse_args(["--model-path", str(tiny_model_dir), *CPU_ARGS, *extra])
        return HostPoolFloor.from_server_args(server_args_cls.from_cli_args(namespace))

    assert floor_for() == HostPoolFloor(**TINY, page_size=1, max_total_tokens=4096)
    assert floor_for("--dtype", "float32").dtype_bytes == 4
    assert floor_for("--dtype", "float32", "--kv-cache-dtype", "bf16").dtype_bytes == 2
    assert floor_for("--page-size", "16").page_size == 16


def test_a_budget_of_every_layer_needs_no_host_pool_at_launch() -> None:
    """--kv-gpu-budget-tokens holding every layer of every page of --max-total-tokens is the
    identity layout, which pins no host pool: the launcher takes any --kv-host-pool-gb then. One
    page less keeps a host tier, and the cap below the floor is refused (control)."""
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from sglang_ext.args import LayeredKVArgs
    from sglang_ext.plugin import KvplanePlugin

    floor = HostPoolFloor(**TINY, page_size=16, max_total_tokens=4096)
    every = 4 * floor.min_pages * 16  # 4 layers x 257 pages of 16 tokens
    assert floor.on_device(every) and not floor.on_device(every - 16) and not floor.on_device(None)
    assert not HostPoolFloor(**TINY, page_size=16, max_total_tokens=None).on_device(every)
    model = SimpleNamespace(num_hidden_layers=4, get_num_kv_heads=lambda tp: 2, head_dim=16, dtype=SimpleNamespace(itemsize=2))
    args = SimpleNamespace(kv_cache_dtype="auto", tp_size=1, page_size=16, max_total_tokens=4096, device="cuda")
    check = KvplanePlugin._check_host_pool_floor
    check(model, args, LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=every, kv_host_pool_gb=1e-4), None)
    with pytest.raises(SystemExit):
        check(model, args, LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=every - 16, kv_host_pool_gb=1e-4),
              None)


def test_a_refused_host_pool_names_the_budget_that_declares_the_device_holds_it(capsys) -> None:
    """The launcher cannot know SGLang's memory profile, so it charges --max-total-tokens to the
    host pool; where the device holds it all, no host pool is pinned. A refusal (a cap below the
    floor; without one, a host with too little memory) names the --kv-gpu-budget-tokens that says
    so, and that budget passes (control: one page less is still refused, with the hint)."""
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from sglang_ext.args import LayeredKVArgs
    from sglang_ext.dataplane.host_memory_share import HostMemoryShare
    from sglang_ext.plugin import KvplanePlugin

    floor = HostPoolFloor(**TINY, page_size=16, max_total_tokens=4096)
    every = floor.on_device_budget
    assert every == 4 * floor.min_pages * 16 and floor.on_device(every) and not floor.on_device(every - 1)
    assert HostPoolFloor(**TINY, page_size=16, max_total_tokens=None).on_device_budget is None
    model = SimpleNamespace(num_hidden_layers=4, get_num_kv_heads=lambda tp: 2, head_dim=16, dtype=SimpleNamespace(itemsize=2))
    args = SimpleNamespace(kv_cache_dtype="auto", tp_size=1, page_size=16, max_total_tokens=4096, device="cuda")
    check = KvplanePlugin._check_host_pool_floor
    small_host = HostMemoryShare.at_launch(tp_size=1, pp_size=1, dp_size=1, nnodes=1, available=floor.min_bytes // 4)
    for layered, share in ((LayeredKVArgs(enable_layered_kv=True, kv_host_pool_gb=1e-4), None),
                           (LayeredKVArgs(enable_layered_kv=True), small_host),
                           (LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=every - 16), small_host)):
        with pytest.raises(SystemExit):
            check(model, args, layered, share)
        err = capsys.readouterr().err
        assert f"pass --kv-gpu-budget-tokens {every} (every layer of it)" in err, err
    check(model, args, LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=every), small_host)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("room", ["budget-fits", "nothing-fits"])
def test_on_cpu_the_hint_names_the_budget_only_where_its_launch_would_pass(capsys, room) -> None:
    """On --device cpu the device KV pool is host memory too: the identity budget moves every
    layer of --max-total-tokens from the host pool into the device pool, both in this host's
    memory. Where that fits (the two pools together did not), the refusal names the budget and
    a launch with it passes; where every layer alone does not fit, naming it only led to a
    second refusal -- the refusal says no budget helps (negative control: before, the hint was
    there and the relaunch was refused again)."""
    pytest.importorskip("sglang")
    from types import SimpleNamespace

    from sglang_ext.args import LayeredKVArgs
    from sglang_ext.dataplane.host_memory_share import HostMemoryShare
    from sglang_ext.plugin import KvplanePlugin

    floor = HostPoolFloor(**TINY, page_size=16, max_total_tokens=4096)
    every = floor.on_device_budget
    model = SimpleNamespace(num_hidden_layers=4, get_num_kv_heads=lambda tp: 2, head_dim=16, dtype=SimpleNamespace(itemsize=2))
    args = SimpleNamespace(kv_cache_dtype="auto", tp_size=1, page_size=16, max_total_tokens=4096, device="cpu")
    check = KvplanePlugin._check_host_pool_floor
    # 0.8 of it: 1.5x every layer (both pools need 2x), or 0.75x (every layer alone does not fit)
    available = int(floor.min_bytes * (1.5 if room == "budget-fits" else 0.75) / 0.8)
    host = HostMemoryShare.at_launch(tp_size=1, pp_size=1, dp_size=1, nnodes=1, available=available)
    with pytest.raises(SystemExit):
        check(model, args, LayeredKVArgs(enable_layered_kv=True), host)
    err = capsys.readouterr().err
    relaunch = LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=every)
    if room == "budget-fits":
        assert f"pass --kv-gpu-budget-tokens {every}" in err, err
        check(model, args, relaunch, host)
        assert capsys.readouterr().err == ""
    else:
        assert "--kv-gpu-budget-tokens" in err and f"pass --kv-gpu-budget-tokens {every}" not in err, err
        assert "no --kv-gpu-budget-tokens helps, lower --max-total-tokens" in err, err
        assert "a smaller device pool" not in err, err  # the host pool alone is refused first
        with pytest.raises(SystemExit):  # what the hint would have led to
            check(model, args, relaunch, host)
