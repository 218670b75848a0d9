"""Schedulers: fcfs, LayerKV (Eq. 1-4), SuperInfer LVF (VLT, rotation, transfer budget)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.api import InvalidArgument, QueuedRequest
from controlplane.controller.batch_limits import UNLIMITED, BatchLimits
from controlplane.controller.schedulers import SCHEDULERS, make_scheduler
from controlplane.controller.schedulers.base import RequestView, SchedulerView
from controlplane.controller.schedulers.fcfs import FcfsScheduler
from controlplane.controller.schedulers.layerkv import (
    LayerKVScheduler,
    allow_prefill_ms,
    min_gpu_layers,
    prefill_ms,
)
from controlplane.controller.schedulers.lvf import vlt_entries
from controlplane.model import Hardware, ModelSpec
from controlplane.policy import Policy

PAPER = LayerKVScheduler("paper")
MODEL = ModelSpec(layers=4, block_size=16, block_bytes=16 * 1024)  # 1 KiB per token per layer


def req(
    rid: str,
    *,
    ctx: int = 160,
    gen: int = 10,
    slo: float = 100.0,
    first_seen: float = 0.0,
    run_since: float = 0.0,
    last_token: float = 0.0,
    paused: bool = False,
) -> RequestView:
    return RequestView(
        id=rid,
        context_tokens=ctx,
        generated_tokens=gen,
        slo_tbt_ms=slo,
        first_seen_ms=first_seen,
        run_since_ms=run_since,
        last_token_ms=last_token,
        paused=paused,
    )


def view(
    *,
    now: float = 1000.0,
    running: tuple[RequestView, ...] = (),
    paused: tuple[RequestView, ...] = (),
    queued: tuple[QueuedRequest, ...] = (),
    free: int = 10_000,
    tpot: float = 50.0,
    policy: Policy | None = None,
    limits: BatchLimits = UNLIMITED,
) -> SchedulerView:
    return SchedulerView(
        step=1,
        now_ms=now,
        running=running,
        paused=paused,
        queued=queued,
        model=MODEL,
        hardware=Hardware(gpu_kv_budget_blocks=100_000, h2d_gbps=1.0),
        layer_compute_ms=(1.0,) * MODEL.layers,
        h2d_gbps=1.0,
        tpot_ms=tpot,
        free_gpu_blocks=free,
        policy=policy or Policy(),
        limits=limits,
    )


def q(rid: str, prompt: int, arrival: float = 0.0, ttft: float | None = None) -> QueuedRequest:
    return QueuedRequest(id=rid, prompt_tokens=prompt, arrival_ms=arrival, slo_ttft_ms=ttft)


def test_registry_rejects_unknown_names() -> None:
    """make_scheduler raises InvalidArgument naming the field and the allowed values."""
    assert set(SCHEDULERS) == {"fcfs", "layerkv", "lvf"}
    with pytest.raises(InvalidArgument, match=r"worker\.scheduler: 'edf' is not one of"):
        make_scheduler("edf", "worker.scheduler")
    assert make_scheduler("lvf").name == "lvf"


def test_fcfs_full_kv_rule_admits_in_arrival_order_while_memory_allows() -> None:
    """The full-kv ablation admits by arrival and stops at the first prompt that does not fit."""
    # prompt 64 tokens -> 4 blocks/layer -> 16 blocks; 32 tokens -> 8 blocks
    queued = (q("c", 32, arrival=3.0), q("a", 64, arrival=1.0), q("b", 64, arrival=2.0))
    d = FcfsScheduler("full-kv").schedule(view(queued=queued, free=40))
    assert d.admit == ("a", "b", "c")  # 16 + 16 + 8 = 40
    d = FcfsScheduler("full-kv").schedule(view(queued=queued, free=31))
    assert d.admit == ("a",)  # b (16) does not fit in 15: c must not overtake it
    assert not d.pause and not d.resume


def test_fcfs_admits_by_batch_limits_not_memory() -> None:
    """Default fcfs (OrbitFlow §5.1): memory does not gate admission; the batch size and token
    budget do, and a prompt keeps on the GPU only the layers that fit (the rest offloaded).

    Scenario: 4 layers, free 20 blocks; a (64 tokens = 4 blocks/layer, 16 in all) fits whole;
    b (64) gets (20 - 16) // 4 - 1 = 0 retained layers (one staging layer); c (32) would fit a
    batch of 3 but the batch-size limit is 2 (one request is running), so c waits.
    """
    queued = (q("c", 32, arrival=3.0), q("a", 64, arrival=1.0), q("b", 64, arrival=2.0))
    running = (req("r", ctx=16),)
    limits = BatchLimits(max_requests=3)
    d = make_scheduler("fcfs").schedule(view(queued=queued, free=20, running=running,
                                             limits=limits))
    assert d.admit == ("a", "b")
    assert d.min_gpu_layers == {"a": 4, "b": 0}
    # negative control: the full-kv rule admits only what fits whole (a)
    d = FcfsScheduler("full-kv").schedule(view(queued=queued, free=20, running=running,
                                               limits=limits))
    assert d.admit == ("a",)
    # unlimited batch: c is admitted too, with 0 retained layers, in arrival order
    d = make_scheduler("fcfs").schedule(view(queued=queued, free=20))
    assert d.admit == ("a", "b", "c")


def test_fcfs_token_budget_stops_admission_in_order() -> None:
    """The batch token budget stops admission at the first prompt that exceeds it (no
    overtaking); a lone request is admitted whatever its length."""
    running = (req("r", ctx=100),)
    queued = (q("a", 200, arrival=1.0), q("b", 10, arrival=2.0))
    d = make_scheduler("fcfs").schedule(
        view(queued=queued, running=running, limits=BatchLimits(max_tokens=250)))
    assert d.admit == ()  # 100 + 200 > 250 and b must not overtake a
    d = make_scheduler("fcfs").schedule(
        view(queued=queued, running=running, limits=BatchLimits(max_tokens=300)))
    assert d.admit == ("a",)  # 300 <= 300; 310 > 300
    d = make_scheduler("fcfs").schedule(view(queued=queued, limits=BatchLimits(max_tokens=50)))
    assert d.admit == ("a",)  # alone, longer than the budget: admitted (the worker chunks it)


def test_fcfs_counts_paused_layers_as_evictable_and_paused_hold_no_slot() -> None:
    """Paused requests hold no batch slot, and their resident layers count as free space for a
    new prompt (evicted when needed, OrbitFlow §3.4)."""
    paused = (RequestView("p", 160, 1, 100.0, 0.0, 0.0, 0.0, paused=True, gpu_layers=4),)
    queued = (q("a", 160),)  # 10 blocks/layer, 40 in all
    limits = BatchLimits(max_requests=1)
    d = make_scheduler("fcfs").schedule(view(queued=queued, paused=paused, free=0,
                                             limits=limits))
    assert d.admit == ("a",) and d.min_gpu_layers == {"a": 4}  # p's 40 blocks are evictable
    gone = (RequestView("p", 160, 1, 100.0, 0.0, 0.0, 0.0, paused=True, gpu_layers=0),)
    d = make_scheduler("fcfs").schedule(view(queued=queued, paused=gone, free=0, limits=limits))
    assert d.admit == ("a",) and d.min_gpu_layers == {"a": 0}


def test_fcfs_rejects_unknown_admission_rule() -> None:
    """An unknown admission rule is a ValueError naming the allowed ones."""
    with pytest.raises(ValueError, match="full-kv"):
        FcfsScheduler("memory")


def test_layerkv_equations_by_hand() -> None:
    """Eq. 1, Eq. 3 and Eq. 4 match hand-computed values."""
    policy = Policy.from_dict(
        {
            "layerkv": {
                "tpot_margin": 0.5,
                "model_params": 1e9,
                "hidden_size": 1000,
                "device_tflops": 1.0,
            }
        }
    )
    p = policy.layerkv
    r = req("d", gen=10, slo=100.0, first_seen=0.0)
    v = view(now=300.0, running=(r,), tpot=20.0, policy=policy)
    # Eq. 1: T_tpot = 50; N_future = max(1, 0 - 10) = 1; 50 * 11 - (300 + 20 * 1) = 230
    assert allow_prefill_ms(r, v, p) == pytest.approx(230.0)
    # Eq. 3: 1e3 * 1 * 100 * (2e9 + 2 * 100 * 1000) / 1e12 = 200.02 ms
    assert prefill_ms(100, p) == pytest.approx(1e3 * 100 * (2e9 + 2e5) / 1e12)
    # Eq. 4: per layer 100 tokens * 1024 B / (1e6 B/ms) = 0.1024 ms -> 200 ms hides all 4 layers
    assert min_gpu_layers(100, v, p) == 0
    slow = Policy.from_dict(
        {"layerkv": {"device_tflops": 1e5, "model_params": 1e6, "offload_correction": 1.0}}
    )
    # T_prefill = 1e3 * 100 * (2e6 + 2*100*4096) / 1e17 = 2.82e-6 ms << 0.1024 ms per layer -> keep 4
    assert min_gpu_layers(100, v, slow.layerkv) == MODEL.layers
    mid = Policy.from_dict(
        {"layerkv": {"device_tflops": 1.0, "model_params": 1.25e6, "hidden_size": 1}}
    )
    t_prefill = prefill_ms(100, mid.layerkv)  # 1e3 * 100 * (2.5e6 + 200) / 1e12 = 0.25002 ms
    per_layer = 100 * 1024 / 1e6  # 0.1024 ms per offloaded layer
    assert math.floor(t_prefill / per_layer) == 2
    assert min_gpu_layers(100, v, mid.layerkv) == MODEL.layers - 2


def test_layerkv_admits_fewer_prefills_when_decodes_near_slo() -> None:
    """(paper rule) The closer the decoding requests are to their TPOT SLO, the fewer prefills are admitted."""
    policy = Policy.from_dict(
        {"layerkv": {"model_params": 1e9, "hidden_size": 1000, "device_tflops": 1.0}}
    )
    queued = tuple(q(f"q{i}", 100, arrival=float(i)) for i in range(6))  # 200.02 ms each
    # Relaxed: 100 tokens in 2000 ms against a 90 ms TPOT target -> T_allow = 90*101 - 2050 = 7040
    relaxed = req("d", gen=100, slo=100.0, first_seen=0.0)
    d1 = PAPER.schedule(
        view(now=2000.0, running=(relaxed,), queued=queued, policy=policy)
    )
    # Tight: same tokens in 8500 ms -> T_allow = 9090 - 8550 = 540 -> two prefills (400 < 540)
    tight = req("d", gen=100, slo=100.0, first_seen=0.0)
    d2 = PAPER.schedule(
        view(now=8500.0, running=(tight,), queued=queued, policy=policy)
    )
    # Over budget already: nothing admitted.
    d3 = PAPER.schedule(
        view(now=9100.0, running=(tight,), queued=queued, policy=policy)
    )
    assert d1.admit == tuple(f"q{i}" for i in range(6))
    assert d2.admit == ("q0", "q1")
    assert d3.admit == ()
    assert set(d2.min_gpu_layers) == {"q0", "q1"}


def test_layerkv_respects_memory_and_token_cap() -> None:
    """(paper rule) Admission stops when the retained layers do not fit or the token cap is reached."""
    policy = Policy.from_dict({"layerkv": {"max_prefill_tokens": 150}})
    queued = (q("a", 100, 0.0), q("b", 100, 1.0))
    d = PAPER.schedule(view(queued=queued, policy=policy))
    assert d.admit == ("a",)  # 200 tokens > cap 150
    big = (q("huge", 1000, 0.0),)
    assert PAPER.schedule(view(queued=big, policy=policy)).admit == ("huge",)
    assert PAPER.schedule(view(queued=queued, free=0)).admit == ()


def test_kvplane_layerkv_predicts_the_decode_slowdown_of_an_admission() -> None:
    """Scenario: one decoding request with slack for one prefill at its current 20 ms TPOT; the
    queued prompt's KV does not fit (budget 100 blocks, 4 layers), so every later step streams
    its offloaded layers over a slow link and the predicted TPOT exceeds the target: kvplane's
    rule holds it; the paper's rule (current TPOT) admits it."""
    policy = Policy.from_dict(
        {"layerkv": {"model_params": 1e9, "hidden_size": 1000, "device_tflops": 1.0,
                     "output_len_lower_bound": 200}}
    )
    running = (req("d", ctx=160, gen=100, slo=100.0),)  # 10 blocks/layer
    queued = (q("big", 800, arrival=1000.0, ttft=1e6),)  # 50 blocks/layer: 60*4 > 100
    v = SchedulerView(
        step=1, now_ms=2000.0, running=running, paused=(), queued=queued, model=MODEL,
        hardware=Hardware(gpu_kv_budget_blocks=100, h2d_gbps=0.01),
        layer_compute_ms=(5.0,) * 4, h2d_gbps=0.01, tpot_ms=20.0, free_gpu_blocks=60,
        policy=policy,
    )
    assert PAPER.schedule(v).admit == ("big",)
    assert make_scheduler("layerkv").schedule(v).admit == ()
    # negative control: with a fast link the offloaded layers hide; kvplane admits it too
    fast = dataclasses.replace(v, h2d_gbps=1e6)
    assert make_scheduler("layerkv").schedule(fast).admit == ("big",)


