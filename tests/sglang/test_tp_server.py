"""A real tensor-parallel layered server: ``--tp-size 2`` on CPU, against the session's vanilla server.

Scenario: a layered SGLang 0.5.23 server of the tiny model with two TP ranks (one scheduler
process per rank, the model's 4 query / 2 KV heads split 2 / 1 per rank, all-reduces over gloo),
with the embedded control plane, ``--enable-metrics``, a device
KV budget of 96 token-layers and a starvation guard after 6 paused steps (the pause test's
setting), so 20 concurrent requests are offloaded, paused and resumed. Rank 0 plans and
broadcasts each :class:`~sglang_ext.tp_sync.StepInstall`; both ranks must install it alike, each
on its own KV shard. Both servers run in fp32 (:data:`FP32`). Checked: vanilla's greedy tokens and
logprobs (``assert_same_generation``, 1e-4), each rank's /metrics series, each rank's own residency-event
and pool-stats files, identical step for step. Negative controls: the recomputed prefix K
perturbed on TP rank 1 only fails the same generation check; the label and byte checks catch a
rank-0-only metric and the unsharded page size.

The reference is the session's TP=1 vanilla server. The all-reduce sums partial products in
another order than one rank does: in fp16 that moved logprobs by up to 2e-3 (4 prompts, 8
tokens; same tokens), 20x the tolerance, so this module started a TP=2 vanilla server of its
own. Every test server now serves float32 (``conftest.TEST_DTYPE_ARGS``), where a vanilla TP=2
and a vanilla TP=1 server differ by at most 4.8e-7 (the 20 greedy prompts, 8 tokens, same tokens;
session 39), 200x under the tolerance: that server's start-up (a launcher, two ranks and a
detokenizer importing SGLang) bought nothing.

What SGLang 0.5.23 needs for ``--tp-size > 1`` on a CPU-only host (:func:`tp_env`), found here:
``SGLANG_CPU_OMP_THREADS_BIND`` (otherwise ``numa_utils.init_threads_binding`` asserts ranks <=
NUMA nodes, 1 here), and ``SGLANG_NCCL_SO_PATH`` naming a library that does not exist: this
venv's CUDA build of torch ships ``libnccl.so.2``, so ``GroupCoordinator`` builds a
``PyNcclCommunicator``, which fails in ``torch.cuda.device(cpu)`` ("Expected a cuda device, but
got: cpu"); without the library it disables itself and the TP group all-reduces over gloo.
``--disable-custom-all-reduce`` keeps SGLang from trying its CUDA all-reduce.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from sglang_ext.hooks import ResidencyEventKind, read_jsonl_events
from sglang_ext.metric_spec import WORKER_METRICS
from sglang_ext.settings import (
    POOL_STATS_FILE_ENV,
    RESIDENCY_EVENTS_FILE_ENV,
    STATS_FILE_ENV,
    rank_output_file,
)
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from sglang_ext.testing.tiny_model import TinyModelSpec
from tests.sglang.conftest import (
    PROMPTS,
    assert_same_generation,
    fault_inject_path,
    flag_file,
    greedy,
    running_server,
)
from tests.sglang.test_dashboard import load_promql

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # two TP start-ups on a loaded host

TP = 2
BUDGET_TOKENS = 96
MAX_NEW_TOKENS = 12
SPEC = TinyModelSpec()
FP32 = ("--dtype", "float32")
"""Both servers compute in fp32 (as ``test_recompute_server.py``'s): a recomputed prefix runs
through GEMMs of another shape than the prefill that first wrote its KV, which in SGLang's default
fp16 alone moved logprobs by 9.8e-4 here (TP=2, r=0.5, same tokens)."""
KV_DTYPE_BYTES = 4
"""fp32 KV cache."""
RANK_PAGE_BYTES = (SPEC.num_key_value_heads // TP) * SPEC.head_dim * 2 * KV_DTYPE_BYTES
"""Bytes of one layer-page (page size 1) on one rank: its share of the KV heads, K and V."""
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
T = TypeVar("T")


def tp_env(root: Path) -> dict[str, str]:
    """The environment SGLang 0.5.23 needs to run ``--tp-size 2`` on a CPU-only host (see the
    module docstring): one OpenMP core per rank, and no NCCL library."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"SGLANG_CPU_OMP_THREADS_BIND": f"{cpus[0]}|{cpus[-1]}",
            "SGLANG_NCCL_SO_PATH": str(root / "no-libnccl.so.2")}


TP_ARGS = ("--tp-size", str(TP), "--disable-custom-all-reduce", *FP32)


@dataclass
class TpServer:
    server: SGLangServer
    root: Path
    corrupt_flag: Path
    """While this file exists, TP rank 1 perturbs recomputed prefix K (the fault injector)."""

    def files(self, name: str) -> list[Path]:
        """``name``'s file of every TP rank, rank 0 first."""
        return [rank_output_file(self.root / name, rank) for rank in range(TP)]


