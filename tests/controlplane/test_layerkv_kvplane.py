"""kvplane's LayerKV variant: two-class admission (fitting prompts as a no-offload server,
never-fitting ones as background work), rotation, the undo of a pause that admits nothing, and
the refill of paused fitting requests (with the real controller and planner)."""

from __future__ import annotations

import dataclasses

from controlplane.api import QueuedRequest
from controlplane.controller import SessionController
from controlplane.controller.batch_limits import BatchLimits
from controlplane.controller.schedulers import make_scheduler
from controlplane.controller.schedulers.base import RequestView, SchedulerView
from controlplane.model import Hardware
from controlplane.planner import Planner
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from tests.controlplane.test_controller import FIXED_WINDOW
from tests.controlplane.test_controller_harness import WorkerLoop, worker_info
from tests.controlplane.test_schedulers import MODEL, PAPER, q, req


def _rotation_view(now: float, big_ctx: int, aged_arrival: float = 0.0) -> SchedulerView:
    """Budget 400 blocks = 1600 tokens in every layer; batch limit 4000 tokens; running: big
    (``big_ctx``) and small (500); queued: a (1000 tokens, TTFT SLO 2 s)."""
    return SchedulerView(
        step=1, now_ms=now, running=(req("big", ctx=big_ctx), req("small", ctx=500)), paused=(),
        queued=(q("a", 1000, arrival=aged_arrival, ttft=2000.0),), model=MODEL,
        hardware=Hardware(gpu_kv_budget_blocks=400, h2d_gbps=1.0),
        layer_compute_ms=(1.0,) * 4, h2d_gbps=1.0, tpot_ms=20.0, free_gpu_blocks=0,
        policy=Policy(), limits=BatchLimits(max_tokens=4000),
    )


def test_kvplane_layerkv_pauses_background_requests_for_a_fitting_prompt() -> None:
    """Scenario: a (1000 tokens, fits the GPU) is blocked by the 4000-token batch limit (3000 +
    500 running). big (3000 tokens > the 1600 the GPU holds in every layer: a no-offload server
    would have rejected it) is paused at once, without waiting for a to age, and a is admitted."""
    d = make_scheduler("layerkv").schedule(_rotation_view(now=100.0, big_ctx=3000))
    assert d.pause == ("big",) and d.admit == ("a",)
    # negative control: the blocking request fits the GPU (1500 <= 1600 tokens): a no-offload
    # server would serve it too, so it is not paused while a has time left (100 ms of its 2 s
    # TTFT SLO used); with 1500 + 500 + 1000 > 2500 a waits
    view = _rotation_view(now=100.0, big_ctx=1500)
    view = dataclasses.replace(view, limits=BatchLimits(max_tokens=2500))
    d = make_scheduler("layerkv").schedule(view)
    assert d.pause == () and d.admit == ()
    # once a has used half its TTFT SLO (aged), its deadline outranks a request that already has
    # its first token: the fitting big is paused (largest first; 500 + 1000 <= 2500) and a admitted
    d = make_scheduler("layerkv").schedule(dataclasses.replace(view, now_ms=5000.0))
    assert d.pause == ("big",) and d.admit == ("a",)
    # a background prompt does not pause another background request
    view = _rotation_view(now=100.0, big_ctx=3000)
    view = dataclasses.replace(view, queued=(q("b2", 2000, arrival=0.0, ttft=1e9),))
    assert make_scheduler("layerkv").schedule(view).pause == ()
    # the paper's rule never rotates
    assert PAPER.schedule(_rotation_view(now=5000.0, big_ctx=3000)).pause == ()