def test_kvplane_layerkv_ages_waiting_prompts() -> None:
    """A prompt Eq. 2 would hold is admitted once it has used AGING_FRACTION (0.5) of its TTFT
    SLO (waiting plus its own prefill); before that it waits."""
    policy = Policy.from_dict(
        {"layerkv": {"model_params": 1e9, "hidden_size": 1000, "device_tflops": 1.0}}
    )
    tight = req("d", gen=100, slo=100.0, first_seen=0.0)  # no slack from now=9100 on
    queued = (q("a", 100, arrival=8600.0, ttft=2000.0),)  # T_prefill = 200.02 ms
    early = view(now=9100.0, running=(tight,), queued=queued, policy=policy)
    assert make_scheduler("layerkv").schedule(early).admit == ()  # 500 + 200 < 1000
    late = view(now=9500.0, running=(tight,), queued=queued, policy=policy)
    assert make_scheduler("layerkv").schedule(late).admit == ("a",)  # 900 + 200 >= 1000


def test_kvplane_layerkv_ages_by_the_policy_ttft_slo_by_default() -> None:
    """Scenario: a prompt without its own TTFT SLO. It ages against the policy's ``slo_ttft_ms``
    (the default every other reader of it uses) unless ``layerkv.ttft_slo_ms`` overrides it; it
    aged against a separate 5000 ms default, so a policy's tighter TTFT SLO never reached
    LayerKV's admission (control-plane review, session 77)."""
    model = {"model_params": 1e9, "hidden_size": 1000, "device_tflops": 1.0}
    tight = req("d", gen=100, slo=100.0, first_seen=0.0)
    queued = (q("a", 100, arrival=8600.0),)  # no own TTFT SLO; T_prefill = 200.02 ms
    late = {"now": 9500.0, "running": (tight,), "queued": queued}  # 900 + 200 >= 1000 = 0.5 * 2000
    inherit = Policy.from_dict({"slo_ttft_ms": 2000.0, "layerkv": model})
    assert inherit.layerkv.ttft_slo_ms == 0.0
    assert make_scheduler("layerkv").schedule(view(**late, policy=inherit)).admit == ("a",)
    # the controls: a looser policy SLO, or a looser override, holds it
    loose = Policy.from_dict({"slo_ttft_ms": 5000.0, "layerkv": model})
    assert make_scheduler("layerkv").schedule(view(**late, policy=loose)).admit == ()
    override = Policy.from_dict({"slo_ttft_ms": 2000.0, "layerkv": {**model, "ttft_slo_ms": 5000.0}})
    assert make_scheduler("layerkv").schedule(view(**late, policy=override)).admit == ()
    # and an override tighter than the policy's SLO is the one aged against
    tighter = Policy.from_dict({"slo_ttft_ms": 5000.0, "layerkv": {**model, "ttft_slo_ms": 2000.0}})
    assert make_scheduler("layerkv").schedule(view(**late, policy=tighter)).admit == ("a",)


