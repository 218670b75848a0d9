"""LayeredKVArgs: the --enable-layered-kv flag family validates with clear messages."""

from __future__ import annotations

import argparse

import pytest

from sglang_ext.args import ENV_VAR, LayeredKVArgs
from sglang_ext.layered_kv_cli import add_arguments
from tests.service.certs import ThrowawayCA


def _parse(*argv: str) -> LayeredKVArgs:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return LayeredKVArgs.from_namespace(parser.parse_args(list(argv)))


def test_defaults_are_off_and_embedded():
    """Without flags the plugin is off, embedded control plane, fcfs, pacing off (issue 17:
    chosen by `kvplane bench pacing`)."""
    args = _parse()
    assert args == LayeredKVArgs()
    assert not args.enable_layered_kv and args.kv_control_plane == "embedded"
    assert args.kv_scheduler == "fcfs" and args.kv_pacing == "off" and not args.pacing
    assert _parse("--kv-pacing", "on").pacing  # negative control: the property follows the flag
    assert args.kv_host_pool_gb is None  # sized to what the pool needs (checked at start)
    assert args.kv_overlap_schedule == "off" and _parse("--kv-overlap-schedule", "on").kv_overlap_schedule == "on"
    assert args.kv_copy_engine == "dma"  # the copy engines (gpu-check runs 18-19); triton where refused


def test_full_flag_set_parses(tmp_path):
    """Every flag parses into the dataclass; grpc target splits into host and port."""
    files = {name: tmp_path / name for name in ("ca", "cert", "key", "tok", "pol")}
    ca = ThrowawayCA()
    worker = ca.issue("worker", server=False)
    files["ca"].write_bytes(ca.cert_pem)
    files["cert"].write_bytes(worker.cert_pem)
    files["key"].write_bytes(worker.key_pem)
    files["tok"].write_text("tok-1\n")
    files["pol"].write_text("slo_tbt_ms: 150\n")
    args = _parse(
        "--enable-layered-kv",
        "--kv-control-plane", "grpc://cp.example:50051",
        "--kv-policy", str(files["pol"]),
        "--kv-host-pool-gb", "2.5",
        "--kv-scheduler", "lvf",
        "--kv-pacing", "off",
        "--kv-tls-ca", str(files["ca"]),
        "--kv-tls-cert", str(files["cert"]),
        "--kv-tls-key", str(files["key"]),
        "--kv-policy-token-file", str(files["tok"]),
        "--kv-report-interval", "1",
        "--kv-report-quiet-interval", "6",
        "--kv-recompute-ratio", "0.25",
        "--kv-recompute-layers", "2",
        "--kv-copy-programs", "32",
        "--kv-copy-engine", "triton",
        "--kv-timing-interval", "1",
    )
    assert args.enable_layered_kv and args.kv_host_pool_gb == 2.5 and not args.pacing
    assert args.kv_report_interval == 1 and args.report_quiet_interval == 6
    assert LayeredKVArgs().report_quiet_interval == 32  # 4 x the default interval 8
    assert LayeredKVArgs(kv_report_interval=300).report_quiet_interval == 1024  # capped
    assert (args.kv_recompute_ratio, args.kv_recompute_layers) == (0.25, 2)
    assert args.kv_copy_programs == 32 and LayeredKVArgs().kv_copy_programs is None
    assert args.kv_copy_engine == "triton" and LayeredKVArgs().kv_copy_engine == "dma"
    assert args.kv_timing_interval == 1 and LayeredKVArgs().kv_timing_interval == 8
    assert (args.control_plane_host, args.control_plane_port) == ("cp.example", 50051)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-scheduler", "sjf"], "--kv-scheduler='sjf' is invalid; allowed: fcfs, layerkv, lvf"),
        (["--kv-pacing", "maybe"], "--kv-pacing='maybe' is invalid; allowed: on, off"),
        (["--kv-overlap-schedule", "yes"], "--kv-overlap-schedule='yes' is invalid; allowed: on, off"),
        (["--kv-host-pool-gb", "0"], "--kv-host-pool-gb=0.0 is out of range (0, 65536]"),
        (["--kv-host-pool-gb", "1e9"], "out of range (0, 65536]"),
        (["--kv-control-plane", "http://x:1"], "allowed: 'embedded' or 'grpc://HOST:PORT'"),
        (["--kv-control-plane", "grpc://x:70000"], "port 70000 is out of range [1, 65535]"),
        (["--kv-policy", "/nonexistent/policy.yaml"], "--kv-policy='/nonexistent/policy.yaml': no such file"),
        (["--kv-report-interval", "0"], "--kv-report-interval=0 is out of range [1, 1024] (steps)"),
        (["--kv-report-interval", "5000"], "--kv-report-interval=5000 is out of range [1, 1024]"),
        (["--kv-report-quiet-interval", "4"],
         "--kv-report-quiet-interval=4 is out of range [8, 1024] (steps; at least --kv-report-interval)"),
        (["--kv-report-interval", "2", "--kv-report-quiet-interval", "2000"],
         "--kv-report-quiet-interval=2000 is out of range [2, 1024]"),
        (["--kv-recompute-ratio", "1"], "--kv-recompute-ratio=1.0 is out of range [0, 1)"),
        (["--kv-recompute-ratio", "-0.1"], "--kv-recompute-ratio=-0.1 is out of range [0, 1)"),
        (["--kv-recompute-layers", "-2"], "--kv-recompute-layers=-2 is out of range [0, model layers]"),
        (["--kv-recompute-layers", "3"], "--kv-recompute-layers=3 needs --kv-recompute-ratio > 0"),
        (["--kv-copy-programs", "0"], "--kv-copy-programs=0 is out of range [1, 4096]"),
        (["--kv-copy-programs", "5000"], "--kv-copy-programs=5000 is out of range [1, 4096]"),
        (["--kv-copy-engine", "cuda"], "--kv-copy-engine='cuda' is invalid; allowed: triton, dma"),
        (["--kv-timing-interval", "0"], "--kv-timing-interval=0 is out of range [1, 65536] (steps)"),
    ],
)
def test_bad_values_name_the_flag_and_range(argv, message):
    """A bad value raises ValueError naming the flag, the value and the allowed set."""
    with pytest.raises(ValueError) as info:
        _parse(*argv)
    assert message in str(info.value)


