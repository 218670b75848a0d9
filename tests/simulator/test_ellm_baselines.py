"""eLLM's baselines (vllm-recompute, vllm-swap, hcache) and the ellm policy's preemption rule:
what each preemption costs, the r = 0 SLO batch cap, and the HCache restoration model."""

import pytest

from simulator.engine import Engine, SimConfig
from simulator.metrics import compute_metrics
from simulator.policies import make_policy, policy_names
from simulator.policies.hcache import HCachePolicy, restore_partition
from simulator.policies.no_offload import NoOffloadPolicy
from simulator.policies.vllm_recompute import VllmRecomputePolicy
from simulator.policies.vllm_swap import VllmSwapPolicy
from simulator.profile import load_profile
from simulator.state import RUNNING, EngineView, SimRequest
from simulator.trace import TraceRequest, TraceSpec, generate_trace

A100 = "llama2-13b-a100-pcie4"
BASELINES = ("vllm-recompute", "vllm-swap", "hcache")


def _tight(budget_tokens: int = 320):
    """The A100 preset with room for ``budget_tokens`` tokens of KV (all layers)."""
    p = load_profile(A100)
    return p.with_changes(gpu_kv_budget_blocks=budget_tokens // p.block_size * p.layers)


def _two_growing(slo_tbt_ms: float = 1000.0):
    """Two requests of 100 prompt tokens and 200 outputs at t=0: they fit together at first
    (200 tokens) and not at the end (600 > 320), so the newer one is preempted once."""
    return [TraceRequest(f"r{i}", 0.0, 100, 200, 1e7, slo_tbt_ms) for i in range(2)]


def _run(policy, prof, trace):  # noqa: ANN001
    return Engine(prof, trace, policy, SimConfig(record_steps=True)).run()


def _serial_extras(res):  # noqa: ANN001
    """Per decode step, time beyond the all-resident compute (swap transfers serialised)."""
    L = res.profile.layers
    return [(s, s.dur_ms - L * s.layer_compute_ms) for s in res.step_log
            if s.kind == "decode" and s.dur_ms - L * s.layer_compute_ms > 1e-6]


def test_registry_has_the_ellm_baselines():
    """The three baselines are selectable by name next to ellm."""
    assert {"ellm", *BASELINES} <= set(policy_names())
    assert isinstance(make_policy("hcache"), HCachePolicy)


def test_recompute_preemption_pays_the_prefill_of_prompt_plus_generated():
    """Scenario: the newer of two growing requests is preempted by recompute; its re-prefill
    step lasts prefill(prompt + tokens generated before the preemption), more than the prompt's
    own prefill (the negative control a prompt-only re-prefill would fail)."""
    prof = _tight()
    res = _run(VllmRecomputePolicy(), prof, _two_growing())
    victim = next(r for r in res.requests if r.preemptions)
    assert victim.preemptions == 1 and victim.id == "r1"
    prefills = [s for s in res.step_log if s.kind == "prefill"]
    assert [s.tokens for s in prefills] == [2, 1]  # both at once, then the victim's re-prefill
    again = prefills[1]
    k = victim.gen_ms.index(again.start_ms + again.dur_ms)  # tokens before the preemption
    assert 0 < k < 200
    assert again.dur_ms == pytest.approx(prof.prefill_ms(100 + k), rel=1e-12)
    assert again.dur_ms > prof.prefill_ms(100) * 1.5
    assert _serial_extras(res) == []  # nothing moved over the link


def test_swap_preemption_moves_the_whole_request_each_way():
    """Scenario as above with vllm-swap: no re-prefill; two decode steps carry a serialised
    transfer of every layer of every block of the victim, D2H out then H2D in (a one-layer or
    prompt-only swap would differ)."""
    prof = _tight()
    res = _run(VllmSwapPolicy(), prof, _two_growing())
    victim = next(r for r in res.requests if r.preemptions)
    assert [s.tokens for s in res.step_log if s.kind == "prefill"] == [2]
    (out_step, out_ms), (in_step, in_ms) = _serial_extras(res)
    ctx = 100 + sum(1 for t in victim.gen_ms if t <= out_step.start_ms)
    whole = prof.blocks(ctx) * prof.layers
    assert out_ms == pytest.approx(whole / prof.d2h_blocks_per_ms, rel=1e-12)
    assert in_ms == pytest.approx(whole / prof.h2d_blocks_per_ms, rel=1e-12)
    assert out_ms != pytest.approx(prof.blocks(ctx) / prof.d2h_blocks_per_ms, rel=1e-3)
    assert out_ms != pytest.approx(prof.blocks(100) * prof.layers / prof.d2h_blocks_per_ms,
                                   rel=1e-3)


def test_hcache_preemption_costs_its_partition_not_the_whole_kv():
    """Scenario as above with hcache on the MHA preset: the transfers are the state partition's
    (hidden states of l_h layers + KV of the rest out; restoration max(transfer, K/V
    projection) in), each cheaper than vllm-swap's whole-KV transfer."""
    prof = _tight()
    pol = HCachePolicy()
    res = _run(pol, prof, _two_growing())
    victim = next(r for r in res.requests if r.preemptions)
    (out_step, out_ms), (_, in_ms) = _serial_extras(res)
    ctx = 100 + sum(1 for t in victim.gen_ms if t <= out_step.start_ms)
    assert out_ms == pytest.approx(pol.saved_bytes(ctx) / (prof.d2h_gbps * 1e6), rel=1e-12)
    assert in_ms == pytest.approx(restore_partition(prof, ctx)[1], rel=1e-12)
    swap_ms = prof.blocks(ctx) * prof.layers / prof.h2d_blocks_per_ms
    assert in_ms < 0.8 * swap_ms and out_ms < 0.8 * swap_ms


def test_hcache_partition_balances_transfer_and_projection_on_mha():
    """MHA (hidden state half a layer's KV): most layers restore from hidden states, transfer and
    compute within one layer's worth of each other, faster than a swap and than a recompute."""
    p = load_profile(A100)
    lh, t, h2d, comp = restore_partition(p, 4096)
    assert 0 < lh < p.layers
    assert t == max(h2d, comp)
    one_layer = 4096 * p.kv_bytes_per_token_layer / (p.h2d_gbps * 1e6)
    assert abs(h2d - comp) <= one_layer
    swap = 4096 * p.layers * p.kv_bytes_per_token_layer / (p.h2d_gbps * 1e6)
    assert t < 0.7 * swap and t < p.prefill_ms(4096) / 5


def test_hcache_equals_swap_on_gqa():
    """GQA (a hidden state larger than a layer's KV): no layer restores from hidden states and
    the restoration is exactly the swap-in; on the MHA preset it is not (negative control)."""
    p = load_profile("llama3-8b-a5000-pcie3")
    lh, t, _, comp = restore_partition(p, 4096)
    assert (lh, comp) == (0, 0.0)
    assert t == pytest.approx(4096 * p.layers * p.kv_bytes_per_token_layer / (p.h2d_gbps * 1e6))
    q = load_profile(A100)
    assert restore_partition(q, 4096)[1] != pytest.approx(
        4096 * q.layers * q.kv_bytes_per_token_layer / (q.h2d_gbps * 1e6), rel=0.05)


def _req(i: int, prompt: int, generated: int, slo: float, state: str = RUNNING) -> SimRequest:
    r = SimRequest(TraceRequest(f"x{i}", float(i), prompt, 500, 1e7, slo))
    r.generated = generated
    r.state = state
    return r


def _view(prof, running, queued=()):  # noqa: ANN001
    return EngineView(0, 10.0, prof, tuple(queued), tuple(running), (), (), 0, 0.0)


@pytest.mark.parametrize("cls", [VllmRecomputePolicy, VllmSwapPolicy, HCachePolicy])
def test_eq5_admits_only_while_the_predicted_step_meets_the_slo(cls):
    """eLLM §6.1 gives the baselines Eq. (5) at r = 0: a prompt whose admission makes the
    predicted step exceed the TPOT SLO waits; just above that step it is admitted, and without
    Eq. (5) (vLLM's own rule) it is admitted (negative control)."""
    prof = load_profile(A100)
    step = prof.decode_resident_ms(7000)
    for slo, admitted in ((step - 0.01, []), (step + 0.01, ["x1"])):
        run, q = _req(0, 4000, 0, slo), _req(1, 3000, 0, slo, state="queued")
        for pol, expect in ((cls(), admitted), (cls(eq5=False), ["x1"])):
            pol.start(prof, [run.spec, q.spec])
            assert pol.decide(_view(prof, [run], [q])).admit == expect


@pytest.mark.parametrize("name", ["ellm", *BASELINES])
def test_eq5_keeps_a_prompt_that_lowers_b_over_t_waiting(name):
    """Eq. (5) maximises b / T, and T has a fixed part plus a part per context token: next to 39
    running requests of 260 tokens (T = 22.4 ms, SLO 50 ms) a 1500-token prompt lowers b / T and
    waits although the SLO would allow it, while a 100-token one raises it and is admitted; ellm
    and its three baselines decide alike at r = 0, and vLLM's own rule admits both (negative
    control)."""
    prof = load_profile(A100)
    running = [_req(i, 260, 0, 50.0) for i in range(39)]
    for prompt, admitted in ((1500, []), (100, ["x39"])):
        q = _req(39, prompt, 0, 50.0, state="queued")
        pol = make_policy(name)
        pol.start(prof, [r.spec for r in running] + [q.spec])
        act = pol.decide(_view(prof, running, [q]))
        assert act.admit == admitted and act.preempt_recompute == []
        assert 40 / prof.decode_resident_ms(39 * 260 + prompt) != pytest.approx(
            39 / prof.decode_resident_ms(39 * 260), rel=1e-3)
        if name != "ellm":
            plain = type(pol)(eq5=False)
            plain.start(prof, [r.spec for r in running] + [q.spec])
            assert plain.decide(_view(prof, running, [q])).admit == ["x39"]


@pytest.mark.parametrize("name,preemption", [("vllm-recompute", "recompute"),
                                             ("vllm-swap", "swap")])
def test_without_eq5_the_baselines_are_no_offload(name, preemption):
    """The baselines reuse vLLM's rules of ``no-offload`` / ``no-offload-swap``: without Eq. (5)
    every metric is identical; with it and a tight SLO they differ (negative control)."""
    prof = _tight(4096)
    trace = generate_trace(TraceSpec("sharegpt", 30, 600.0, slo_scale=1.0, seed=4,
                                     slo_tbt_ms=18.0, output_scale=0.5), prof)
    ref = compute_metrics(_run(NoOffloadPolicy(preemption), prof, trace)).to_dict()
    cls = VllmRecomputePolicy if preemption == "recompute" else VllmSwapPolicy
    same = compute_metrics(_run(cls(eq5=False), prof, trace)).to_dict()
    capped = compute_metrics(_run(cls(), prof, trace)).to_dict()
    assert ref["preemptions"] > 0  # memory binds on this trace
    assert {**same, "policy": name} == {**ref, "policy": name}
    assert capped != {**ref, "policy": capped["policy"]}


def test_ellm_preempts_when_memory_needs_more_recompute_than_the_slo_allows():
    """Two running requests of 2000 tokens fit 3200 tokens of memory only with >= 20% of their KV
    uncached (25% on the ratio grid after block rounding); the recomputation breaks a 50 ms SLO,
    so the newer is preempted by recompute and the older keeps running at r = 0; with a loose SLO
    both keep running at r = 0.25 (negative control)."""
    prof = _tight(3200)
    for slo, preempted, ratio in ((50.0, ["x1"], 0.0), (1000.0, [], 0.25)):
        running = [_req(0, 2000, 0, slo), _req(1, 2000, 0, slo)]
        pol = make_policy("ellm")
        pol.start(prof, [r.spec for r in running])
        act = pol.decide(_view(prof, running))
        assert act.preempt_recompute == preempted
        assert act.uncached_ratio["x0"] == pytest.approx(ratio)
        assert act.admit == []


@pytest.mark.parametrize("name", ["ellm", *BASELINES])
def test_engine_invariants_hold_under_memory_pressure(name):
    """Nothing lost, tokens conserved, memory within budget, on a trace whose KV outgrows the GPU
    (every policy preempts on it)."""
    from tests.simulator.test_engine import check_invariants

    prof = _tight(4096)
    trace = generate_trace(TraceSpec("sharegpt", 30, 600.0, slo_scale=1.0, seed=4,
                                     slo_tbt_ms=50.0, output_scale=0.5), prof)
    res = _run(make_policy(name), prof, trace)
    check_invariants(res, trace)
    assert sum(r.preemptions for r in res.requests) > 0
    assert res.forced_fallbacks == 0
