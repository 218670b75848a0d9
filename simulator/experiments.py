"""The seeds' experiments as run specifications, with the papers' numbers to state beside them.

Each :class:`Experiment` builds its runs (a smaller set with ``smoke=True``), names the figure it
reproduces and carries the paper's reported numbers as text. Settings are the papers' where they
report them (OrbitFlow §5.1: Llama-3-8B, RTX A5000, PCIe 3.0, batch 4, 32K tokens per batch,
SLO scales 1/1.5/2.5, 0.97 req/min for design validation; LayerKV §5.2.3: TTFT vs arrival rate
against vLLM; SuperInfer §5.2: Qwen2.5-32B on GH200, TTFT 5 s / TBT 100 ms, alpha=3, beta_B=0,
beta_F=0.5, B_xfer=2400). The OrbitFlow figures share one A5000 point (:data:`POINT`) over :data:`SEEDS` with
:data:`N_REQUESTS`-request traces; identical runs across figures are run once. Fig. 8a's rate
axis, its SLO scale 1 and Fig. 14a's scale 2.5 are left out to keep ``reproduce all`` within 15
minutes on a 2-core host (a 100-request controlled run is 20-60 s of CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from simulator.ellm_experiment import build as _ellm
from simulator.runner import RunSpec
from simulator.trace import TraceRequest, TraceSpec

A5000 = "llama3-8b-a5000-pcie3"
GH200 = "qwen2.5-32b-gh200-c2c"
OF_BASELINES = ("deepspeed", "flexgen", "flexgen+", "slo-aware", "dynamic-heuristic")


@dataclass(frozen=True)
class Experiment:
    name: str
    title: str
    paper: str
    """The paper's reported numbers for this figure (stated beside our result)."""
    build: Callable[[bool], list[RunSpec]]


def _ts(workload: str, n: int, rate: float, smoke: bool, **kw) -> TraceSpec:  # noqa: ANN003
    """A trace spec; smoke runs shorten outputs 10x so the whole set runs in seconds."""
    return TraceSpec(workload, n, rate, output_scale=0.1 if smoke else 1.0, **kw)


SEEDS = (1, 2, 3)
"""Trace seeds of every A5000 point (issue 15: >= 3 seeds per point, spread shown)."""
N_REQUESTS = 100
"""Requests per A5000 trace (issue 15: >= 100)."""
VANILLA = "no-offload-swap"
"""vLLM/SGLang without KV offload (issue 15: in every figure)."""
POINT = {"rate_per_min": 1.0, "slo_scale": 1.5}
"""The A5000 load point every OrbitFlow figure shares (identical runs are run once): 1 req/min
of orbitflow-32k oversubscribes the GPU (the no-offload server rejects ~10% of the requests and
queues the rest; every offloading policy's batch exceeds the 16K tokens the GPU holds), and SLO
scale 1.5 is the paper's default (§5.1)."""


def _point_runs(policies: tuple[str, ...], smoke: bool, seeds: tuple[int, ...] = SEEDS,
                slo_scale: float | None = None) -> list[RunSpec]:
    """Every policy on every seed's trace at :data:`POINT` (optionally another SLO scale)."""
    n = 6 if smoke else N_REQUESTS
    seeds = seeds[:2] if smoke else seeds
    rate = POINT["rate_per_min"]
    scale = POINT["slo_scale"] if slo_scale is None else slo_scale
    return [
        RunSpec(pol, A5000, trace=_ts("orbitflow-32k", n, rate, smoke, slo_scale=scale,
                                      seed=seed),
                tags={"rate_per_min": rate, "slo_scale": scale, "seed": seed})
        for seed in seeds for pol in policies
    ]


AUTHORS_BASELINES = ("flexgen-authors", "selectn", "distn-single")