def test_kvplane_layerkv_undoes_the_pause_when_the_fitting_prompt_is_held() -> None:
    """Scenario: pausing big would make room for a, but Eq. 2 holds a (the decoding request has
    no TPOT slack left): nothing is paused for an admission that does not happen."""
    policy = Policy.from_dict(
        {"layerkv": {"model_params": 1e9, "hidden_size": 1000, "device_tflops": 1.0}}
    )
    base = dataclasses.replace(_rotation_view(now=100.0, big_ctx=3000), policy=policy)
    tight = dataclasses.replace(base, now_ms=9100.0, running=(
        req("big", ctx=3000), req("small", ctx=500, gen=100, slo=100.0)),
        queued=(q("a", 1000, arrival=9000.0, ttft=1e9),))
    d = make_scheduler("layerkv").schedule(tight)
    assert d.pause == () and d.admit == ()
    # negative control: with slack (300 tokens still to come at 90 of 100 ms), big is paused
    # and a admitted
    slack = dataclasses.replace(tight, policy=Policy.from_dict(
        {"layerkv": {"model_params": 1e9, "hidden_size": 1000, "device_tflops": 1.0,
                     "output_len_lower_bound": 300}}))
    d = make_scheduler("layerkv").schedule(slack)
    assert d.pause == ("big",) and d.admit == ("a",)


def _background_view(*, h2d_gbps: float, queued: tuple[QueuedRequest, ...] = (),
                     running: tuple[RequestView, ...] = (),
                     paused: tuple[RequestView, ...] = ()) -> SchedulerView:
    """Budget 400 blocks (1600 tokens in every layer), 4 layers of 5 ms, 300 output tokens
    expected per request (LayerKV Eq. 1's lower bound)."""
    return SchedulerView(
        step=1, now_ms=1000.0, running=running, paused=paused, queued=queued, model=MODEL,
        hardware=Hardware(gpu_kv_budget_blocks=400, h2d_gbps=h2d_gbps),
        layer_compute_ms=(5.0,) * 4, h2d_gbps=h2d_gbps, tpot_ms=20.0, free_gpu_blocks=0,
        policy=Policy.from_dict({"layerkv": {"output_len_lower_bound": 300}}),
        limits=BatchLimits(max_requests=4),
    )


def test_kvplane_layerkv_pauses_a_background_request_that_makes_fitting_steps_late() -> None:
    """Scenario: big (3000 tokens, never fits) decodes next to small (500, fits) over a slow
    link: every step streams big's offloaded layers and small misses its 100 ms SLO, so big is
    paused. Over a fast link (the steps stay on time), or with no fitting request beside it, it
    keeps running."""
    running = (req("big", ctx=3000), req("small", ctx=500, slo=100.0))
    slow = _background_view(h2d_gbps=0.01, running=running)
    assert make_scheduler("layerkv").schedule(slow).pause == ("big",)
    assert make_scheduler("layerkv").schedule(
        dataclasses.replace(slow, h2d_gbps=1e6)).pause == ()
    assert make_scheduler("layerkv").schedule(
        dataclasses.replace(slow, running=running[:1])).pause == ()


def test_kvplane_layerkv_never_counts_on_the_room_of_a_held_request() -> None:
    """A held request (the worker drops its pauses, ``SchedulerView.held``) is never rotated out:
    the decision builder would drop the pause, so the room LayerKV counted on it freeing is not
    there. Before, a held background request was "paused" for a fitting prompt and the prompt
    admitted into a full batch; an aged prompt did the same with a held fitting request."""
    lkv = make_scheduler("layerkv")
    held = frozenset({"big"})
    # background, for a fitting prompt (control: the first test's pause and admission)
    view = _rotation_view(now=100.0, big_ctx=3000)
    assert lkv.schedule(view).admit == ("a",)
    d = lkv.schedule(dataclasses.replace(view, held=held))
    assert d.pause == () and d.admit == ()
    # a fitting big, for an aged prompt (control: big paused, the largest); held, small is paused
    # in its place (1500 + 1000 <= 2500)
    aged = dataclasses.replace(_rotation_view(now=5000.0, big_ctx=1500), limits=BatchLimits(max_tokens=2500))
    assert lkv.schedule(aged).pause == ("big",)
    d = lkv.schedule(dataclasses.replace(aged, held=held))
    assert d.pause == ("small",) and d.admit == ("a",)
    d = lkv.schedule(dataclasses.replace(aged, held=held | {"small"}))
    assert d.pause == () and d.admit == ()
    # a background request that makes the fitting steps late (control: paused)
    running = (req("big", ctx=3000), req("small", ctx=500, slo=100.0))
    slow = _background_view(h2d_gbps=0.01, running=running)
    assert lkv.schedule(slow).pause == ("big",)
    assert lkv.schedule(dataclasses.replace(slow, held=held)).pause == ()
    # the refill does not pause a held background request for a paused fitting one (control: it
    # does when big is not held)
    refill = _background_view(h2d_gbps=0.01, running=running[:1], paused=(req("p", ctx=500, slo=100.0, paused=True),))
    d = lkv.schedule(refill)
    assert d.pause == ("big",) and d.resume == ("p",)
    d = lkv.schedule(dataclasses.replace(refill, held=held))
    assert d.pause == () and d.resume == ()


