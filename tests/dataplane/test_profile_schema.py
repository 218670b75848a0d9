"""The profile file schema the planner and simulator load."""

import json
import subprocess
import sys

import pytest

from sglang_ext.dataplane.profile_schema import DeviceProfile

BASE = {"device": "NVIDIA H100", "layers": 32, "block_size": 16, "block_bytes": 131072,
        "h2d_gbps": 25.0, "d2h_gbps": 24.0}


def test_affine_and_points_round_trip(tmp_path):
    """Both layer_compute_ms forms load, evaluate and survive save/load unchanged."""
    affine = DeviceProfile.from_dict({**BASE, "layer_compute_ms": {"fixed_ms": 0.1, "per_token_ms": 0.01}})
    assert affine.layer_compute_ms(10) == pytest.approx(0.2)
    pts = DeviceProfile.from_dict({**BASE, "layer_compute_ms": [{"tokens": 1, "ms": 1.0}, {"tokens": 9, "ms": 2.0}]})
    assert pts.layer_compute_ms(5) == pytest.approx(1.5)
    assert pts.layer_compute_ms(17) == pytest.approx(3.0)  # end segment's slope
    assert affine.h2d_blocks_per_ms == pytest.approx(25e6 / 131072)
    for p in (affine, pts):
        path = tmp_path / "p.json"
        p.save(path)
        assert DeviceProfile.load(path) == p


@pytest.mark.parametrize(
    ("patch", "field"),
    [({"h2d_gbps": 0}, "h2d_gbps"), ({"layers": 1.5}, "layers"), ({"device": ""}, "device"),
     ({"layer_compute_ms": 3}, "layer_compute_ms")],
)
def test_bad_fields_are_named(patch, field):
    """A bad field raises ValueError naming it."""
    d = {**BASE, "layer_compute_ms": {"fixed_ms": 0.1, "per_token_ms": 0.0}, **patch}
    with pytest.raises(ValueError, match=field):
        DeviceProfile.from_dict(json.loads(json.dumps(d)))


def test_schema_imports_without_torch():
    """The simulator can load profiles without importing torch."""
    code = ("import sys; import sglang_ext.dataplane.profile_schema as m; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("tool", [["bench", "transfer"], ["bench", "attention"], ["profile"]])
def test_tools_refuse_without_cuda(tool, capsys):
    """Without CUDA the GPU tools print why and exit 2 (unless --device cpu)."""
    import torch

    from kvplane.cli import main

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the tools would run")
    assert main([*tool]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_profile_affine_fit_recovers_a_line():
    """The profile's least-squares fit returns the line through exact points, clamped at 0."""
    from sglang_ext.tools.profile_cmd import affine_fit

    assert affine_fit([(1, 1.5), (8, 5.0), (32, 17.0)]) == pytest.approx((1.0, 0.5))
    assert affine_fit([(1, 2.0), (8, 1.0)])[1] == 0.0  # noisy negative slope is clamped
