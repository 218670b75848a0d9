"""kvplane's LayerKV variant: two-class admission (fitting prompts as a no-offload server,
never-fitting ones as background work), rotation and the undo of a pause that admits nothing."""

from __future__ import annotations

import dataclasses

from controlplane.api import QueuedRequest
from controlplane.controller.batch_limits import BatchLimits
from controlplane.controller.schedulers import make_scheduler
from controlplane.controller.schedulers.base import RequestView, SchedulerView
from controlplane.model import Hardware
from controlplane.policy import Policy
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
    # server would serve it too, so it is not paused; with 1500 + 500 + 1000 > 2500 a waits
    view = _rotation_view(now=5000.0, big_ctx=1500)
    view = dataclasses.replace(view, limits=BatchLimits(max_tokens=2500))
    d = make_scheduler("layerkv").schedule(view)
    assert d.pause == () and d.admit == ()
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
                     running: tuple[RequestView, ...] = ()) -> SchedulerView:
    """Budget 400 blocks (1600 tokens in every layer), 4 layers of 5 ms, 300 output tokens
    expected per request (LayerKV Eq. 1's lower bound)."""
    return SchedulerView(
        step=1, now_ms=1000.0, running=running, paused=(), queued=queued, model=MODEL,
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


def test_kvplane_layerkv_background_prompts_take_turns_once_aged() -> None:
    """Scenario: two background requests (3000 and 2500 tokens, neither fits the GPU) fill the
    2-request batch limit; a background prompt of 2000 tokens that has aged pauses the longest
    running background request (never a fitting one) and is admitted."""
    running = (req("bg1", ctx=3000), req("bg2", ctx=2500))
    v = _background_view(h2d_gbps=1e6, running=running,
                         queued=(q("bg3", 2000, 0.0, ttft=10.0),))
    v = dataclasses.replace(v, limits=BatchLimits(max_requests=2), free_gpu_blocks=1000)
    d = make_scheduler("layerkv").schedule(v)
    assert d.pause == ("bg1",) and d.admit == ("bg3",)
    # negative controls: not aged yet -> it waits and nothing is paused
    young = dataclasses.replace(v, queued=(q("bg3", 2000, 1000.0, ttft=1e9),))
    d = make_scheduler("layerkv").schedule(young)
    assert d.pause == () and d.admit == ()
    # the running requests are shorter than the prompt: they keep their turn
    short = dataclasses.replace(v, queued=(q("bg3", 3500, 0.0, ttft=10.0),))
    d = make_scheduler("layerkv").schedule(short)
    assert d.pause == () and d.admit == ()
    # a fitting request is never paused for background work
    fit = dataclasses.replace(v, running=(req("bg1", ctx=3000), req("f", ctx=500)))
    d = make_scheduler("layerkv").schedule(fit)
    assert d.pause == ("bg1",) and "f" not in d.pause
