"""PluginContext: kvplane's per-process state is one object built by register() and passed
explicitly -- no module-level mutable state, two contexts never share anything."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from sglang_ext import compat, settings
from sglang_ext.args import LayeredKVArgs
from sglang_ext.context import PluginContext

REPO = Path(__file__).resolve().parents[2]


def _frozen(node: ast.ClassDef) -> bool:
    """``@dataclass(frozen=True)``: its instances are values, not state."""
    return any(
        isinstance(d, ast.Call) and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in d.keywords)
        for d in node.decorator_list
    )


def _module_state(path: Path) -> list[str]:
    """Module-level mutable state in one file: ``global`` statements, names bound to dict / list /
    set displays or comprehensions, or to an instance of a class defined in the same module."""
    tree = ast.parse(path.read_text())
    own_classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef) and not _frozen(node)}
    found = [f"global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    mutable = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    for node in tree.body:
        targets: list[ast.expr] = []
        value = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            name = getattr(target, "id", None)
            if name is None or name == "__all__":
                continue
            own_instance = isinstance(value, ast.Call) and getattr(value.func, "id", None) in own_classes
            if isinstance(value, mutable) or own_instance:
                found.append(name)
    return found


def test_no_module_level_mutable_state_in_sglang_ext() -> None:
    """No module loaded by the plugin in SGLang's processes keeps mutable state at module level
    (``dataplane/`` and the ``tools/`` commands are not the plugin)."""
    offenders = {
        str(path.relative_to(REPO)): state
        for path in (REPO / "sglang_ext").rglob("*.py")
        if not {"dataplane", "tools"} & set(path.parts)
        and (state := _module_state(path))
    }
    assert offenders == {}


def test_checker_finds_the_state_it_looks_for(tmp_path: Path) -> None:
    """Negative control: a cache dict, a ``global`` and a module-level instance are found."""
    path = tmp_path / "m.py"
    path.write_text(
        "from dataclasses import dataclass\n@dataclass(frozen=True)\nclass V:\n    x: int = 0\n\n"
        "class S:\n    pass\n\n_state = S()\n_cache: dict = {}\nFROZEN = frozenset()\nVALUE = V()\n"
        "def f():\n    global _n\n    _n = 1\n"
    )
    assert _module_state(path) == ["global _n", "_state", "_cache"]


def test_context_reads_the_variables_and_builds_the_meter_only_with_the_flag(tmp_path: Path) -> None:
    """The meter exists only with the flag on and $KVPLANE_OVERHEAD_FILE set."""
    on = LayeredKVArgs(enable_layered_kv=True).to_json()
    overhead = str(tmp_path / "overhead.json")
    ctx = PluginContext.from_environ({settings.LAYERED_KV_ARGS_ENV: on, settings.OVERHEAD_FILE_ENV: overhead})
    assert ctx.enabled and ctx.env_error is None and ctx.meter is not None and str(ctx.meter.path) == overhead
    assert PluginContext.from_environ({settings.OVERHEAD_FILE_ENV: overhead}).meter is None
    assert not PluginContext.from_environ({}).enabled


def test_a_bad_variable_is_kept_as_the_context_error() -> None:
    """register() must not raise for a bad variable: the context keeps the message (and the
    options when they were readable), raised later at parse or publish."""
    on = LayeredKVArgs(enable_layered_kv=True).to_json()
    ctx = PluginContext.from_environ({settings.LAYERED_KV_ARGS_ENV: on, settings.WORKER_ID_ENV: "a b"})
    assert ctx.env_error is not None and ctx.env_error.startswith("KVPLANE_WORKER_ID='a b' is invalid")
    assert ctx.enabled and ctx.meter is None
    bad = PluginContext.from_environ({settings.LAYERED_KV_ARGS_ENV: "{"})
    assert bad.layered is None and "KVPLANE_LAYERED_KV_ARGS: not valid JSON" in (bad.env_error or "")


def test_contexts_do_not_share_registries_or_pacing_settings() -> None:
    """Each context has its own metrics registry (when one is given) and its own pacing settings,
    re-resolved when its options change."""
    a, b = PluginContext(metrics_registry=CollectorRegistry()), PluginContext(metrics_registry=CollectorRegistry())
    assert a.metrics_registry is not b.metrics_registry and PluginContext().metrics_registry is None
    assert a.pacing_settings() is None  # flag off
    a.layered = LayeredKVArgs(enable_layered_kv=True, kv_pacing="on")
    first = a.pacing_settings()
    assert first is not None and a.pacing_settings() is first and b.pacing_settings() is None
    a.layered = LayeredKVArgs(enable_layered_kv=True, kv_pacing="on", kv_report_interval=2)
    assert a.pacing_settings() is not first
    a.layered = LayeredKVArgs(enable_layered_kv=True, kv_pacing="off")
    assert a.pacing_settings() is None


@pytest.mark.sglang  # register() reaches SGLang's HookRegistry through sglang_ext.compat
def test_each_register_call_binds_its_hooks_to_its_own_context(monkeypatch) -> None:
    """Two register() calls install hooks bound to two distinct contexts (nothing process-wide)."""
    from sglang_ext import plugin

    registered: list[tuple[str, Any]] = []

    class Recorder:
        @staticmethod
        def register(target: str, hook: Any, hook_type: Any) -> None:
            registered.append((target, hook))

    monkeypatch.setattr(compat, "check_version", lambda: "0.5.23")
    monkeypatch.setattr(compat, "HookRegistry", Recorder, raising=False)
    monkeypatch.setattr(compat, "HookType", SimpleNamespace(AFTER="after", AROUND="around"), raising=False)
    monkeypatch.delenv(settings.LAYERED_KV_ARGS_ENV, raising=False)
    first, second = plugin.register(), plugin.register()
    assert first.ctx is not second.ctx
    bound = [getattr(hook, "__self__", None) for _, hook in registered]
    # from_cli_args, publish, stream, generate_request, generate_contract_error, init_request_dispatcher
    assert bound.count(first) == 6 and bound.count(second) == 6
    first.ctx.layered = LayeredKVArgs(enable_layered_kv=True)
    assert second.ctx.layered is None or not second.ctx.layered.enable_layered_kv


def _fake_scheduler() -> tuple[SimpleNamespace, SimpleNamespace]:
    backend = SimpleNamespace(layer_timer=None)
    pool = SimpleNamespace(head_num=2, head_dim=4, v_head_dim=4, dtype=SimpleNamespace(itemsize=2), device="cpu")
    scheduler = SimpleNamespace(
        enable_overlap=False,
        server_args=SimpleNamespace(pp_size=1, port=30000),
        model_config=SimpleNamespace(num_hidden_layers=2),
        page_size=1,
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool, size=64, available_size=lambda: 64),
        tree_cache=None,
        tp_size=1,
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(attn_backend=backend)),
        waiting_queue=[],
        running_batch=SimpleNamespace(reqs=[], is_empty=lambda: True),
        last_batch=None,
        chunked_req=None,
    )
    return scheduler, backend


def _hooked(environ: dict[str, str]) -> tuple[PluginContext, Any, Any]:
    """The context from ``environ``, a fake scheduler and its backend, the scheduler hooks installed."""
    from sglang_ext import scheduler_hooks

    ctx = PluginContext.from_environ(environ)
    ctx.metrics_registry = CollectorRegistry()
    scheduler, backend = _fake_scheduler()
    scheduler_hooks._after_init(ctx, None, scheduler)
    return ctx, scheduler, backend


def test_scheduler_hooks_take_meter_counter_and_files_from_the_context(tmp_path: Path) -> None:
    """Scenario: a scheduler process with the flag, the overhead meter and the stats file on runs
    one step through the hook functions (fake SGLang scheduler, embedded control plane, SGLang's
    --enable-metrics off): the attention backend gets the context's meter, no WorkerMetrics is
    built, the meter counts every part, the stats line is written."""
    pytest.importorskip("torch")  # scheduler_hooks -> layer_timing
    from sglang_ext import scheduler_hooks

    environ = {
        settings.LAYERED_KV_ARGS_ENV: LayeredKVArgs(enable_layered_kv=True).to_json(),
        settings.OVERHEAD_FILE_ENV: str(tmp_path / "overhead.json"),
        settings.STATS_FILE_ENV: str(tmp_path / "stats.jsonl"),
        settings.WORKER_ID_ENV: "unit-worker",
    }
    ctx, scheduler, backend = _hooked(environ)
    hooks = scheduler._kvplane
    try:
        assert backend.overhead_meter is ctx.meter
        assert backend.layer_timer is hooks.timer and hooks.worker.worker_id == "unit-worker"
        assert hooks.timer.eager_samples is hooks.overlap is False  # sampled steps may replay a graph
        assert hooks.client is not None and hooks.metrics is None
        req = SimpleNamespace(
            rid="r1", finished=lambda: False, origin_input_ids=[1, 2], output_ids=[],
            sampling_params=SimpleNamespace(max_new_tokens=4, custom_params=None),
            kv=SimpleNamespace(req_pool_idx=None, kv_allocated_len=0),
        )
        mode = SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True)
        batch = SimpleNamespace(reqs=[req], forward_mode=mode, is_empty=lambda: False)
        plan = SimpleNamespace(running_batch=scheduler.running_batch, batch_to_run=batch)
        for _ in range(2):  # the first step end only starts the meter's clock
            assert scheduler_hooks._around_next_batch(lambda s, **kw: plan, scheduler) is plan
            scheduler_hooks._around_run_batch(lambda s, b: None, scheduler, batch)
            scheduler_hooks._after_process_result(None, scheduler, batch, None)
        assert hooks.step == 2 and hooks.reporter is not None and hooks.reporter.reports == 2
        assert set(ctx.meter.kvplane_s) == {"boundary", "after_schedule", "run_batch", "end_step"} and ctx.meter.steps == 1
        lines = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2] and lines[0]["running"] == ["r1"]
    finally:
        hooks.client.close()


def test_prefill_placements_of_requests_the_worker_no_longer_holds_are_pruned(tmp_path: Path) -> None:
    """The control plane's admission layers (``min_gpu_layers``) for a request that finished or
    was aborted before its decision arrived -- or that never was this worker's -- stayed in the
    installer for good. Every ``PRUNE_EVERY`` steps, before SGLang takes from its queue, those of
    requests neither queued, running, just prefilled, prefilling in chunks nor parked go.
    Controls: the live ones stay, and off the cadence a ghost stays too."""
    pytest.importorskip("torch")
    from sglang_ext import scheduler_hooks
    from sglang_ext.tp_sync import StepInstall

    environ = {settings.LAYERED_KV_ARGS_ENV: LayeredKVArgs(enable_layered_kv=True).to_json(),
               settings.WORKER_ID_ENV: "unit-worker"}
    _, scheduler, _ = _hooked(environ)
    hooks = scheduler._kvplane
    try:
        def req(rid: str) -> SimpleNamespace:
            return SimpleNamespace(rid=rid, finished=lambda: False)

        scheduler.waiting_queue = [req("queued")]
        scheduler.running_batch = SimpleNamespace(reqs=[req("running")], is_empty=lambda: False)
        scheduler.chunked_req = req("chunked")
        extend = SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True)
        scheduler.last_batch = SimpleNamespace(reqs=[req("prefilled")], forward_mode=extend, is_empty=lambda: False)
        installer = hooks.installer
        installer.apply(StepInstall(step=1, prefill_layers={
            rid: 1 for rid in ("queued", "running", "chunked", "prefilled", "ghost")}))
        plan = SimpleNamespace(running_batch=scheduler.running_batch, batch_to_run=None)
        hooks.step = scheduler_hooks.PRUNE_EVERY + 1  # off the cadence: nothing pruned
        scheduler_hooks._around_next_batch(lambda s, **kw: plan, scheduler)
        assert set(installer.prefill_placements) == {"queued", "running", "chunked", "prefilled", "ghost"}
        hooks.step = 2 * scheduler_hooks.PRUNE_EVERY

        def takes_from_the_queue(s, **kw):  # noqa: ANN001, ANN202 - SGLang schedules the queued request
            s.waiting_queue = []
            return plan

        scheduler_hooks._around_next_batch(takes_from_the_queue, scheduler)
        assert set(installer.prefill_placements) == {"queued", "running", "chunked", "prefilled"}
    finally:
        hooks.client.close()


def test_the_live_set_holds_every_request_the_worker_still_holds():
    """``live_request_ids``: queued, running, just prefilled, prefilling in chunks and parked (a
    pause keeps a request's KV out of the batch); nothing else."""
    from sglang_ext.admission import live_request_ids

    def req(rid: str) -> SimpleNamespace:
        return SimpleNamespace(rid=rid)

    class Parked:
        def __len__(self) -> int:
            return 1

        def parked(self) -> list[SimpleNamespace]:
            return [SimpleNamespace(req=req("parked"))]

    scheduler = SimpleNamespace(waiting_queue=[req("queued")], chunked_req=req("chunked"))
    live = live_request_ids(scheduler, SimpleNamespace(reqs=[req("running")]), SimpleNamespace(reqs=[req("prefilled")]),
                            Parked())
    assert live == {"queued", "chunked", "running", "prefilled", "parked"}
    empty = SimpleNamespace(waiting_queue=[], chunked_req=None)
    assert live_request_ids(empty, SimpleNamespace(reqs=[]), None, []) == set()