def test_recompute_layers_past_the_models_are_refused_once_the_model_is_known():
    """``--kv-recompute-layers`` is checked against the model's layers at launch (the launcher's
    line: ``test_launch_validation.py``); up to them it passes (the control), unset it passes."""
    args = LayeredKVArgs(enable_layered_kv=True, kv_recompute_ratio=0.5, kv_recompute_layers=5)
    assert args.model_error(4) == "--kv-recompute-layers=5 is out of range [0, 4] (the model's layers)"
    assert args.model_error(5) is None and args.model_error(32) is None
    assert LayeredKVArgs(enable_layered_kv=True, kv_recompute_ratio=0.5).model_error(1) is None


def test_tls_needs_remote_and_pairs(tmp_path):
    """TLS options need a grpc:// control plane, and cert/key come together."""
    cert = tmp_path / "cert"
    cert.write_text("x")
    with pytest.raises(ValueError, match="only apply to a remote control plane"):
        LayeredKVArgs(kv_tls_ca=str(cert))
    with pytest.raises(ValueError, match="must be given together"):
        LayeredKVArgs(kv_control_plane="grpc://h:1", kv_tls_cert=str(cert))


def test_env_round_trip_and_rejects_unknown_keys():
    """to_json/from_env round-trips; unknown keys and non-objects are rejected by name."""
    args = LayeredKVArgs(enable_layered_kv=True, kv_scheduler="layerkv")
    assert LayeredKVArgs.from_env({ENV_VAR: args.to_json()}) == args
    assert LayeredKVArgs.from_env({}) == LayeredKVArgs()
    with pytest.raises(ValueError, match="unknown kvplane option"):
        LayeredKVArgs.from_env({ENV_VAR: '{"kv_bogus": 1}'})
    with pytest.raises(ValueError, match="must hold a JSON object"):
        LayeredKVArgs.from_env({ENV_VAR: "[1]"})


def test_add_arguments_is_idempotent():
    """Adding the flags twice to one parser is a no-op the second time."""
    parser = argparse.ArgumentParser()
    assert add_arguments(parser) is True
    assert add_arguments(parser) is False
