"""Admission by batch limits with prefill offload (OrbitFlow §5.1), the eviction order of paused
layers (OrbitFlow §3.4) and the batch slot a paused request gives up."""

from __future__ import annotations

from controlplane.controller.schedulers.fcfs import FcfsScheduler
from simulator.engine import Engine, SimConfig
from simulator.policies import make_policy
from simulator.profile import load_profile
from simulator.state import PAUSED, RUNNING, SimRequest
from simulator.trace import TraceRequest
from tests.simulator.helpers import A5000


def burst(n: int, prompt: int, out: int = 40) -> list[TraceRequest]:
    """``n`` requests arriving together; generous SLOs (admission is what is tested)."""
    return [TraceRequest(f"r{i}", float(i), prompt, out, 1e7, 1e5) for i in range(n)]


def max_decode_batch(policy, trace) -> tuple[int, object]:  # noqa: ANN001
    prof = load_profile(A5000)
    res = Engine(prof, trace, policy, SimConfig(record_steps=True)).run()
    return max(s.tokens for s in res.step_log if s.kind == "decode"), res


def test_orbitflow_admits_by_batch_limits_and_offloads_at_prefill() -> None:
    """Scenario: three 12K-token prompts arrive at once on the A5000 preset (16K tokens of KV fit
    the GPU, 32K tokens per batch). Two fit the token budget: both decode together, the second
    prompt's layers that do not fit offloaded at prefill; the third waits for a slot."""
    n, res = max_decode_batch(make_policy("orbitflow"), burst(3, 12_000))
    assert n == 2
    second = res.requests[1]
    assert second.min_gpu_layers is not None and second.min_gpu_layers < 32
    assert res.forced_fallbacks == 0 and res.worker_admissions == 0


def test_uniform_baseline_admits_like_orbitflow_and_full_kv_rule_does_not() -> None:
    """flexgen+ admits through the same FCFS rule (two 12K prompts decode together); with the
    full-kv ablation rule (whole prompt must fit free memory) only one runs at a time."""
    n, _ = max_decode_batch(make_policy("flexgen+"), burst(3, 12_000))
    assert n == 2
    pol = make_policy("flexgen+")
    start = pol.start

    def start_full_kv(profile, trace):  # noqa: ANN001, ANN202
        start(profile, trace)
        pol._fcfs = FcfsScheduler("full-kv")

    pol.start = start_full_kv
    n, _ = max_decode_batch(pol, burst(3, 12_000))
    assert n == 1


def test_batch_size_limit_bounds_the_batch() -> None:
    """Six short prompts: at most max_batch_size (4) decode together."""
    n, _ = max_decode_batch(make_policy("orbitflow"), burst(6, 1000))
    assert n == 4


def _engine_with(paused_layers: int, resident: int, target: int) -> tuple[Engine, SimRequest,
                                                                          SimRequest]:
    prof = load_profile(A5000).with_changes(gpu_kv_budget_blocks=32 * 64)  # 64 blocks x 32
    trace = [TraceRequest("run", 0.0, 1024, 10, 1e7, 1e5), TraceRequest("par", 0.0, 1024, 10,
                                                                        1e7, 1e5)]
    eng = Engine(prof, trace, make_policy("orbitflow"))
    run, par = eng.reqs["run"], eng.reqs["par"]  # 64 blocks per layer each
    run.state, par.state = RUNNING, PAUSED
    run.resident = tuple([1] * resident + [0] * (32 - resident))
    run.target = tuple([1] * target + [0] * (32 - target))
    par.resident = tuple([1] * paused_layers + [0] * (32 - paused_layers)) if paused_layers \
        else None
    eng.running, eng.paused, eng.queue = [run], [par], []
    return eng, run, par


def test_paused_layers_are_evicted_before_running_promotions_are_deferred() -> None:
    """Scenario (the audit's): a running request wants 20 GPU layers, holds 10; a paused one
    holds 16. Budget 32 layers of its size: the paused layers go (lazily, only as many as
    needed), the running request's promotions stay."""
    eng, run, par = _engine_with(paused_layers=16, resident=10, target=20)
    eng._force_fit()
    assert run.target == tuple([1] * 20 + [0] * 12)  # promotion kept
    assert par.resident is not None and sum(par.resident) == 32 - 21  # 20 + 1 staging kept
    assert eng.res.forced_fallbacks == 0
    # negative control: with nothing paused to evict and too little memory, promotions defer
    eng, run, _ = _engine_with(paused_layers=0, resident=10, target=32)
    eng.p = eng.p.with_changes(gpu_kv_budget_blocks=64 * 20)
    eng._force_fit()
    assert sum(run.target) < 32