def test_kvplane_layerkv_background_prompts_never_jump_or_block_fitting_ones() -> None:
    """A background prompt (longer than the GPU holds) is skipped, not waited for: the fitting
    prompt behind it is admitted; and it is not admitted past a fitting prompt that is held."""
    small = req("small", ctx=500, gen=0, slo=100.0, first_seen=1000.0)  # TPOT slack: Eq. 2 holds
    # nothing here
    # bg would make small's steps late over the slow link: skipped; f behind it (fits) admitted
    v = _background_view(h2d_gbps=0.01, running=(small,),
                         queued=(q("bg", 2000, 0.0, ttft=1e9), q("f", 100, 1.0, ttft=1e9)))
    v = dataclasses.replace(v, free_gpu_blocks=1000)
    assert make_scheduler("layerkv").schedule(v).admit == ("f",)
    # negative control: over a fast link bg's steps stay on time: both are admitted
    assert make_scheduler("layerkv").schedule(
        dataclasses.replace(v, h2d_gbps=1e6)).admit == ("bg", "f")
    # f (fits, not aged) is held by Eq. 2 (no TPOT slack left); bg arrived after it and has
    # aged (aging bypasses Eq. 2): it is still not admitted past f
    tight = req("small", ctx=500, gen=0, slo=100.0, first_seen=0.0)
    held = dataclasses.replace(v, h2d_gbps=1e6, running=(tight,), policy=Policy(),
                               queued=(q("f", 100, 0.0, ttft=1e9), q("bg", 2000, 1.0, ttft=10.0)))
    assert make_scheduler("layerkv").schedule(held).admit == ()
    # negative control: without f, the aged bg is admitted
    alone = dataclasses.replace(held, queued=held.queued[1:])
    assert make_scheduler("layerkv").schedule(alone).admit == ("bg",)


def test_kvplane_layerkv_eq2_ignores_a_tpot_target_below_the_all_resident_step() -> None:
    """Scenario: small decodes with a 10 ms SLO on a model whose every-layer-resident step is
    20 ms (4 layers of 5 ms): late whatever is admitted. Eq. 1 over its raw target had no slack
    at all, so it held the fitting prompt f (memory free, nothing aged) until f aged; its target
    is below the planner's floor, so it bounds nothing and f is admitted at once."""
    unmeetable = req("small", ctx=500, gen=0, slo=10.0, first_seen=0.0)
    v = _background_view(h2d_gbps=1e6, running=(unmeetable,), queued=(q("f", 100, 0.0, ttft=1e9),))
    v = dataclasses.replace(v, free_gpu_blocks=1000, policy=Policy())
    assert make_scheduler("layerkv").schedule(v).admit == ("f",)
    # negative controls: a meetable target (100 ms) without slack still holds f (Eq. 1-2 as
    # before); so does one beside the unmeetable one; the paper's rule weighs the raw 10 ms
    meetable = req("other", ctx=500, gen=0, slo=100.0, first_seen=0.0)
    assert make_scheduler("layerkv").schedule(dataclasses.replace(v, running=(meetable,))).admit == ()
    assert make_scheduler("layerkv").schedule(
        dataclasses.replace(v, running=(unmeetable, meetable))).admit == ()
    assert PAPER.schedule(v).admit == ()
    # a target just above the floor (20 ms) counts, and has no slack
    at_floor = dataclasses.replace(unmeetable, slo_tbt_ms=20.0 / v.policy.layerkv.tpot_margin * (1 + 1e-6))
    assert make_scheduler("layerkv").schedule(dataclasses.replace(v, running=(at_floor,))).admit == ()