def test_kvplane_layerkv_admits_by_batch_limits_not_memory() -> None:
    """With nothing decoding, kvplane's rule admits within the batch limits even with no free
    memory (the prompt keeps 0 layers, offloaded at prefill); the paper's rule admits nothing."""
    queued = (q("a", 100, 0.0), q("b", 100, 1.0), q("c", 100, 2.0))
    v = view(queued=queued, free=0, limits=BatchLimits(max_requests=2))
    d = make_scheduler("layerkv").schedule(v)
    assert d.admit == ("a", "b") and d.min_gpu_layers == {"a": 0, "b": 0}
    assert PAPER.schedule(v).admit == ()


def test_vlt_matches_superinfer_equation() -> None:
    """VLT: alpha*ReLU(now-t_last-beta_B*TBT) rotary; ReLU(now-t_arr-beta_F*TTFT) waiting; -(now-t_run) running."""
    policy = Policy.from_dict(
        {"slo_ttft_ms": 400.0, "lvf": {"alpha": 3.0, "beta_b": 0.5, "beta_f": 0.5}}
    )
    v = view(
        now=1000.0,
        running=(req("run", run_since=700.0),),
        paused=(
            req("rot", last_token=600.0, slo=100.0, paused=True),
            req("fresh", last_token=990.0, paused=True),
        ),
        queued=(q("wait", 16, arrival=500.0), q("new", 16, arrival=900.0)),
        policy=policy,
    )
    got = {e.id: e.vlt_ms for e in vlt_entries(v)}
    assert got["rot"] == pytest.approx(3.0 * (1000 - 600 - 50))
    assert got["fresh"] == 0.0
    assert got["wait"] == pytest.approx(1000 - 500 - 200)
    assert got["new"] == 0.0
    assert got["run"] == pytest.approx(-300.0)
    assert [e.id for e in vlt_entries(v)][:2] == ["rot", "wait"]


