"""Decode graphs with tensor parallelism (``--kv-cuda-graphs on --tp-size 2``), on this CPU.

Three layered servers of the tiny model, each with two TP ranks (each rank's KV shard, all-reduces
over gloo: ``test_tp_server.py``'s set-up): one on the layered Triton decode, one on the layered
FlashInfer decode over the stand-in wrapper (``KVPLANE_TEST_FLASHINFER_STAND_IN``, which refuses a
run of other heads than its plan's: each rank plans its own), and that one under SGLang's overlap
loop (``--kv-overlap-schedule on``: all but the layer timer's sampled steps replay, on both ranks
alike). SGLang's decode graphs of 1, 2
and 4 rows emulated by the test injector (``KVPLANE_TEST_TAPE_GRAPHS``: ``test_graph_server.py``),
and the tiny device budget under which most layer-pages are on host: decode steps that stage pages
replay, with their fetches and write-back as launches of each rank's graph. A captured forward's
collectives (the layers' all-reduces, the logits' all-gather) are recorded on the tape and rerun
at their place in a replay (``TapeGraph``'s ``COLLECTIVES``), as a CUDA graph holds NCCL's kernels.

Checked against the session's vanilla server (fp32; TP=2 and TP=1 differ by ~5e-7 there,
``test_tp_server.py``): greedy tokens and logprobs within 1e-4, every rank replaying the same
steps, staged ones among them, each rank's pool lines identical; a batch replays the multi-row
graphs on both ranks (on FlashInfer's server with a padded row). The FlashInfer server's control:
replays not planned for their step (``KVPLANE_TEST_UNPLANNED_REPLAY_FILE``) differ. Then the agreement
(:class:`~sglang_ext.graph_tp_agreement.GraphTpAgreement`): while one rank's graph refuses every
step (the injector's ``KVPLANE_TEST_GRAPH_DECLINE_FILE``, rank 1), no rank replays and the outputs
still equal vanilla's; once it stops, both replay again (the control: the same check fails on the
replays of an unarmed run). Last, the FlashInfer server recaptures after a weight update
(``KVPLANE_TEST_CPU_RECAPTURE``) on both ranks. Not shown here, by its nature: what a disagreement would do on a GPU
(gloo pairs an eager all-reduce with a replayed one correctly; SGLang's custom all-reduce does not).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_ext.settings import POOL_STATS_FILE_ENV, rank_output_file
from sglang_ext.testing.jsonl import read_jsonl_settled
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    PROMPTS,
    assert_same_generation,
    batched,
    fault_armed,
    fault_inject_path,
    greedy,
    running_servers,
)
from tests.sglang.test_tp_server import TP, TP_ARGS, tp_env

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # a TP start-up and interpreted Triton

NEW_TOKENS = 6
FLAGS = ["--enable-layered-kv", "--attention-backend", "triton", "--page-size", "4",
         "--kv-cuda-graphs", "on", "--cuda-graph-backend-decode", "full", "--cuda-graph-bs-decode", "1", "2", "4",
         "--kv-gpu-budget-tokens", "49"]
"""``test_graph_server.py``'s offload server: 12 device pages per rank (one the graphs' sink)."""
BACKENDS = ("triton", "flashinfer")
SLOT_TOKENS = {"triton": 48, "flashinfer": 96}
"""``--max-total-tokens``: the Triton server's is the offload server's (two of :data:`BATCH` fit at
once); the FlashInfer server's holds all three, so their first decode step replays the size-4
graph with one padded row on each rank (then kvplane's planner pauses one: the tiny budget does
not stage three at once)."""
ONE_BY_ONE = list(PROMPTS[:4])
BATCH = list(PROMPTS[4:7])


@dataclass
class TpGraphServer:
    server: SGLangServer
    root: Path
    name: str
    """``triton`` or ``flashinfer`` (the layered decode its graphs capture), ``flashinfer-overlap``."""

    @property
    def decline_flag(self) -> Path:
        return self.root / "decline"

    def tape(self) -> Counter:
        """(kind, size, rank) of every capture and replay so far."""
        path = self.root / "tape.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return Counter((line.split()[0], line.split()[1], line.split()[-1]) for line in lines)

    def pool_lines(self) -> list[list[dict]]:
        """Each rank's pool stats lines, rank 0 first."""
        return [read_jsonl_settled(rank_output_file(self.root / "stats.jsonl", rank)) for rank in range(TP)]