def _fig8a(smoke: bool) -> list[RunSpec]:
    """Every baseline at SLO scale 1.5; orbitflow, the strongest baselines and vanilla also at
    the loose scale 2.5 (the paper's other panel)."""
    return _point_runs(("orbitflow",) + OF_BASELINES + AUTHORS_BASELINES + (VANILLA,), smoke) \
        + _point_runs(("orbitflow", "deepspeed", "flexgen+", "dynamic-heuristic", "distn-single",
                       VANILLA), smoke, slo_scale=2.5)


def _fig14a(smoke: bool) -> list[RunSpec]:
    return _point_runs(("batch-uniform", "request-wise", "request-wise+pause", "orbitflow",
                        VANILLA), smoke)


def _deposit_credit(smoke: bool) -> list[RunSpec]:
    """The token deposit with and without its SLO-cap credit (``Policy.deposit_credit``)."""
    return _point_runs(("request-wise+pause", "orbitflow", "orbitflow-nocredit", "kvplane",
                        "kvplane-credit"), smoke)


def _fig14c(smoke: bool) -> list[RunSpec]:
    return _point_runs(("orbitflow-longest", "orbitflow-shortest", "orbitflow-random",
                        "orbitflow", VANILLA), smoke)


def _static_batches(n_batches: int, out_tokens: int, seed: int) -> tuple[TraceRequest, ...]:
    """Static batching: groups of 4 requests arriving together with equal output lengths, the
    next group arriving long after (OrbitFlow Table 1's 'static' workloads)."""
    import random

    from simulator.profile import load_profile
    from simulator.trace import sample_lengths

    prof = load_profile(A5000)
    rng = random.Random(seed)
    slo = 1.5 * prof.base_tbt_slo_ms()
    out: list[TraceRequest] = []
    t = 0.0
    for b in range(n_batches):
        for i in range(4):
            prompt, _ = sample_lengths("orbitflow-32k", rng)
            prompt = min(prompt, 8192 - out_tokens)
            out.append(TraceRequest(f"b{b}r{i}", t, prompt, out_tokens,
                                    1.5 * max(1000.0, 5 * prof.prefill_ms(prompt)), slo))
        t += 4 * (out_tokens * 60.0 + 10_000.0)
    return tuple(out)


def _table1(smoke: bool) -> list[RunSpec]:
    nb = 1 if smoke else 5
    n = 6 if smoke else 24
    return [
        RunSpec("orbitflow", A5000, requests=_static_batches(nb, 64, 4), solver_time="measured",
                tags={"workload": "Both Static"}),
        RunSpec("orbitflow", A5000, requests=_static_batches(nb, 256 if smoke else 2048, 5),
                solver_time="measured", tags={"workload": "Token Dynamic"}),
        RunSpec("orbitflow", A5000, trace=_ts("orbitflow-32k", n, 1.5, smoke, slo_scale=1.5, seed=6),
                solver_time="measured", tags={"workload": "Both Dynamic"}),
    ]


L20 = "llama2-7b-l20-pcie4"


def _layerkv(smoke: bool) -> list[RunSpec]:
    """LayerKV §5.2.3-5.2.4: ShareGPT, Llama-2-7B on one L20, 4-7 req/s; SLOs TTFT 3 s and
    TPOT 200 ms (§5.2.4)."""
    rates = (6.0,) if smoke else (4.0, 7.0)
    n = 60 if smoke else 600
    return [
        RunSpec(pol, L20,
                trace=_ts("sharegpt", n, rate * 60.0, smoke, slo_scale=1.0, seed=7,
                          slo_tbt_ms=200.0, slo_ttft_ms=3000.0),
                tags={"rate_per_s": rate})
        for rate in rates for pol in ("no-offload", "layerkv")
    ]


SUPERINFER_OVERRIDES = {"max_batch_size": 1024}
"""Batch cap raised so KV memory, not the cap, binds (SuperInfer's regime of KV exhaustion)."""