def _contended(budget: int, free: int) -> SchedulerView:
    policy = Policy.from_dict(
        {"lvf": {"alpha": 1.0, "beta_b": 0.0, "beta_f": 0.0, "transfer_budget_blocks": budget}}
    )
    # Each request: 160 tokens -> 10 blocks/layer -> 40 blocks.
    return view(
        now=1000.0,
        running=(
            req("r_old", run_since=0.0),
            req("r_mid", run_since=500.0),
            req("r_new", run_since=900.0),
        ),
        paused=(
            req("p_big_lag", last_token=100.0, paused=True),
            req("p_small_lag", last_token=800.0, paused=True),
        ),
        queued=(q("w", 160, arrival=600.0),),
        free=free,
        policy=policy,
    )


def test_lvf_rotates_largest_vlt_first_within_budget() -> None:
    """LVF picks waiting/rotary by descending VLT within B_HBM + B_xfer and preempts from the tail."""
    d = make_scheduler("lvf").schedule(_contended(budget=60, free=20))
    # B_left = 80: p_big_lag (VLT 900, 40) then w (VLT 400, 40) fit; p_small_lag (200) does not.
    assert d.resume == ("p_big_lag",)
    assert d.admit == ("w",)
    # B_swap = 60 - 0 = 60 -> preempt the most negative VLT first: r_old (-1000), r_mid (-500).
    assert d.pause == ("r_old", "r_mid")