@pytest.fixture(scope="module")
def tp_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[dict[str, TpGraphServer]]:
    """The TP servers, started side by side: the layered Triton decode, the layered FlashInfer
    decode over the stand-in wrapper (``KVPLANE_TEST_FLASHINFER_STAND_IN``), and that one under
    SGLang's overlap loop (``--kv-overlap-schedule on``)."""
    names = (*BACKENDS, "flashinfer-overlap")
    roots = {name: tmp_path_factory.mktemp(f"tp-graphs-{name}") for name in names}

    def env(name: str) -> dict[str, str]:
        root = roots[name]
        return {**tp_env(root), "TRITON_INTERPRET": "1", "PYTHONPATH": fault_inject_path(),
                "KVPLANE_TEST_TAPE_GRAPHS": str(root / "tape.log"), POOL_STATS_FILE_ENV: str(root / "stats.jsonl"),
                "KVPLANE_TEST_GRAPH_DECLINE_FILE": str(root / "decline"), "KVPLANE_TEST_GRAPH_DECLINE_RANK": "1",
                "KVPLANE_TEST_CPU_RECAPTURE": "1",
                **({"KVPLANE_TEST_FLASHINFER_STAND_IN": "1", "KVPLANE_TEST_UNPLANNED_REPLAY_FILE": str(root / "unplanned")}
                   if name.startswith("flashinfer") else {})}

    def flags(name: str) -> list[str]:
        overlap = ["--kv-overlap-schedule", "on"] if name.endswith("overlap") else []
        return [*TP_ARGS, *FLAGS, "--max-total-tokens", str(SLOT_TOKENS[name.split("-")[0]]),
                "--mem-fraction-static", "0.3", *overlap]

    specs = [(roots[name], flags(name), env(name)) for name in names]
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as started:
        yield {name: TpGraphServer(server, roots[name], name) for name, server in zip(names, started, strict=True)}


@pytest.fixture(params=BACKENDS)
def tp_graphs(request, tp_servers) -> TpGraphServer:
    return tp_servers[request.param]


def _replays(tape: Counter) -> dict[str, int]:
    """Replays per rank label (``rank=0``, ``rank=1``)."""
    out = {f"rank={r}": 0 for r in range(TP)}
    for (kind, _, rank), n in tape.items():
        if kind == "replay":
            out[rank] += n
    return out


def _run(ts: TpGraphServer, vanilla: SGLangServer) -> tuple[dict[str, int], list[list[dict]]]:
    """The prompts one after another (every rank runs the same forwards), each equal to vanilla's;
    the replays per rank and each rank's pool lines added meanwhile."""
    ts.server.flush_cache()
    tape, before = ts.tape(), [len(lines) for lines in ts.pool_lines()]
    for prompt in ONE_BY_ONE:
        assert_same_generation(greedy(ts.server, prompt, NEW_TOKENS, logprobs=True),
                               greedy(vanilla, prompt, NEW_TOKENS, logprobs=True), prompt)
    ts.server.flush_cache()
    added = [lines[n:] for lines, n in zip(ts.pool_lines(), before, strict=True)]
    return _replays(ts.tape() - tape), added


def _untimed(line: dict) -> dict:
    return {k: v for k, v in line.items() if k != "time_s" and "seconds" not in k}