def _superinfer(smoke: bool) -> list[RunSpec]:
    """ShareGPT-like (SuperInfer's dataset) plus a long-context probe (orbitflow-32k) where KV,
    not prefill, binds."""
    runs = [("sharegpt", r, 60 if smoke else 600)
            for r in ((40.0,) if smoke else (20.0, 40.0))]
    runs += [("orbitflow-32k", r, 8 if smoke else 60) for r in ((1.0,) if smoke else (0.5, 1.0))]
    return [
        RunSpec(pol, GH200, SUPERINFER_OVERRIDES,
                trace=_ts(w, n, rate * 60.0, smoke, slo_scale=1.0, seed=8,
                          slo_tbt_ms=100.0, slo_ttft_ms=5000.0),
                tags={"workload": w, "rate_per_s": rate})
        for w, rate, n in runs for pol in ("no-offload", "lvf")
    ]


HELD_OUT_SEEDS = (4, 5, 6, 7, 8, 9)
"""More seeds for the kvplane-combined experiment, beside :data:`SEEDS`, so that the default
policy's claim is checked beyond the traces its admission rule was designed on (seeds 1-3; the
background rotation was added after seed 6; seeds 7-9 were run only after the rule was
final)."""


def _kvplane(smoke: bool) -> list[RunSpec]:
    return _point_runs(("kvplane", "orbitflow", "layerkv", "dynamic-heuristic", "flexgen+",
                        VANILLA, "no-offload"), smoke, seeds=SEEDS + HELD_OUT_SEEDS)


SGLANG_ADMISSION = {"max_batch_size": 64, "token_budget": 131072}
"""SGLang's admission when the plugin widens its slot space (``--max-total-tokens`` beyond the
GPU): memory binds, not OrbitFlow's batch of 4 (§5.1). The slot space is 128K tokens, 8x the 16K
the A5000 preset holds in every layer; 64 requests stand for ``--max-running-requests``, which
128K tokens of 32K-context prompts never reach."""
SERVED_RATES = (1.0, 2.0, 4.0)
"""Arrivals per minute of the served-admission experiment (1: :data:`POINT`; 4: the queue grows)."""


