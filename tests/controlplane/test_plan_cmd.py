"""`kvplane plan` end to end: the real console entry point in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

BATCH = {
    "model": {"layers": 8, "block_size": 16, "block_bytes": 65536},
    "hardware": {"gpu_kv_budget_blocks": 900, "h2d_gbps": 25},
    "profile": {"layer_compute_ms": 0.5},
    "requests": [
        {"id": "a", "context_tokens": 1000, "slo_tbt_ms": 50},
        {"id": "b", "context_tokens": 3000, "slo_tbt_ms": 50, "deposit_tokens": 3},
    ],
    "policy": {"alpha": 0.5, "window_min": 1, "window_max": 64},
}
PLAN_KEYS = {
    "feasible", "paused", "placements", "predicted_step_ms", "window_steps",
    "resident_blocks", "staging_blocks", "solver", "solve_ms",
}


def kvplane(tmp_path, payload, *extra):
    path = tmp_path / "batch.json"
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return subprocess.run(
        [sys.executable, "-m", "kvplane.cli", "plan", "--batch", str(path), *extra],
        capture_output=True, text=True, timeout=120,
    )


def test_single_batch_gives_one_schema_plan(tmp_path):
    """One batch object in, one plan object with the schema's fields out (stdout is pure JSON)."""
    out = kvplane(tmp_path, BATCH, "--time-budget-ms", "200", "--current-step", "7")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert PLAN_KEYS <= set(plan) and plan["expiry_step"] == 7 + plan["window_steps"]
    assert plan["feasible"] is True and set(plan["placements"]) == {"a", "b"}
    assert all(len(row) == 8 and set(row) <= {0, 1} for row in plan["placements"].values())
    assert plan["resident_blocks"] + plan["staging_blocks"] <= 900
    assert "plan_solved" in out.stderr


def test_list_in_list_out_same_order(tmp_path):
    """A list of batches gives a list of plans in the same order."""
    second = json.loads(json.dumps(BATCH))
    second["requests"] = [{"id": "z", "context_tokens": 10, "slo_tbt_ms": 50}]
    out = kvplane(tmp_path, [BATCH, second], "--victim-rule", "longest")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)
    assert [set(p["placements"]) for p in plans] == [{"a", "b"}, {"z"}]


def test_malformed_batch_exits_2_naming_the_field(tmp_path):
    """A bad field exits with code 2 and names the field, value and range on stderr."""
    bad = json.loads(json.dumps(BATCH))
    bad["requests"][1]["context_tokens"] = -3
    out = kvplane(tmp_path, [BATCH, bad])
    assert out.returncode == 2 and out.stdout == ""
    assert "[1].requests[1].context_tokens" in out.stderr and "-3" in out.stderr


def test_a_key_that_is_not_a_field_exits_2_naming_it(tmp_path):
    """A misspelt key at any level -- a request's ``slo_tbt_msx``, the policy's ``alpa``, the
    top's ``requestz``, and the model's, hardware's and profile's -- is refused naming it and
    the known fields (before session 86 such a key was ignored and the batch planned as if it
    were absent). Control: the batch as it is plans (exit 0, above)."""
    typos = {
        "requests[0].slo_tbt_msx": lambda b: b["requests"][0].update(slo_tbt_msx=5),
        "policy.alpa": lambda b: b["policy"].update(alpa=0.9),
        "requestz": lambda b: b.update(requestz=[]),
        "model.layer": lambda b: b["model"].update(layer=8),
        "hardware.h2d_gbs": lambda b: b["hardware"].update(h2d_gbs=25),
        "profile.layer_compute": lambda b: b["profile"].update(layer_compute=0.5),
    }
    for field, typo in typos.items():
        batch = json.loads(json.dumps(BATCH))
        typo(batch)
        out = kvplane(tmp_path, batch)
        assert out.returncode == 2 and out.stdout == "", (field, out.stdout, out.stderr)
        assert f"invalid batch: {field}: is not a field (known: " in out.stderr, out.stderr
    out = kvplane(tmp_path, [BATCH, {**BATCH, "polcy": {}}])
    assert out.returncode == 2 and "invalid batch: [1].polcy: is not a field" in out.stderr, out.stderr


def test_missing_field_and_bad_json_exit_2(tmp_path):
    """A missing required field and unparsable JSON both exit with code 2 and a clear message."""
    missing = json.loads(json.dumps(BATCH))
    del missing["hardware"]["h2d_gbps"]
    out = kvplane(tmp_path, missing)
    assert out.returncode == 2 and "hardware.h2d_gbps" in out.stderr
    out = kvplane(tmp_path, "{not json")
    assert out.returncode == 2 and "invalid JSON" in out.stderr


def test_a_file_that_is_not_utf8_exits_2_naming_it(tmp_path):
    """Bytes that are not UTF-8 (a binary file passed by mistake) exit 2 with a message, not a
    traceback; control: the same bytes' UTF-8 prefix parses as far as JSON goes."""
    path = tmp_path / "batch.json"
    path.write_bytes(b'{"model": \xff\xfe}')
    out = subprocess.run([sys.executable, "-m", "kvplane.cli", "plan", "--batch", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not UTF-8 text (byte 10)" in out.stderr and "Traceback" not in out.stderr
    assert "invalid JSON" in kvplane(tmp_path, '{"model": }').stderr


def test_the_shipped_example_batch_plans_with_offload():
    """controlplane/examples/batch.json (README "kvplane plan") is a valid batch whose budget
    forces layers to host memory: the plan is feasible, fits, and offloads some layer."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "controlplane" / "examples" / "batch.json"
    out = subprocess.run([sys.executable, "-m", "kvplane.cli", "plan", "--batch", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    budget = json.loads(path.read_text())["hardware"]["gpu_kv_budget_blocks"]
    assert plan["feasible"] and plan["resident_blocks"] + plan["staging_blocks"] <= budget
    assert any(0 in row for row in plan["placements"].values())