def test_controller_is_told_the_paused_layers() -> None:
    """The controlled worker reports paused requests' resident layers and counts them as held in
    free_gpu_blocks (so the scheduler sees them as evictable, not as free twice)."""
    from simulator.state import EngineView

    eng, run, par = _engine_with(paused_layers=16, resident=10, target=10)
    pol = eng.policy
    pol.start(eng.p, eng.trace)
    reports = []
    session = pol.session
    orig = session.report

    def spy(rep):  # noqa: ANN001, ANN202
        reports.append(rep)
        return orig(rep)

    session.report = spy
    view = EngineView(1, 0.0, eng.p, (), (run,), (par,), (), 0, 0.0)
    pol.decide(view)
    (rep,) = reports
    states = {s.id: s for s in rep.running}
    assert states["par"].paused and states["par"].gpu_layers == 16
    assert rep.free_gpu_blocks == 32 * 64 - 64 * (10 + 16)


def _pair(run_resident: tuple[int, ...] | None, run_target: tuple[int, ...], par_layers: int,
          budget: int, par_prompt: int = 200_000) -> tuple[Engine, SimRequest, SimRequest]:
    """A running request of 64 blocks a layer and a paused one of ``par_prompt`` tokens
    (12,500 blocks a layer at 200K) holding its first ``par_layers`` layers."""
    prof = load_profile(A5000).with_changes(gpu_kv_budget_blocks=budget)
    trace = [TraceRequest("run", 0.0, 1024, 10, 1e7, 1e5), TraceRequest("par", 0.0, par_prompt, 10, 1e7, 1e5)]
    eng = Engine(prof, trace, make_policy("orbitflow"))
    run, par = eng.reqs["run"], eng.reqs["par"]
    run.state, par.state = RUNNING, PAUSED
    run.resident, run.target = run_resident, run_target
    par.resident = tuple([1] * par_layers + [0] * (32 - par_layers)) if par_layers else None
    eng.running, eng.paused, eng.queue = [run], [par], []
    return eng, run, par


def test_an_evicted_paused_layer_is_written_back_within_the_step() -> None:
    """Evicting a paused layer moves its blocks to host memory (OrbitFlow §3.4: a resume fetches
    "at most those evicted blocks"), overlapped with the step as a demotion is: a running request
    promoting 10 layers next to a paused 200K-token one (12,500 blocks a layer) evicts one paused
    layer, and the step takes at least its 108 ms of D2H (the decode alone: 62 ms). Before
    (session 87's simulator review), evictions cost nothing. Control: with room for the
    promotions nothing is evicted and the step is the decode's."""
    row = tuple([1] * 10 + [0] * 22), tuple([1] * 20 + [0] * 12)
    eng, run, par = _pair(*row, par_layers=16, budget=16 * 12_500 + 11 * 64)
    info = eng._decode_step(0.0, 0.0, 0.0)
    assert eng.res.evicted_blocks == 12_500 and sum(par.resident) == 15
    assert info.dur_ms >= 12_500 / eng.p.d2h_blocks_per_ms > 100.0
    eng, run, par = _pair(*row, par_layers=16, budget=16 * 12_500 + 21 * 64)
    info = eng._decode_step(0.0, 0.0, 0.0)
    assert eng.res.evicted_blocks == 0 and info.dur_ms < 70.0


def test_a_running_request_with_no_gpu_layer_gains_none_from_the_safety_net() -> None:
    """A running request holding no GPU layer (resumed after every layer was evicted) whose plan
    promotes 31 layers that do not fit: its promotions are deferred (it runs on its staging slot)
    -- it is not handed GPU residency no transfer paid for. Before (session 87's review), the
    safety net left its promotions, then marked up to 31 layers resident at the fallback (272 ms of
    H2D never charged in the reviewer's trace). Control: with room, the promotions stay."""
    target = tuple([1] * 31 + [0])
    eng, run, _ = _pair(None, target, par_layers=0, budget=12 * 64)
    eng._force_fit()
    assert run.resident is None and run.target == (0,) * 32 and eng.res.forced_fallbacks == 0
    eng, run, _ = _pair(None, target, par_layers=0, budget=32 * 64)
    eng._force_fit()
    assert run.resident is None and run.target == target