@pytest.fixture(scope="module")
def layered_tp(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[TpServer]:
    """The layered server with two TP ranks (see the module docstring)."""
    root = tmp_path_factory.mktemp("layered-tp2")
    (root / "policy.json").write_text(json.dumps({"max_paused_steps": 6, "window_min": 2, "window_max": 4,
                                                  "slo_ttft_ms": 1e7}))
    (root / "prom").mkdir()
    flags = [*TP_ARGS, "--enable-layered-kv", "--kv-policy", str(root / "policy.json"),
             "--kv-gpu-budget-tokens", str(BUDGET_TOKENS), "--mem-fraction-static", "0.3", "--enable-metrics"]
    env = {
        **tp_env(root),
        "PROMETHEUS_MULTIPROC_DIR": str(root / "prom"),
        STATS_FILE_ENV: str(root / "stats.jsonl"),
        POOL_STATS_FILE_ENV: str(root / "pool_stats.jsonl"),
        RESIDENCY_EVENTS_FILE_ENV: str(root / "events.jsonl"),
        "PYTHONPATH": fault_inject_path(),
        "KVPLANE_TEST_CORRUPT_RECOMPUTE_FILE": str(root / "corrupt-recompute"),
        "KVPLANE_TEST_CORRUPT_RANK": "1",
    }
    with running_server(tiny_model_dir, root, flags, env, zygote=launch_zygote) as layered:
        yield TpServer(layered, root, root / "corrupt-recompute")


def _lines(path: Path) -> list[dict]:
    return read_jsonl(path)


def _settled(read: Callable[[], T], agree: Callable[[T], bool], timeout_s: float = 30.0) -> T:
    """``read()`` once ``agree`` holds for it (the ranks finish a step a moment apart), else the last."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = read()
        if agree(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def scrape(server: SGLangServer) -> Samples:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=60) as resp:
        return load_promql().parse_samples(resp.read().decode())


def by_rank(samples: Samples, name: str) -> dict[str, float]:
    """``name``'s value summed per ``tp_rank`` label."""
    out: dict[str, float] = {}
    for (n, labels), value in samples.items():
        if n == name:
            rank = dict(labels).get("tp_rank", "?")
            out[rank] = out.get(rank, 0.0) + value
    return out


LOCKSTEP_COUNTERS = ("kvplane:offloaded_layer_pages_total", "kvplane:loaded_layer_pages_total",
                     "kvplane:fetched_layer_pages_total", "kvplane:h2d_bytes_total", "kvplane:d2h_bytes_total",
                     "kvplane:overflow_steps_total", "kvplane:stall_seconds_count")
"""Per-rank series that identical installs on identical shards must move alike."""


def _untimed(line: dict) -> dict:
    return {k: v for k, v in line.items() if k != "time_s" and "seconds" not in k}


@dataclass
class Workload:
    outputs: list[dict]
    stats: list[dict]
    """Rank 0's per-step lines ($KVPLANE_STATS_FILE)."""
    pool_lines: list[list[dict]]
    """Each rank's pool stats lines, rank 0 first."""
    events: list[list[Any]]
    """Each rank's residency events, rank 0 first."""
    samples: Samples


@pytest.fixture(scope="module")
def workload(layered_tp: TpServer) -> Workload:
    """20 concurrent greedy requests with logprobs; then each rank's files and /metrics, once the
    ranks agree."""
    ts = layered_tp
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outputs = list(pool.map(lambda p: greedy(ts.server, p, MAX_NEW_TOKENS, logprobs=True), PROMPTS))
    pool_lines = _settled(lambda: [_lines(p) for p in ts.files("pool_stats.jsonl")],
                          lambda per_rank: len({len(x) for x in per_rank}) == 1)
    events = _settled(lambda: [read_jsonl_events(p) if p.exists() else [] for p in ts.files("events.jsonl")],
                      lambda per_rank: len({len(x) for x in per_rank}) == 1)
    samples = _settled(lambda: scrape(ts.server),
                       lambda s: all(len(set(by_rank(s, m).values())) == 1 for m in LOCKSTEP_COUNTERS))
    return Workload(outputs, _lines(ts.root / "stats.jsonl"), pool_lines, events, samples)


def test_tp2_layered_server_offloads_pauses_and_matches_vanilla(workload, vanilla_server):
    """20 concurrent prompts on the layered TP=2 server, offloaded to host and paused / resumed
    mid-generation, give the vanilla TP=2 server's greedy tokens and logprobs (within 1e-4)."""
    for prompt, got in zip(PROMPTS, workload.outputs, strict=True):
        assert_same_generation(got, greedy(vanilla_server, prompt, MAX_NEW_TOKENS, logprobs=True), prompt)
    paused = [rid for line in workload.stats for rid in line.get("paused_now") or ()]
    resumed = [rid for line in workload.stats for rid in line.get("resumed_now") or ()]
    assert len(paused) >= 5, f"expected pauses, stats show {len(paused)}"
    assert set(paused) <= set(resumed), "a paused request was never resumed"
    assert workload.stats[-1]["paused"] == []
    assert any(line["decision"] for line in workload.stats), "no control-plane decision was installed"
    assert not any(line["fallback"] for line in workload.stats)
    for rank, lines in enumerate(workload.pool_lines):
        assert max(line["host_layer_pages"] for line in lines) > 0, f"rank {rank} offloaded nothing"
        assert lines[-1]["fetched_layer_pages_total"] > 0, f"rank {rank} fetched nothing"


def test_each_rank_writes_its_own_files_identical_step_for_step(workload, layered_tp):
    """Each TP rank writes its own residency-event and pool-stats file (rank 1: ``*.tp1.jsonl``);
    rank 0's events count each pause once (both ranks appending to one file doubled them), and the
    ranks' events and per-forward residency lines are identical apart from times. Negative
    control: rank 1's lines shifted by one forward differ from rank 0's."""
    paused = sum(len(line.get("paused_now") or ()) for line in workload.stats)
    ev0, ev1 = workload.events
    assert [e.kind for e in ev0].count(ResidencyEventKind.PAUSED) == paused > 0
    def key(e: Any) -> tuple:
        return (e.seq, e.kind, e.rid, e.blocks, e.layers)

    assert [key(e) for e in ev0] == [key(e) for e in ev1]
    assert [e.seq for e in ev0] == list(range(len(ev0))), "rank 0's event seq is not gap-free"
    p0, p1 = ([_untimed(x) for x in lines] for lines in workload.pool_lines)
    assert len(p0) > 10 and p0 == p1
    assert p0[1:] != p1[:-1]  # negative control
    assert not (layered_tp.root / "pool_stats.tp0.jsonl").exists()


def test_metrics_come_from_both_tp_ranks(workload):
    """/metrics has every per-rank kvplane series for tp_rank 0 and 1 and the scheduling ones for
    tp_rank 0 only; the ranks' transfer counters are equal and count rank-sized pages: H2D bytes =
    (fetched + loaded layer-pages) x one rank's layer-page bytes (its 1 of 2 KV heads). Negative
    controls: a rank-0-only metric fails the both-ranks check; the unsharded page size fails the
    bytes check."""
    s = workload.samples

    def ranks(name: str) -> set[str]:
        return set(by_rank(s, name))

    for spec in WORKER_METRICS:
        want = {"0", "1"} if spec.scope == "rank" else {"0"}
        assert ranks(spec.series[-1]) == want, spec.name
    assert ranks("kvplane:plans_total") != {"0", "1"}  # negative control
    for name in LOCKSTEP_COUNTERS:
        values = by_rank(s, name)
        assert values["0"] == values["1"], f"{name}: {values}"
    for rank in ("0", "1"):
        pages = by_rank(s, "kvplane:fetched_layer_pages_total")[rank] + by_rank(s, "kvplane:loaded_layer_pages_total")[rank]
        h2d = by_rank(s, "kvplane:h2d_bytes_total")[rank]
        assert pages > 0 and h2d == pages * RANK_PAGE_BYTES
        assert h2d != pages * RANK_PAGE_BYTES * TP  # negative control: a whole (unsharded) page
        assert by_rank(s, "kvplane:device_kv_budget_tokens")[rank] == BUDGET_TOKENS / SPEC.num_hidden_layers


def _recompute(server: SGLangServer, prompt: str) -> dict:
    """A greedy request recomputing the first half of its prompt in every decode step (eLLM)."""
    payload = {"text": prompt, "return_logprob": True,
               "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0,
                                   "custom_params": {"kvplane_recompute_ratio": 0.5}}}
    return server.post("/generate", payload)


def test_one_ranks_corrupted_kv_shard_is_caught(workload, layered_tp, vanilla_server):
    """A request recomputing half its prompt matches vanilla TP=2; the same with the recomputed
    prefix K perturbed on TP rank 1 only (its one KV head; rank 0 untouched) does not -- the check
    sees each rank's shard."""
    clean, corrupted = "Recompute me please: red orange yellow", "Recompute me too: zero one two three"
    before = len(_lines(layered_tp.root / "pool_stats.jsonl"))
    assert_same_generation(_recompute(layered_tp.server, clean),
                           greedy(vanilla_server, clean, MAX_NEW_TOKENS, logprobs=True), clean)
    recomputed = [x["recompute_tokens"] for x in _lines(layered_tp.root / "pool_stats.jsonl")[before:]]
    assert max(recomputed) > 0, "the request recomputed nothing: the scenario is not exercised"
    with flag_file(layered_tp.corrupt_flag):
        got = _recompute(layered_tp.server, corrupted)
    want = greedy(vanilla_server, corrupted, MAX_NEW_TOKENS, logprobs=True)
    with pytest.raises(AssertionError):
        assert_same_generation(got, want, corrupted)