def test_kvplane_layerkv_an_aged_prompt_pauses_running_requests_until_it_fits() -> None:
    """Scenario: two background requests (3000 and 2500 tokens, neither fits the GPU) fill the
    2-request batch limit; a background prompt of 2000 tokens that has aged (its TTFT SLO is a
    deadline) pauses the largest running background request and is admitted."""
    running = (req("bg1", ctx=3000), req("bg2", ctx=2500))
    v = _background_view(h2d_gbps=1e6, running=running,
                         queued=(q("bg3", 2000, 0.0, ttft=10.0),))
    v = dataclasses.replace(v, limits=BatchLimits(max_requests=2), free_gpu_blocks=1000)
    d = make_scheduler("layerkv").schedule(v)
    assert d.pause == ("bg1",) and d.admit == ("bg3",)
    # negative control: not aged yet -> it waits and nothing is paused
    young = dataclasses.replace(v, queued=(q("bg3", 2000, 1000.0, ttft=1e9),))
    d = make_scheduler("layerkv").schedule(young)
    assert d.pause == () and d.admit == ()
    # running requests shorter than the prompt are paused too (the older rule let them keep
    # their turn, and the aged prompt waited for a longer one to appear)
    longer = dataclasses.replace(v, queued=(q("bg3", 3500, 0.0, ttft=10.0),))
    d = make_scheduler("layerkv").schedule(longer)
    assert d.pause == ("bg1",) and d.admit == ("bg3",)
    # background requests go first: the fitting f keeps running
    fit = dataclasses.replace(v, running=(req("f", ctx=500), req("bg1", ctx=3000)))
    d = make_scheduler("layerkv").schedule(fit)
    assert d.pause == ("bg1",) and d.admit == ("bg3",)
    # with only fitting requests running, the largest of them makes room ...
    fitting = dataclasses.replace(v, running=(req("f1", ctx=500), req("f2", ctx=1200)))
    d = make_scheduler("layerkv").schedule(fitting)
    assert d.pause == ("f2",) and d.admit == ("bg3",)
    # ... but only for an aged prompt: a young background prompt pauses no fitting request
    d = make_scheduler("layerkv").schedule(dataclasses.replace(fitting, queued=young.queued))
    assert d.pause == () and d.admit == ()
    # pausing everything admits any prompt (a lone request always fits the limits) ...
    alone = dataclasses.replace(v, limits=BatchLimits(max_requests=2, max_tokens=1500))
    d = make_scheduler("layerkv").schedule(alone)
    assert d.pause == ("bg1", "bg2") and d.admit == ("bg3",)
    # ... but a prompt over this step's prefill-token cap (f took the third slot first) pauses
    # nothing
    capped = dataclasses.replace(v, limits=BatchLimits(max_requests=3), policy=Policy.from_dict(
        {"layerkv": {"output_len_lower_bound": 300, "max_prefill_tokens": 2000}}),
        queued=(q("f", 100, 0.0, ttft=1e9), q("bg3", 2000, 1.0, ttft=10.0)))
    d = make_scheduler("layerkv").schedule(capped)
    assert d.pause == () and d.admit == ("f",)
    # negative control: with a cap that holds both, bg3 pauses bg1 for the slot f left full
    roomy = dataclasses.replace(capped, policy=Policy.from_dict(
        {"layerkv": {"output_len_lower_bound": 300, "max_prefill_tokens": 2100}}))
    d = make_scheduler("layerkv").schedule(roomy)
    assert d.pause == ("bg1",) and d.admit == ("f", "bg3")
    # the paper's rule never pauses
    assert PAPER.schedule(v).pause == ()


