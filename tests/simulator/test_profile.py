"""Profiles, presets and the prefill/offload model (LayerKV Eq. 3-4)."""

import json

import pytest

from simulator.profile import load_profile, preset_names


@pytest.mark.parametrize("name", preset_names())
def test_presets_load_and_document_sources(name):
    """Every preset loads and documents where its numbers come from."""
    p = load_profile(name)
    assert p.sources
    assert p.base_tbt_slo_ms() > 0


def test_three_presets_ship():
    """The A5000, H100 and GH200 presets of the issue are present."""
    assert {"llama3-8b-a5000-pcie3", "llama3-8b-h100-pcie5", "qwen2.5-32b-gh200-c2c"} <= set(
        preset_names())


def test_offload_hides_under_prefill_for_long_prompts():
    """Eq. 4: the retained layers shrink as the prompt grows (prefill is superlinear)."""
    p = load_profile("llama3-8b-a5000-pcie3").with_changes(d2h_gbps=0.05)
    xs = [p.min_gpu_layers(n) for n in (256, 2048, 16384, 65536)]
    assert xs == sorted(xs, reverse=True)
    assert xs[0] > xs[-1]
    for n, x in zip((256, 2048, 16384, 65536), xs, strict=True):
        assert p.offload_ms(n, p.layers - x) <= p.prefill_ms(n) + 1e-9


def test_measured_profile_loads(tmp_path):
    """A `kvplane profile` style file (layer_compute_ms + h2d_gbps) loads over a base preset."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"layer_compute_ms": [0.5] * 32, "h2d_gbps": 20.0,
                                "device": "NVIDIA H100"}))
    p = load_profile(str(path))
    assert p.decode_layer_base_ms == 0.5 and p.h2d_gbps == 20.0 and p.layers == 32


def test_unknown_profile_is_a_clear_error():
    """A missing profile names the presets."""
    with pytest.raises(ValueError, match="presets"):
        load_profile("no-such-profile")


def test_data_plane_profile_format_loads(tmp_path):
    """The data plane's DeviceProfile JSON (affine or points) loads; points are fitted affinely."""
    common = {"device": "NVIDIA H100 80GB HBM3", "layers": 32, "block_size": 16,
              "block_bytes": 65536, "h2d_gbps": 24.1, "d2h_gbps": 24.8}
    a = tmp_path / "affine.json"
    a.write_text(json.dumps({**common, "layer_compute_ms": {"fixed_ms": 0.05,
                                                             "per_token_ms": 0.0004}}))
    pa = load_profile(str(a))
    assert pa.layer_compute_ms(1000) == pytest.approx(0.45)
    assert pa.d2h_gbps == 24.8
    b = tmp_path / "points.json"
    b.write_text(json.dumps({**common, "layer_compute_ms": [
        {"tokens": 0, "ms": 0.1}, {"tokens": 1000, "ms": 0.3}, {"tokens": 2000, "ms": 0.5}]}))
    pb = load_profile(str(b))
    assert pb.decode_layer_base_ms == pytest.approx(0.1)
    assert pb.decode_layer_ms_per_token == pytest.approx(0.0002)


def test_launch_cost_is_the_simulated_steps_truth(tmp_path):
    """A measured file's fetch_launch_ms becomes the simulator's truth (presets: 0), a negative
    one is refused, and the engine's step time charges it per fetch launch."""
    from simulator.engine import Engine, SimConfig
    from simulator.policies import make_policy
    from tests.simulator.helpers import small_trace

    common = {"device": "NVIDIA H200", "layers": 32, "block_size": 16, "block_bytes": 65536, "h2d_gbps": 48.0,
              "d2h_gbps": 49.0, "layer_compute_ms": {"fixed_ms": 0.3, "per_token_ms": 0.0}}
    f = tmp_path / "launch.json"
    f.write_text(json.dumps({**common, "fetch_launch_ms": 0.4}))
    assert load_profile(str(f)).fetch_launch_ms == 0.4
    assert load_profile("llama3-8b-a5000-pcie3").fetch_launch_ms == 0.0
    with pytest.raises(ValueError, match="fetch_launch_ms"):
        load_profile("llama3-8b-a5000-pcie3").with_changes(fetch_launch_ms=-1.0)
    prof, trace = small_trace(n=3, seed=2, rate=6.0)
    runs = {}
    fast = prof.with_changes(h2d_gbps=1e6, d2h_gbps=1e6)  # transfers hide nothing of the launches
    for launch in (0.0, 2.0):  # the same fixed policy, every layer offloaded
        res = Engine(fast.with_changes(fetch_launch_ms=launch), trace, make_policy("deepspeed"),
                     SimConfig(record_steps=True)).run()
        runs[launch] = res.decode_ms
    assert runs[2.0] > runs[0.0] + 1.0


def test_controller_learns_the_launch_cost_from_steady_placed_steps():
    """A controller started without the launch cost (as without --kv-profile) learns it from the
    placed steps of a run whose truth has one -- re-plans that keep the placement count as
    steady -- and learns nothing when the truth has none (negative control). Started with the
    truth (a gpu-check-fitted profile) it keeps it."""
    from simulator.engine import Engine, SimConfig
    from simulator.policies.controlled import ControlledPolicy
    from simulator.trace import TraceSpec, generate_trace

    base = load_profile("llama3-8b-h100-pcie5")
    tight = base.with_changes(gpu_kv_budget_blocks=int(base.gpu_kv_budget_blocks * 0.05))
    trace = generate_trace(TraceSpec("orbitflow-32k", 16, 20.0, slo_scale=1.5, seed=2, output_scale=0.08), tight)
    learnt = {}
    for truth, known in ((1.0, 0.0), (0.0, 0.0), (1.0, None)):
        pol = ControlledPolicy("orbitflow", planner="request-wise+pause", known_launch_ms=known)
        res = Engine(tight.with_changes(fetch_launch_ms=truth), trace, pol, SimConfig(record_steps=True)).run()
        assert any(0 in row for s in res.step_log for row in s.rows.values())  # placed steps ran
        assert pol.session is not None
        learnt[(truth, known)] = pol.session._profile.fetch_launch_ms
    assert 0.4 <= learnt[(1.0, 0.0)] <= 1.2
    assert learnt[(0.0, 0.0)] == 0.0
    assert learnt[(1.0, None)] == pytest.approx(1.0, rel=0.2)