def test_both_ranks_replay_the_same_staged_steps_and_equal_vanilla(tp_graphs, vanilla_server):
    """Every rank captured SGLang's three sizes; every decode step replayed on both ranks (one
    replay a step a rank: as many as the decode lines), steps that staged pages among them; each
    rank's pool lines identical apart from times; the outputs are vanilla's."""
    captured = {(size, rank) for kind, size, rank in tp_graphs.tape() if kind == "capture"}
    assert captured == {(size, f"rank={r}") for size in ("1", "2", "4") for r in range(TP)}, captured
    replays, lines = _run(tp_graphs, vanilla_server)
    decode = [[line for line in rank if line["new_tokens"] == line["batch_size"]] for rank in lines]
    assert replays["rank=0"] == replays["rank=1"] == len(decode[0]) >= len(ONE_BY_ONE) * (NEW_TOKENS - 2), \
        (replays, len(decode[0]))
    assert sum(line["staging_pages"] > 0 for line in decode[0]) >= 2
    assert [_untimed(x) for x in lines[0]] == [_untimed(x) for x in lines[1]]
    log = tp_graphs.server.log_path.read_text()
    assert "layered_decode_graph_eager" not in log
    backend = {"triton": "LayeredTritonDecode", "flashinfer": "LayeredFlashInferDecode"}[tp_graphs.name]
    assert len(re.findall(rf"layered_decode_graphs\s+backend=.?{backend}", log)) == TP, log[-2000:]  # each rank's


def test_a_batch_replays_the_multi_row_graphs_on_both_ranks(tp_graphs, vanilla_server):
    """Three requests sent as one batch: their steps replay the multi-row graphs, the same ones on
    both ranks, and the outputs are vanilla's for the same batch (review, session 90: one-at-a-time
    prompts replay only the size-1 graph). On the Triton server two of them fit the 48-token slot
    space together (the size-2 graph); the FlashInfer server holds all three, so their first
    decode step replays the size-4 graph with a padded row on the sink on each rank (its wrappers
    planned for four rows, this rank's heads), until the planner pauses one (:data:`SLOT_TOKENS`)."""
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    tape = tp_graphs.tape()
    got = batched(tp_graphs.server, BATCH, params, logprobs=True)
    tp_graphs.server.flush_cache()
    for prompt, g, w in zip(BATCH, got, batched(vanilla_server, BATCH, params, logprobs=True), strict=True):
        assert_same_generation(g, w, prompt)
    replays = {(size, rank): n for (kind, size, rank), n in (tp_graphs.tape() - tape).items() if kind == "replay"}
    sizes = {size for size, _ in replays}
    assert all(replays.get((size, "rank=0")) == replays.get((size, "rank=1")) for size in sizes), replays
    assert sum(n for (size, rank), n in replays.items() if size != "1" and rank == "rank=0") >= NEW_TOKENS - 2, replays
    if tp_graphs.name == "flashinfer":  # all three at once: padded to 4
        assert replays.get(("4", "rank=0"), 0) >= 1, replays


def test_a_step_one_rank_declines_runs_eagerly_on_every_rank(tp_graphs, vanilla_server):
    """While rank 1's graph refuses every step, rank 0 (which would admit them) runs them eagerly
    too, naming why; the outputs stay vanilla's. Once rank 1 admits again both ranks replay
    (the control of the no-replay check)."""
    with fault_armed(tp_graphs.server, tp_graphs.decline_flag):
        replays, lines = _run(tp_graphs, vanilla_server)
    assert replays == {"rank=0": 0, "rank=1": 0}, replays
    assert sum(line["new_tokens"] == line["batch_size"] for line in lines[0]) >= len(ONE_BY_ONE) * (NEW_TOKENS - 2)
    reasons = set(re.findall(r"layered_decode_graph_eager\s+reason=.([^'\"]*)", tp_graphs.server.log_path.read_text()))
    assert {"declined on this rank by the test injector", "another TP rank runs this step eagerly"} <= reasons, reasons
    after, _ = _run(tp_graphs, vanilla_server)
    assert after["rank=0"] == after["rank=1"] > 0, after


