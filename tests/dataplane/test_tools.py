"""The data-plane tools on the served core: `kvplane bench core` (arguments, a tiny CPU run) and
CPU smoke runs of `bench attention`, `bench transfer` and `profile` at toy shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvplane.cli import build_parser, main
from sglang_ext.tools import core_bench, profile_cmd


def test_bench_core_arguments():
    """Defaults are the issue's batch (8 x 256 tokens, 4 layers, page 16, fp16) over 1e4..1e6
    layer-pages; pool sizes accept exponents; bad values are refused by name."""
    argv = ["bench", "core"]
    args = build_parser(argv).parse_args(argv)
    assert (args.requests, args.tokens, args.layers, args.page_size, args.dtype) == (8, 256, 4, 16, "float16")
    assert core_bench._ints(args.pool_sizes, "pool-sizes") == [10_000, 100_000, 1_000_000]
    assert args.layouts.split(",") == list(core_bench.LAYOUTS)
    with pytest.raises(ValueError, match="pool-sizes"):
        core_bench._ints("1e4,x", "pool-sizes")


@pytest.mark.parametrize(("bad", "name"), [(["--layouts", "nope"], "layouts"),
                                           (["--budget-fraction", "1.5"], "budget-fraction"),
                                           (["--steps", "0"], "steps"), (["--pool-sizes", "a"], "pool-sizes")])
def test_bench_core_bad_options_exit_2_in_one_line(bad, name, capsys):
    """A bad option is one ``kvplane bench core:`` line naming it, exit 2, like the other
    commands (was SystemExit with status 1)."""
    assert main(["bench", "core", *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvplane bench core: --{name}"), err


def test_bench_core_tiny_cpu_run(tmp_path, capsys):
    """A tiny run writes JSON and Markdown naming the machine, one row per layout and pool size,
    every phase timed; the offloading layout stages steps, nothing overflows."""
    argv = ["bench", "core", "--pool-sizes", "400,4000", "--requests", "2", "--tokens", "40", "--steps", "2",
            "--events", "2", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    [path] = tmp_path.glob("core-*.json")
    body = json.loads(path.read_text())
    assert body["machine"].startswith("CPU: ") and "cores" in body["machine"]
    rows = body["rows"]
    assert [(r["layout"], r["pool_layer_pages"]) for r in rows] == [
        (layout, size) for layout in core_bench.LAYOUTS for size in (400, 4000)]
    for r in rows:
        assert all(r[f"{p}_cpu_ms"] >= 0 and r[f"{p}_wall_ms"] > 0 for p in core_bench.PHASES if p != "admit")
        assert r["admit_cpu_ms"] is None and r["admitted_steps"] == 0  # no --graph-admit
        assert r["overflow_steps"] == 0
        assert r["full_reconciles"] >= 2  # the finishes
    offload = [r for r in rows if r["layout"] == "paged-offload"]
    assert all(r["staged_steps"] > 0 and r["host_fraction"] > 0 for r in offload)
    assert all(r["advanced_steps"] == 0 for r in rows)  # torch-native reads: token tables every step
    md = path.with_suffix(".md").read_text()
    assert body["machine"] in md and md.count("| paged-offload |") == 2 and "token tables" in md
    assert "kvplane bench core on CPU" in capsys.readouterr().out


def test_bench_core_paged_reads_advance_the_paged_steps(tmp_path):
    """``--paged-reads`` (as the FlashInfer / Triton backends read): the paged layouts' steady
    steps run on advanced tables, the offloading ones with their staging; the boundary is timed
    apart from the step."""
    argv = ["bench", "core", "--pool-sizes", "4000", "--requests", "2", "--tokens", "40", "--steps", "4",
            "--events", "1", "--layouts", "paged,paged-offload", "--paged-reads", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    [path] = tmp_path.glob("core-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["layout"] for r in rows] == ["paged", "paged-offload"]
    assert all(r["advanced_steps"] > 0 and 0 <= r["boundary_cpu_ms"] <= r["steady_cpu_ms"] for r in rows)
    assert rows[1]["staged_steps"] > 0 and "page tables" in path.with_suffix(".md").read_text()


def test_bench_core_graph_admit_times_the_graph_buffers_load(tmp_path):
    """``--graph-admit``: every steady step of the paged layouts is admitted into graph buffers
    with staging (the offloading layout's staged ones too) and the load is timed apart; the
    Markdown has the column."""
    argv = ["bench", "core", "--pool-sizes", "4000", "--requests", "2", "--tokens", "40", "--steps", "4",
            "--events", "1", "--layouts", "paged,paged-offload", "--paged-reads", "--graph-admit",
            "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    [path] = tmp_path.glob("core-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert all(r["admitted_steps"] == 4 and r["admit_cpu_ms"] > 0 for r in rows), rows
    assert rows[1]["staged_steps"] > 0 and "graph admission" in path.with_suffix(".md").read_text()


def test_bench_attention_cpu_runs_on_the_served_core(tmp_path):
    """`--device cpu` at toy shapes: the placed steps are staged (fetches, no overflow), and the
    result names the machine and the data plane."""
    argv = ["bench", "attention", "--device", "cpu", "--layers", "2", "--q-heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--hidden", "32", "--requests", "2", "--context", "40", "--block-size", "8",
            "--repeat", "1", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    [path] = tmp_path.glob("attention-cpu-*.json")
    body = json.loads(path.read_text())
    assert body["machine"].startswith("CPU: ") and body["data_plane"].startswith("LayeredKVCore")
    assert body["placement_row"] == [1, 0]
    assert body["overflow_steps"] == 0 and body["fetched_layer_pages"] > 0 and body["host_fraction"] > 0
    assert body["bw_blocks_per_ms"] > 0


def test_bench_transfer_cpu_uses_the_served_engine(tmp_path):
    """`--device cpu`: one row per block size and batch, measured through the store's engine."""
    argv = ["bench", "transfer", "--device", "cpu", "--layers", "2", "--kv-heads", "1", "--head-dim", "8",
            "--block-sizes", "4,8", "--batches", "3", "--repeat", "1", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    [path] = tmp_path.glob("transfer-cpu-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["block_size"], r["batch_blocks"]) for r in rows] == [(4, 3), (8, 3)]
    assert all(r["engine"] == "CpuTransferEngine" and r["batched_h2d_gbps"] > 0 for r in rows)
    assert rows[0]["bytes"] == 2 * 3 * 4 * 1 * 8 * 2  # K and V of 3 pages of 4 tokens, fp16


def test_profile_bandwidth_moves_k_and_v_of_one_layer(monkeypatch):
    """The profile's bandwidth launch copies K and V of layer 0 of its pages (not K of layers 0
    and 1): after it the device pages hold exactly those segments."""
    stores = []

    class Recording(profile_cmd.SlotKVStore):
        def __init__(self, config):  # noqa: ANN001
            super().__init__(config)
            self.host.view(-1).copy_(torch.arange(self.host.numel()).to(self.host.dtype))
            stores.append(self)

    monkeypatch.setattr(profile_cmd, "SlotKVStore", Recording)
    argv = ["profile", "--device", "cpu", "--layers", "2", "--kv-heads", "1", "--head-dim", "4",
            "--block-size", "2", "--copy-blocks", "3", "--repeat", "1"]
    args = build_parser(argv).parse_args(argv)
    h2d, d2h, block_bytes = profile_cmd.bandwidth_gbps(args, "cpu", torch.float32)
    [store] = stores
    assert h2d > 0 and d2h > 0 and block_bytes == store.config.layer_page_bytes == 2 * 2 * 4 * 4
    for j, page in enumerate(range(1, 4)):
        assert torch.equal(store.dev[0, j], store.host[page, 0, 0])  # K of layer 0
        assert torch.equal(store.dev[1, j], store.host[page, 0, 1])  # V of layer 0


def test_profile_cpu_round_trips(tmp_path):
    """`kvplane profile --device cpu` at toy shapes writes a profile that loads through the schema."""
    out = tmp_path / "p.json"
    argv = ["profile", "--device", "cpu", "--layers", "2", "--hidden", "32", "--intermediate", "64",
            "--q-heads", "4", "--kv-heads", "2", "--head-dim", "8", "--block-size", "4", "--context", "12",
            "--tokens", "1,2", "--copy-blocks", "4", "--repeat", "1", "--out", str(out)]
    assert main(argv) == 0
    body = json.loads(out.read_text())
    assert body["block_bytes"] == 2 * 4 * 2 * 8 * 4 and body["h2d_gbps"] > 0
    assert [p["tokens"] for p in body["measured_points"]] == [1, 2]
    assert np.isfinite(body["layer_compute_ms"]["fixed_ms"])


def test_bench_core_idle_paused_parks_the_idle_requests(tmp_path):
    """``--idle-paused``: the live requests beyond the batch are paused by the plan. With room on
    the device their steady steps take the cheap path: the full reconciliations are the same as
    with the idle ones running-but-idle (the control run without the flag), not one per step."""
    base = ["bench", "core", "--pool-sizes", "8000", "--requests", "2", "--live-requests", "6", "--tokens", "40",
            "--steps", "8", "--events", "1", "--layouts", "paged", "--budget-fraction", "0.9"]
    rows = {}
    for flag in ([], ["--idle-paused"]):
        out = tmp_path / ("paused" if flag else "idle")
        assert main([*base, *flag, "--out-dir", str(out)]) == 0
        [path] = out.glob("core-*.json")
        [rows[bool(flag)]] = json.loads(path.read_text())["rows"]
    assert rows[True]["idle_paused"] and not rows[False]["idle_paused"]
    assert rows[True]["full_reconciles"] <= rows[False]["full_reconciles"] + 1 < 8
    assert "paused by the plan" in (tmp_path / "paused").joinpath(path.name).with_suffix(".md").read_text()