def test_lvf_zero_budget_never_rotates_beyond_free_blocks() -> None:
    """With B_xfer = 0 only what fits the free blocks is prioritized and nothing is preempted."""
    d = make_scheduler("lvf").schedule(_contended(budget=0, free=45))
    assert d.resume == ("p_big_lag",) and d.admit == () and d.pause == ()


def test_lvf_falls_back_to_fcfs_without_contention() -> None:
    """When every waiting and rotary request fits the free blocks, all run and none is preempted."""
    d = make_scheduler("lvf").schedule(_contended(budget=0, free=120))
    assert set(d.resume) == {"p_big_lag", "p_small_lag"} and d.admit == ("w",) and d.pause == ()


@settings(max_examples=100, deadline=None)
@given(
    budget=st.integers(0, 200),
    free=st.integers(0, 200),
    lags=st.lists(st.floats(0, 2000), min_size=1, max_size=6),
    runs=st.lists(st.floats(0, 1000), max_size=6),
)
def test_lvf_prioritized_blocks_within_budget(
    budget: int, free: int, lags: list[float], runs: list[float]
) -> None:
    """Prioritized blocks never exceed B_HBM + B_xfer under contention; preemption frees what is needed."""
    policy = Policy.from_dict({"lvf": {"beta_b": 0.0, "transfer_budget_blocks": budget}})
    paused = tuple(req(f"p{i}", last_token=1000.0 - lag, paused=True) for i, lag in enumerate(lags))
    running = tuple(req(f"r{i}", run_since=1000.0 - t) for i, t in enumerate(runs))
    v = view(now=1000.0, running=running, paused=paused, free=free, policy=policy)
    d = make_scheduler("lvf").schedule(v)
    blk = 40
    prioritized = len(d.resume) * blk
    if free >= len(paused) * blk:
        assert len(d.resume) == len(paused) and not d.pause
        return
    assert prioritized <= free + budget
    swap = prioritized - free
    freed = len(d.pause) * blk
    negative = [r for r in running if r.run_since_ms < 1000.0]
    assert freed >= swap or len(d.pause) == len(negative)
    # Rotation-in is by descending VLT: every resumed request lags at least as much as any left out
    # that would still have fitted.
    order = sorted(paused, key=lambda r: (r.last_token_ms, r.id))
    assert list(d.resume) == [r.id for r in order][: len(d.resume)]


def test_layerkv_step_predictor_prices_the_fetch_launches():
    """LayerKV's admission predictor (the spread placement of what fits) counts the profile's
    launch cost: more than without it when the batch offloads on a fast link; nothing when
    everything fits."""
    from controlplane.controller.schedulers.step_predictor import predicted_step_ms

    comp = [1.0] * 8
    offloading = predicted_step_ms([10, 10], 100, comp, 1e9)  # 160 blocks on 100: offloads
    assert predicted_step_ms([10, 10], 100, comp, 1e9, 0.5) > offloading + 0.4
    assert predicted_step_ms([10, 10], 1000, comp, 1e9, 0.5) == 8.0