def test_kvplane_layerkv_room_freed_for_an_aged_prompt_is_not_taken_by_a_young_one() -> None:
    """Scenario (review, session 66): big (1500) and small (500) fit the GPU and fill the
    2500-token limit; a (600 tokens) has aged, b (900) behind it has not. a pauses big (largest
    first), which frees 1500 tokens where a needs 600; b must not take the rest: big was paused
    for a's deadline only, and b sees the batch as if big still ran."""
    base = dataclasses.replace(_rotation_view(now=100.0, big_ctx=1500),
                               limits=BatchLimits(max_tokens=2500), free_gpu_blocks=10000)
    aged_a, young_b = q("a", 600, arrival=0.0, ttft=150.0), q("b", 900, arrival=90.0, ttft=1e9)
    d = make_scheduler("layerkv").schedule(dataclasses.replace(base, queued=(aged_a, young_b)))
    assert d.admit == ("a",) and d.pause == ("big",)
    assert make_scheduler("layerkv").schedule(dataclasses.replace(base, queued=(young_b,))).admit == ()
    # control: big a background request (3000 > the 1600 tokens the GPU holds): its pause
    # reserves nothing (a fitting prompt may pause it anyway), so b is admitted behind a
    bg = dataclasses.replace(base, running=(req("big", ctx=3000), req("small", ctx=500)),
                             queued=(aged_a, young_b))
    d = make_scheduler("layerkv").schedule(bg)
    assert d.admit == ("a", "b") and d.pause == ("big",)


def _paused(rid: str, ctx: int, paused_steps: int, slo: float = 100.0) -> RequestView:
    return dataclasses.replace(req(rid, ctx=ctx, slo=slo), paused=True, paused_steps=paused_steps)


def test_kvplane_layerkv_refills_a_paused_fitting_request_when_the_step_stays_on_time() -> None:
    """Scenario: f1 (500 tokens) runs alone; f2 (600, paused) fits beside it (1100 tokens <= the
    1600 the GPU holds in every layer: a 20 ms step against a 90 ms target) and nobody finished:
    f2 is resumed at once, not left waiting for a finish."""
    v = _background_view(h2d_gbps=0.01, running=(req("f1", ctx=500),),
                         paused=(_paused("f2", 600, 10),))
    assert make_scheduler("layerkv").schedule(v).resume == ("f2",)
    # negative controls: f1 + f2 = 2000 tokens do not fit; over the slow link the step with f2
    # is late -> f2 stays paused; over a fast link the same batch is on time -> resumed
    big = dataclasses.replace(v, running=(req("f1", ctx=1000),), paused=(_paused("f2", 1000, 10),))
    assert make_scheduler("layerkv").schedule(big).resume == ()
    assert make_scheduler("layerkv").schedule(
        dataclasses.replace(big, h2d_gbps=1e6)).resume == ("f2",)
    # no batch slot -> stays paused
    assert make_scheduler("layerkv").schedule(
        dataclasses.replace(v, limits=BatchLimits(max_requests=1))).resume == ()
    # a paused background request (2000 tokens > 1600) is not refilled, even on time
    bg = dataclasses.replace(v, h2d_gbps=1e6, paused=(_paused("bg", 2000, 10),))
    assert make_scheduler("layerkv").schedule(bg).resume == ()
    # the paper's rule never resumes
    assert PAPER.schedule(v).resume == ()


def test_kvplane_layerkv_refill_is_longest_paused_first_without_overtaking() -> None:
    """Scenario: over the slow link beside f1 (1000 tokens), fa (1000) would be late and fb
    (200) on time. fa has waited longer: the refill stops at fa and fb does not overtake it."""
    paused = (_paused("fa", 1000, 50), _paused("fb", 200, 10))
    v = _background_view(h2d_gbps=0.01, running=(req("f1", ctx=1000),), paused=paused)
    assert make_scheduler("layerkv").schedule(v).resume == ()
    # negative control: fb has waited longer -> fb first (on time), then fa (late) ends it
    swapped = dataclasses.replace(v, paused=(_paused("fa", 1000, 5), _paused("fb", 200, 10)))
    assert make_scheduler("layerkv").schedule(swapped).resume == ("fb",)


