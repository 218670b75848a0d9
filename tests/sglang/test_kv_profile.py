"""--kv-profile: a `kvplane profile` file validated at parse and seeding the controller's profile.

Scenario: without the flag the controller starts from 1 ms per layer and 16 GB/s and learns the
real figures from the first steps; with it, the session opens on the file's per-layer compute and
H2D bandwidth -- in the embedded controller and through the gRPC hello alike.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from controlplane.embedded import EmbeddedControlPlane
from controlplane.service.convert import worker_info_from_proto, worker_info_to_proto
from sglang_ext.args import LayeredKVArgs
from sglang_ext.layered_kv_cli import add_arguments
from sglang_ext.worker_info import (
    DEFAULT_H2D_GBPS,
    DEFAULT_LAYER_COMPUTE_MS,
    build_worker_info,
    initial_profile,
)

LAYERS = 4
PROFILE = {
    "device": "CPU: test",
    "layers": LAYERS,
    "block_size": 1,
    "block_bytes": 1024,
    "h2d_gbps": 24.5,
    "d2h_gbps": 20.0,
    "layer_compute_ms": {"fixed_ms": 0.25, "per_token_ms": 0.05},
}


def write_profile(tmp_path: Path, **changes: object) -> Path:
    """A profile file for a LAYERS-layer model (``changes`` override fields)."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**PROFILE, **changes}))
    return path


def _parse(*argv: str) -> LayeredKVArgs:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return LayeredKVArgs.from_namespace(parser.parse_args(list(argv)))


def _worker(args: LayeredKVArgs, layers: int = LAYERS):  # noqa: ANN202
    return build_worker_info(
        worker_id="w", layers=layers, block_size=1, block_bytes=512, gpu_kv_budget_blocks=64, args=args
    )


def test_flag_parses_and_travels_to_the_subprocesses(tmp_path: Path) -> None:
    """--kv-profile FILE lands in LayeredKVArgs and survives the JSON transport."""
    path = write_profile(tmp_path)
    args = _parse("--enable-layered-kv", "--kv-profile", str(path))
    assert args.kv_profile == str(path)
    assert LayeredKVArgs.from_json(args.to_json()) == args
    assert _parse().kv_profile is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--kv-profile='{path}': no such file"),
        ("{not json", "--kv-profile='{path}' is not a kvplane profile file: Expecting property name"),
        (json.dumps({k: v for k, v in PROFILE.items() if k != "h2d_gbps"}),
         "--kv-profile='{path}' is not a kvplane profile file: profile.h2d_gbps is required"),
        (json.dumps({**PROFILE, "h2d_gbps": -1}),
         "--kv-profile='{path}' is not a kvplane profile file: profile.h2d_gbps = -1 out of range (> 0)"),
    ],
)
def test_bad_profile_is_refused_at_parse(tmp_path: Path, content: str | None, message: str) -> None:
    """A missing or malformed profile is a launch error naming the flag, the path and the problem."""
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as info:
        _parse("--enable-layered-kv", "--kv-profile", str(path))
    assert message.format(path=path) in str(info.value)


def test_without_a_profile_the_controller_starts_from_defaults() -> None:
    """No file: 1 ms per layer and 16 GB/s, learnt from the first steps (no dead field is read)."""
    worker = _worker(LayeredKVArgs(enable_layered_kv=True))
    assert worker.hardware.h2d_gbps == DEFAULT_H2D_GBPS
    assert worker.profile.layer_compute_ms == (DEFAULT_LAYER_COMPUTE_MS,) * LAYERS


def test_profile_reaches_the_embedded_controller(tmp_path: Path) -> None:
    """The embedded controller's session opens on the file's per-layer compute and H2D bandwidth."""
    args = LayeredKVArgs(enable_layered_kv=True, kv_profile=str(write_profile(tmp_path)))
    control_plane = EmbeddedControlPlane(synchronous=True)
    try:
        status = control_plane.open_session(_worker(args)).status()
    finally:
        control_plane.close()
    assert status.h2d_gbps == 24.5
    assert status.layer_compute_ms == pytest.approx((0.25 + 0.05 * 1,) * LAYERS)


def test_profile_reaches_a_remote_controller_through_the_hello(tmp_path: Path) -> None:
    """The gRPC hello carries the same figures (WorkerInfo -> protobuf -> WorkerInfo)."""
    args = LayeredKVArgs(enable_layered_kv=True, kv_profile=str(write_profile(tmp_path)))
    worker = _worker(args)
    received = worker_info_from_proto(worker_info_to_proto(worker))
    assert received.hardware.h2d_gbps == 24.5
    assert received.profile.layer_compute_ms == pytest.approx(worker.profile.layer_compute_ms)


def test_profile_of_another_model_is_refused(tmp_path: Path) -> None:
    """A profile measured for a different layer count names both counts."""
    path = write_profile(tmp_path, layers=32)
    with pytest.raises(ValueError, match="the profile has 32 layers, the served model 4"):
        initial_profile(LAYERS, path)


def test_point_profiles_are_read_at_one_sequence(tmp_path: Path) -> None:
    """A point-list profile gives the layer time of a one-sequence decode step."""
    path = write_profile(tmp_path, layer_compute_ms=[{"tokens": 1, "ms": 0.3}, {"tokens": 8, "ms": 0.9}])
    profile = initial_profile(LAYERS, path)
    assert profile.layer_compute_ms == (0.3,) * LAYERS
    assert (profile.h2d_gbps, profile.d2h_gbps, profile.source) == (24.5, 20.0, str(path))


def test_launch_cost_of_the_file_reaches_both_controllers(tmp_path: Path) -> None:
    """The file's fetch_launch_ms (gpu-check's ``overlap.fetch_launch_ms``) is the session's
    starting launch cost, embedded and through the gRPC hello; a file without it starts at 0, and
    a negative one is refused naming the field."""
    args = LayeredKVArgs(enable_layered_kv=True, kv_profile=str(write_profile(tmp_path, fetch_launch_ms=0.35)))
    worker = _worker(args)
    assert worker.profile.fetch_launch_ms == 0.35
    assert worker_info_from_proto(worker_info_to_proto(worker)).profile.fetch_launch_ms == 0.35
    plain = _worker(LayeredKVArgs(enable_layered_kv=True, kv_profile=str(write_profile(tmp_path))))
    assert plain.profile.fetch_launch_ms == 0.0  # negative control
    assert worker_info_from_proto(worker_info_to_proto(plain)).profile.fetch_launch_ms == 0.0
    with pytest.raises(ValueError, match="fetch_launch_ms"):
        initial_profile(LAYERS, write_profile(tmp_path, fetch_launch_ms=-0.1))
