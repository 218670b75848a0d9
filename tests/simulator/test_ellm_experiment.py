"""`kvplane sim reproduce ellm-throughput` and `recompute-vs-fetch`: the relative-load base, the
recompute/fetch crossover, and both experiments end to end on their smoke configuration."""

import json

import pytest

from simulator.crossover import (
    crossover_gbps,
    fetch_layer_ms,
    longest_recompute_win,
    recompute_layer_ms,
)
from simulator.ellm_experiment import POLICIES, base_rate_per_s
from simulator.profile import load_profile, preset_names
from simulator.reproduce import reproduce_many

A100 = "llama2-13b-a100-pcie4"


def test_relative_load_base_scales_with_kv_capacity_and_slo_only():
    """1x = KV capacity / E[(prompt + output/2) * output * SLO]: doubling the KV budget doubles
    it, doubling the SLO halves it, and the link does not enter (negative control)."""
    p = load_profile(A100)
    base = base_rate_per_s(p, "sharegpt", 50.0)
    assert base_rate_per_s(p.with_changes(gpu_kv_budget_blocks=2 * p.gpu_kv_budget_blocks),
                           "sharegpt", 50.0) == pytest.approx(2 * base, rel=1e-3)
    assert base_rate_per_s(p, "sharegpt", 100.0) == pytest.approx(base / 2, rel=1e-12)
    assert base_rate_per_s(p.with_changes(h2d_gbps=1.0), "sharegpt", 50.0) == base
    assert base_rate_per_s(p, "leval", 50.0) < base / 5  # long prompts fill memory sooner


def test_crossover_bandwidth_equalises_recompute_and_fetch():
    """At the crossover bandwidth one layer's recompute and fetch of u tokens cost the same; on a
    link twice as fast fetch is cheaper, on one half as fast recompute is (the two sides)."""
    p = load_profile(A100)
    for u in (16, 1024, 32768):
        bw = crossover_gbps(p, u)
        assert fetch_layer_ms(p, u, bw) == pytest.approx(recompute_layer_ms(p, u), rel=1e-12)
        assert fetch_layer_ms(p, u, 2 * bw) < recompute_layer_ms(p, u)
        assert fetch_layer_ms(p, u, bw / 2) > recompute_layer_ms(p, u)


def test_crossover_by_hand_for_the_a100_preset():
    """Hand-worked: Llama-2-13B (20480 B per token-layer, 13.016e9 params, 40 layers, h=5120) at
    312 TFLOPS, alpha 1.6, u=1024: recompute 1.6 * (2*13.016e9/40 + 2*1024*5120) / 312e12 s per
    token-layer -> crossover 20480 B / that = 6.1 GB/s; not the GQA preset's (negative control)."""
    p = load_profile(A100)
    per_token_s = 1.6 * (2 * 13.016e9 / 40 + 2 * 1024 * 5120) / 312e12
    assert crossover_gbps(p, 1024) == pytest.approx(20480 / per_token_s / 1e9, rel=1e-12)
    assert 6.0 < crossover_gbps(p, 1024) < 6.2
    gqa = load_profile("llama3-8b-a5000-pcie3")
    assert crossover_gbps(gqa, 1024) < crossover_gbps(p, 1024) / 5


def test_recompute_wins_only_on_slow_links():
    """On every preset's own link fetching is cheaper for every prefix length; on a 1 GB/s link
    the MHA A100 preset recomputes prefixes up to tens of thousands of tokens cheaper."""
    for name in preset_names():
        assert longest_recompute_win(load_profile(name)) == 0, name
    assert longest_recompute_win(load_profile(A100), 1.0) > 50_000


def test_ellm_experiments_run_end_to_end(tmp_path):
    """Both experiments' smoke versions write table.md, the PNG and results.json; every policy
    appears at every workload and load, with seeds aggregated and the shape checks written."""
    paths = reproduce_many(["ellm-throughput", "recompute-vs-fetch"], tmp_path, smoke=True,
                           jobs=1)
    assert [p.parent.name for p in paths] == ["ellm-throughput", "recompute-vs-fetch"]
    d = tmp_path / "ellm-throughput"
    runs = json.loads((d / "results.json").read_text())["runs"]
    assert len(runs) == 2 * 2 * 2 * len(POLICIES)  # workloads x loads x seeds x policies
    points = {(r["workload"], r["relative_load"], r["policy"]) for r in runs}
    assert points == {(w, x, p) for w in ("sharegpt", "leval") for x in (1.0, 2.0)
                      for p in POLICIES}
    table = (d / "table.md").read_text()
    assert table.startswith("# ellm-throughput")
    assert "every baseline's throughput at" in table and "| sharegpt | 2.0x |" in table
    assert (d / "ellm-throughput.png").stat().st_size > 10_000
    c = tmp_path / "recompute-vs-fetch"
    presets = json.loads((c / "results.json").read_text())["presets"]
    assert {r["preset"] for r in presets} == set(preset_names())
    assert (c / "recompute-vs-fetch.png").stat().st_size > 10_000
    assert "| llama2-13b-a100-pcie4 |" in (c / "table.md").read_text()
