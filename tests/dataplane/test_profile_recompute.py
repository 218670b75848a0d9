"""The profile file's optional ``recompute_ms_per_token`` (issue 16, docs/recompute.md): the schema
reads, checks and writes it; `kvplane profile` measures it (a prefix prefill through the synthetic
layer, per token) unless ``--recompute-tokens 0``."""

from __future__ import annotations

import json
import math

import pytest

from sglang_ext.dataplane.profile_schema import DeviceProfile

BASE = {"device": "CPU: test", "layers": 2, "block_size": 4, "block_bytes": 256, "h2d_gbps": 1.0,
        "d2h_gbps": 1.0, "layer_compute_ms": {"fixed_ms": 0.1, "per_token_ms": 0.01}}
TOY = ["profile", "--device", "cpu", "--layers", "2", "--hidden", "32", "--intermediate", "64", "--q-heads", "4",
       "--kv-heads", "2", "--head-dim", "8", "--block-size", "4", "--context", "12", "--tokens", "1,2",
       "--copy-blocks", "4", "--repeat", "1"]


def test_schema_reads_checks_and_writes_the_recompute_cost(tmp_path):
    """Present: read and written back; absent: None and not written; negative or not a number:
    ValueError naming the field."""
    p = DeviceProfile.from_dict({**BASE, "recompute_ms_per_token": 0.002})
    assert p.recompute_ms_per_token == 0.002
    p.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json") == p
    old = DeviceProfile.from_dict(BASE)  # negative control: an older file has none
    assert old.recompute_ms_per_token is None and "recompute_ms_per_token" not in old.to_dict()
    for bad in (-1.0, "fast", True):
        with pytest.raises(ValueError, match="recompute_ms_per_token"):
            DeviceProfile.from_dict({**BASE, "recompute_ms_per_token": bad})


def test_profile_cmd_measures_the_recompute_cost(tmp_path):
    """`kvplane profile --device cpu` at toy shapes writes a positive per-token recompute cost that
    loads through the schema; --recompute-tokens 0 leaves it out."""
    pytest.importorskip("torch")
    from kvplane.cli import main

    out = tmp_path / "p.json"
    assert main([*TOY, "--recompute-tokens", "16", "--out", str(out)]) == 0
    rms = json.loads(out.read_text())["recompute_ms_per_token"]
    assert math.isfinite(rms) and rms > 0
    assert DeviceProfile.load(out).recompute_ms_per_token == rms
    assert main([*TOY, "--recompute-tokens", "0", "--out", str(out)]) == 0
    assert "recompute_ms_per_token" not in json.loads(out.read_text())


def test_schema_reads_checks_and_writes_the_fetch_launch_cost(tmp_path):
    """``fetch_launch_ms`` (optional, >= 0): read and written back; absent: 0 and not written."""
    p = DeviceProfile.from_dict({**BASE, "fetch_launch_ms": 0.3})
    assert p.fetch_launch_ms == 0.3
    p.save(tmp_path / "p.json")
    assert DeviceProfile.load(tmp_path / "p.json") == p
    old = DeviceProfile.from_dict(BASE)
    assert old.fetch_launch_ms == 0.0 and "fetch_launch_ms" not in old.to_dict()
    for bad in (-0.5, "slow", True):
        with pytest.raises(ValueError, match="fetch_launch_ms"):
            DeviceProfile.from_dict({**BASE, "fetch_launch_ms": bad})