def _served_admission(smoke: bool) -> list[RunSpec]:
    """``--kv-scheduler`` as served: ``kvplane-fcfs`` (the plugin's default: SGLang admits, the
    planner places and pauses) against ``kvplane`` (LayerKV admission), with vanilla, under
    :data:`SGLANG_ADMISSION`."""
    n = 6 if smoke else N_REQUESTS
    rates = (2.0,) if smoke else SERVED_RATES
    seeds = SEEDS[:1] if smoke else SEEDS
    return [
        RunSpec(pol, A5000, SGLANG_ADMISSION,
                trace=_ts("orbitflow-32k", n, rate, smoke, slo_scale=POINT["slo_scale"], seed=seed),
                tags={"rate_per_min": rate, "slo_scale": POINT["slo_scale"], "seed": seed})
        for seed in seeds for rate in rates
        for pol in ("kvplane-fcfs", "kvplane", VANILLA, "kvplane-fcfs-largest", "kvplane-largest")
    ]


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (
        Experiment(
            "orbitflow-fig8a", "TBT/TPOT SLO attainment at an oversubscribed load, SLO scales 1.5 "
            "and 2.5",
            "OrbitFlow Fig. 8a/9d: OrbitFlow keeps >75% TBT attainment at high rates and tight "
            "SLO; up to +48% TBT and +66% TPOT attainment over baselines; at SLO scale 2.5 "
            "baselines fall to ~50% as the rate grows; throughput 3.3x DeepSpeed-Inference and "
            "4-52% above the other baselines.",
            _fig8a,
        ),
        Experiment(
            "orbitflow-fig14a", "Ablation: batch-uniform -> +request-wise -> +pause -> +deposit",
            "OrbitFlow Fig. 14a (TBT attainment, SLO scale 1, 0.97 req/min): 45.1% -> 54.5% -> 71% -> 85.6%; "
            "the same trend at scale 2.5.",
            _fig14a,
        ),
        Experiment(
            "orbitflow-fig14c", "Pause victim rule (largest = blocks + deposit, the paper's text; "
            "longest; shortest; random)",
            "OrbitFlow Fig. 14c: pausing the longest request is the most effective rule "
            "(numbers not given in the text).",
            _fig14c,
        ),
        Experiment(
            "deposit-credit", "Token deposit: delivery pacing with and without its SLO-cap "
            "credit (orbitflow, kvplane; request-wise+pause has no deposit)",
            "OrbitFlow §3.2/§3.3.1 (no number): the deposit masks SLO violations, and the SLO "
            "cap counts a step as failed only once the deposit is empty. kvplane's default "
            "(Policy.deposit_credit = false) keeps the pacing and drops the credit.",
            _deposit_credit,
        ),
        Experiment(
            "orbitflow-table1", "Solver overhead (calls per request, E2E %, TBT %)",
            "OrbitFlow Table 1: Both Static 1.25 calls/req, 0.27% E2E, 23.47% TBT; Token "
            "Dynamic 11.92, 0.37%, 31.65%; Both Dynamic 48.33, 0.64%, 28.49%.",
            _table1,
        ),
        Experiment(
            "layerkv-ttft", "Mean and P99 TTFT vs arrival rate: layerkv vs no-offload (vLLM)",
            "LayerKV Fig. 6/7: up to 69x lower mean TTFT and 45x lower P99 TTFT than vLLM at "
            "high rates; throughput within 3%.",
            _layerkv,
        ),
        Experiment(
            "superinfer-attainment", "TTFT and TBT SLO attainment: lvf vs no-offload (vLLM)",
            "SuperInfer Fig. 16: up to 74.7% higher TTFT SLO attainment than vLLM at high "
            "request rates with comparable TBT attainment.",
            _superinfer,
        ),
        Experiment(
            "kvplane-combined", "The default kvplane policy vs its parts, the baselines and vanilla",
            "Issue 15 (no paper number; our claim): on every seed kvplane's TBT attainment >= "
            "orbitflow's, P99 TTFT <= orbitflow's, SLO goodput >= every baseline's (vanilla "
            "included), zero rejections.",
            _kvplane,
        ),
        Experiment(
            "served-admission", "The served default --kv-scheduler fcfs vs layerkv under SGLang's "
            "admission (the widened slot space binds, not a batch size), with vanilla",
            "No paper number (our question): kvplane-combined's win of the LayerKV admission is "
            "at OrbitFlow's batch of 4; does it hold where SGLang admits up to its slot space, "
            "and so should it be the plugin's default?",
            _served_admission,
        ),
        Experiment(
            "ellm-throughput", "Output token throughput, TTFT, TPOT attainment and SLO goodput vs "
            "relative load: ellm vs vLLM-Recompute, vLLM-Swap and HCache (Llama2-13B on A100)",
            "eLLM Fig. 10/12 (§6.2, Llama2-13B): throughput 2.64x vLLM-Recompute, 2.61x "
            "vLLM-Swap, 1.91x HCache on ShareGPT (L-Eval: 2.73x, 3.03x, 1.61x); mean TTFT 2.63x / "
            "2.59x / 1.7x lower (L-Eval 1.76x / 1.71x / 1.37x); TPOT SLO attainment 97.3% vs "
            "< 88% (vLLM) and 92.8% (HCache). Fig. 14/15 (§6.4, L-Eval, 0.5x-3x load): eLLM's "
            "TTFT knee at 2x for Llama2-13B, as HCache's; ~90% SLO attainment at 3x.",
            _ellm,
        ),
        Experiment(
            "recompute-vs-fetch", "Where recomputing an uncached prefix beats fetching its KV, "
            "per layer, across prefix length and link bandwidth (placement model, no runs)",
            "eLLM §4.3.1 (no number): recompute some layers of the uncached prefix and fetch the "
            "others so that the two overlap; issue 16 expects recompute to win on slow links.",
            lambda smoke: [],
        ),
    )
}
