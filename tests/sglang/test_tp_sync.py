"""TP broadcast of the plan: rank 0's decision is installed identically on every rank (OrbitFlow §3.5).

Scenario: two real processes (torch.multiprocessing spawn) joined in a gloo process group on CPU,
the way SGLang's schedulers share ``tp_cpu_group``. Only rank 0 has a control plane (the real
embedded controller with a budget that forces offloading and a pause); each rank owns a real
:class:`~sglang_ext.layered_pool.LayeredTokenToKVPool` (CPU, toy sizes) holding the same
requests' KV. After :meth:`TpSync.share` each rank installs the plan; the ranks' installs (the
install object, the wants, and the pool's resident (layer, page) map) must be identical.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from controlplane.service.ports import free_port  # noqa: E402
from sglang_ext.tp_sync import PlacementInstaller, StepInstall, TpSync  # noqa: E402

pytestmark = pytest.mark.sglang

LAYERS, HEADS, DIM, PAGE, SLOTS = 4, 2, 4, 1, 128
REQUESTS = {"a": list(range(0, 30)), "b": list(range(30, 50)), "c": list(range(50, 60))}
"""rid -> KV slots (page size 1: pages == slots)."""


def _make_pool():
    from sglang_ext.args import LayeredKVArgs
    from sglang_ext.layered_pool import LayeredTokenToKVPool

    pool = LayeredTokenToKVPool(
        size=SLOTS,
        page_size=PAGE,
        dtype=torch.float16,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=300),
    )
    gen = torch.Generator().manual_seed(0)
    for rid, slots in REQUESTS.items():
        loc = torch.tensor(slots)
        pool.prepare_step([(rid, loc)], loc)
        for layer in range(LAYERS):
            k = torch.randn(len(slots), HEADS, DIM, generator=gen).half()
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), loc, k, k + 1)
    return pool


def _rank0_install() -> StepInstall:
    """Rank 0: the real embedded controller plans a batch that does not fit the budget."""
    from controlplane.api import RequestState, StepReport, WorkerInfo
    from controlplane.embedded import EmbeddedControlPlane
    from controlplane.model import Hardware, ModelSpec, Profile

    worker = WorkerInfo(
        worker_id="tp-test",
        model=ModelSpec(layers=LAYERS, block_size=PAGE, block_bytes=2 * PAGE * HEADS * DIM * 2),
        hardware=Hardware(gpu_kv_budget_blocks=120, h2d_gbps=16.0),
        profile=Profile((1.0,) * LAYERS),
        tp_size=2,
    )
    session = EmbeddedControlPlane(synchronous=True).open_session(worker)
    running = tuple(RequestState(id=rid, context_tokens=len(s), generated_tokens=1) for rid, s in REQUESTS.items())
    decisions = session.report(StepReport(step=1, now_ms=1.0, running=running, observed_step_ms=4.0))
    d = decisions[-1]
    return StepInstall(step=2, pause=d.pause, resume=d.resume, placements=dict(d.plan.placements), reason=d.reason)


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = dist.new_group(ranks=[0, 1], backend="gloo")
        sync = TpSync(rank, 2, group, src=0)
        install = sync.share(_rank0_install() if rank == 0 else None)
        pool = _make_pool()
        installer = PlacementInstaller(pool, LAYERS)
        installer.apply(install)
        paused = {rid: tuple(REQUESTS[rid]) for rid in install.pause}
        running = {rid: tuple(s) for rid, s in REQUESTS.items() if rid not in paused}
        installer.install(running, paused)
        record = {
            "install": install,
            "wants": {rid: (w.pages, w.gpu_layers, w.paused) for rid, w in installer.last_wants.items()},
            "pool_gpu_layers": {rid: pool.residency.gpu_layers(rid) for rid in REQUESTS},
            "resident": (pool.store.map_cpu >= 0).tolist(),
            "stats": pool.residency_stats().to_dict(),
        }
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(record))
    finally:
        dist.destroy_process_group()


def test_rank0_plan_installed_identically_on_both_ranks(tmp_path):
    """Both gloo ranks install rank 0's plan: same install, same wants, same resident (layer, page) map."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0 = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    r1 = pickle.loads((tmp_path / "rank1.pkl").read_bytes())
    assert r0["install"] == r1["install"]
    assert r0["install"].placements, "rank 0 made no plan"
    assert r0["wants"] == r1["wants"]
    assert r0["pool_gpu_layers"] == r1["pool_gpu_layers"]
    assert r0["resident"] == r1["resident"]
    # residency state is identical; copy / stall seconds are each rank's own wall-clock measurements
    timed = {k for k in r0["stats"] if k.endswith("_seconds_total")}
    assert timed == {"h2d_seconds_total", "d2h_seconds_total", "stall_seconds_total"}
    assert {k: v for k, v in r0["stats"].items() if k not in timed} == \
        {k: v for k, v in r1["stats"].items() if k not in timed}
    # The plan really governs residency: the pool wants exactly the planned layers, and the
    # budget (120 layer-pages for 240 live ones) keeps part of the KV on host.
    for rid, row in r0["install"].placements.items():
        assert r0["pool_gpu_layers"][rid] == tuple(bool(x) for x in row), rid
    assert r0["stats"]["device_pages_used"] <= 120
    assert r0["stats"]["host_fraction"] >= 0.5


def test_single_rank_share_is_identity():
    """With tp_size 1 the install is returned as is (no process group needed)."""
    install = StepInstall(step=3, pause=("x",), placements={"y": (1, 0)})
    assert TpSync(0, 1).share(install) is install


def test_rank0_must_pass_an_install():
    """Rank 0 sharing nothing is a programming error named clearly."""
    with pytest.raises(ValueError, match="install"):
        TpSync(0, 1).share(None)


def test_placement_rows_of_another_length_are_refused_and_said() -> None:
    """A plan row that is not this model's length (a control plane planning another model) is
    not installed (that request runs all-GPU) and a warning names how many and one example;
    rows of the right length in the same install are installed. Control: an install of right
    rows says nothing."""
    from structlog.testing import capture_logs

    installer = PlacementInstaller(None, 4)
    with capture_logs() as logs:
        installer.apply(StepInstall(step=1, placements={"a": (1, 0, 1, 1), "b": (1, 0)}))
    assert installer.placements == {"a": (1, 0, 1, 1)}
    assert installer.gpu_layers("b") == (True,) * 4
    refused = [e for e in logs if e["event"] == "placement_rows_refused"]
    assert len(refused) == 1 and refused[0]["refused"] == 1 and refused[0]["example"] == ("b", 2)
    with capture_logs() as logs:
        installer.apply(StepInstall(step=2, placements={"a": (1, 1, 1, 1)}))
    assert not [e for e in logs if e["event"] == "placement_rows_refused"]