def test_kvplane_layerkv_refill_pauses_background_work_and_undoes_it_when_useless() -> None:
    """Scenario: bg (2000 tokens, never fits) decodes alone over the slow link; f2 (500, paused)
    would be late beside it: bg is paused and f2 resumed (a no-offload server would be running
    f2, never bg). An SLO of 15 ms, below the 20 ms step with every layer resident, is met at
    that step (the planner's floor): bg is paused for f2 as well (before, f2 was left paused
    behind bg until the starvation guard)."""
    v = _background_view(h2d_gbps=0.01, running=(req("bg", ctx=2000),),
                         paused=(_paused("f2", 500, 10),))
    d = make_scheduler("layerkv").schedule(v)
    assert d.pause == ("bg",) and d.resume == ("f2",)
    # negative control: over a fast link bg and f2 are on time together: bg keeps running
    d = make_scheduler("layerkv").schedule(dataclasses.replace(v, h2d_gbps=1e6))
    assert d.pause == () and d.resume == ("f2",)
    # an SLO below the all-resident step: f2 alone runs at that step -> as on time
    tight = dataclasses.replace(v, paused=(_paused("f2", 500, 10, slo=15.0),))
    d = make_scheduler("layerkv").schedule(tight)
    assert d.pause == ("bg",) and d.resume == ("f2",)
    # (before the floor, the control: f2 stayed paused and bg ran on, pause == resume == ())
    # undo: beside f1 (1500 tokens) the batch limit of 1900 refuses f2 (500) even with bg
    # paused, so bg's pause is undone; at 2100 (the control) it makes room and stays
    crowded = dataclasses.replace(v, h2d_gbps=1e6, running=(req("f1", ctx=1500), req("bg", ctx=2000)),
                                  limits=BatchLimits(max_tokens=1900))
    d = make_scheduler("layerkv").schedule(crowded)
    assert d.pause == () and d.resume == ()
    d = make_scheduler("layerkv").schedule(dataclasses.replace(crowded, limits=BatchLimits(max_tokens=2100)))
    assert d.pause == ("bg",) and d.resume == ("f2",)


def test_kvplane_layerkv_refill_comes_after_the_admissions() -> None:
    """Scenario: one batch slot is left beside f1; a fitting prompt p waits and f2 is paused: p
    is admitted (it has no first token yet) and f2 waits; without p (negative control) f2 is
    resumed into the slot."""
    v = _background_view(h2d_gbps=1e6, running=(req("f1", ctx=500),),
                         paused=(_paused("f2", 500, 10),), queued=(q("p", 300, 0.0, ttft=1e9),))
    v = dataclasses.replace(v, limits=BatchLimits(max_requests=2), free_gpu_blocks=1000)
    d = make_scheduler("layerkv").schedule(v)
    assert d.admit == ("p",) and d.resume == ()
    d = make_scheduler("layerkv").schedule(dataclasses.replace(v, queued=()))
    assert d.admit == () and d.resume == ("f2",)


def test_controller_with_kvplane_layerkv_resumes_a_paused_request_without_a_finish() -> None:
    """Scenario (real SessionController, real Planner): f2 is paused beside f1 and both fit the
    GPU; nobody finishes. With the layerkv scheduler the first plan resumes f2; with fcfs
    (OrbitFlow's rule: resume only after a finish) f2 is still paused ten steps later."""
    for scheduler, expect in (("layerkv", ()), ("fcfs", ("f2",))):
        store = PolicyStore(Policy.from_dict({**FIXED_WINDOW, "scheduler": scheduler}))
        session = SessionController(worker_info(), policy_source=store.get, planner=Planner(),
                                    synchronous=True, batch_limits=BatchLimits(max_requests=4))
        w = WorkerLoop(session)
        w.add("f1", 320)
        w.add("f2", 160)
        w.paused.add("f2")
        for _ in range(10):
            w.report()
        assert session.status().paused == expect, scheduler
        assert any("f2" in d.resume for d in w.decisions) == (scheduler == "layerkv")