def _unplanned_replays_differ(ts: TpGraphServer, vanilla: SGLangServer) -> None:
    """While the server's graph wrappers skip every plan after their capture's, a prompt's
    replays (on each rank) read the capture's lengths, and its output differs from vanilla's."""
    tape = ts.tape()
    with fault_armed(ts.server, ts.root / "unplanned"):
        got = greedy(ts.server, ONE_BY_ONE[0], NEW_TOKENS, logprobs=True)
        ts.server.flush_cache()
    assert _replays(ts.tape() - tape)["rank=0"] >= 1
    with pytest.raises(AssertionError):
        assert_same_generation(got, greedy(vanilla, ONE_BY_ONE[0], NEW_TOKENS, logprobs=True), ONE_BY_ONE[0])


def test_flashinfer_replays_not_planned_for_their_step_are_caught(tp_servers, vanilla_server):
    """Negative control of the FlashInfer server's equality: while its graph wrappers skip every
    plan after their capture's, each rank's replays read the lengths the capture's plan wrote and
    the outputs differ from vanilla's."""
    _unplanned_replays_differ(tp_servers["flashinfer"], vanilla_server)


def test_under_the_overlap_loop_both_ranks_replay_all_but_the_sampled_steps(tp_servers, vanilla_server):
    """TP, FlashInfer's graphs and SGLang's overlap loop together (step k+1's boundary, admission
    and plan while step k's results wait): the outputs are vanilla's; both ranks replay the same
    steps, every decode step but the layer timer's sampled ones (rank 0's timer declines them
    through the vote, so rank 1 runs them eagerly too: ``test_graph_tp_agreement.py``), staged
    steps among the replays, each rank's pool lines identical, and no step eager for any other
    reason. Control: replays not planned for their step differ from vanilla's."""
    from sglang_ext.layer_timing import DEFAULT_EVERY

    ts = tp_servers["flashinfer-overlap"]
    replays, lines = _run(ts, vanilla_server)
    decode = [[line for line in rank if line["new_tokens"] == line["batch_size"]] for rank in lines]
    sampled = -(-len(decode[0]) // DEFAULT_EVERY) + 1  # one in DEFAULT_EVERY, wherever the count starts
    assert replays["rank=0"] == replays["rank=1"], replays
    assert len(decode[0]) - sampled <= replays["rank=0"] < len(decode[0]), (replays, len(decode[0]))
    assert sum(line["staging_pages"] > 0 for line in decode[0]) >= 2
    assert [_untimed(x) for x in lines[0]] == [_untimed(x) for x in lines[1]]
    reasons = set(re.findall(r"layered_decode_graph_eager\s+reason=.([^'\"]*)", ts.server.log_path.read_text()))
    assert reasons == {"a sampled step is timed eagerly (the overlap loop)", "another TP rank runs this step eagerly"}, \
        reasons
    _unplanned_replays_differ(ts, vanilla_server)


def test_a_recapture_after_a_weight_update_replays_on_both_ranks(tp_servers, tiny_model_dir, vanilla_server):
    """SGLang's recapture after a weight update (``test_graph_recapture_server.py``) under TP, on the
    FlashInfer server (the module's last test: its graphs are recaptured): every rank captures
    every size again over its buffers and wrappers, both ranks replay the same steps after it,
    and the outputs are still vanilla's."""
    ts = tp_servers["flashinfer"]
    tape = ts.tape()
    got = ts.server.post("/update_weights_from_disk", {"model_path": str(tiny_model_dir), "recapture_cuda_graph": True})
    assert got.get("success") is True, got
    captured = {(size, rank) for kind, size, rank in ts.tape() - tape if kind == "capture"}
    assert captured == {(size, f"rank={r}") for size in ("1", "2", "4") for r in range(TP)}, captured
    assert ts.server.log_path.read_text().count("layered_decode_graphs_recapture") == TP
    replays, _ = _run(ts, vanilla_server)
    assert replays["rank=0"] == replays["rank=1"] >= len(ONE_BY_ONE) * (NEW_TOKENS - 2), replays
