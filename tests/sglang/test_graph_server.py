"""SGLang's own decode graph runner over the layered Triton decode (``--kv-cuda-graphs on``), on
this CPU: graphs captured and replayed by ``DecodeCudaGraphRunner`` on an emulated graph.

The test injector (``fault_inject/sitecustomize.py``, ``KVPLANE_TEST_TAPE_GRAPHS``) lets SGLang
capture on a CPU and gives its runner :class:`~sglang_ext.testing.tape_graph_backend.TapeGraphBackend`:
capture records every aten op and Triton launch (``TRITON_INTERPRET=1``) of the runner's forward,
a replay reruns the record on the captured tensors -- no Python of the model or of kvplane -- so a
layer that reads anything but the persistent graph buffers replays stale data, as on a GPU.

Servers (side by side): the layered Triton decode eager with most KV on host (the reference), and
with decode graphs: in the identity layout and in the paged layout with nothing offloaded (steps
replay), and with the reference's tiny device budget (steps that stage pages replay too, their
fetches and write-back launches of the graph, each step with one kvplane boundary), also under
SGLang's overlap loop (``--kv-overlap-schedule on``), and on the layered FlashInfer backend over a
stand-in of FlashInfer's decode wrapper (``KVPLANE_TEST_FLASHINFER_STAND_IN``: FlashInfer needs
CUDA) -- in the identity layout, with the tiny budget, and with it under the overlap loop. Outputs are compared
as per-token logprobs (:data:`tests.sglang.conftest.LOGPROB_ATOL`); the negative control replays
over tables that were not loaded (``KVPLANE_TEST_STALE_GRAPH_FILE``), staged steps whose
fetch lists were emptied (``KVPLANE_TEST_EMPTY_GRAPH_FETCHES_FILE``), and FlashInfer replays not
planned for their own step (``KVPLANE_TEST_UNPLANNED_REPLAY_FILE``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_ext.settings import POOL_STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl_settled
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    LOGPROB_ATOL,
    PROMPTS,
    fault_armed,
    fault_inject_path,
    running_servers,
    token_logprobs,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

NEW_TOKENS = 6
TRITON = ["--enable-layered-kv", "--attention-backend", "triton", "--page-size", "4", "--mem-fraction-static", "0.3"]
"""``--mem-fraction-static 0.3``: eight servers start side by side, and on a CPU SGLang's memory
profile counts what the others allocate meanwhile as this one's weights (at the recipe's 0.05 the
suite's run at 1f63994 had one refuse to start: "leave no GPU memory for the KV cache"); the KV
pools stay the sizes ``--max-total-tokens`` gives."""
GRAPHS = ["--kv-cuda-graphs", "on", "--cuda-graph-backend-decode", "full", "--cuda-graph-bs-decode", "1", "2", "4"]
"""Decode graphs of 1, 2 and 4 rows: a batch of 3 replays padded to 4 (padded rows on the sink)."""
OFFLOAD = ["--kv-gpu-budget-tokens", "49", "--max-total-tokens", "48"]
"""The offload tests' budget: 12 device pages (one the graphs' sink), most layer-pages on host."""
BATCH = list(PROMPTS[4:7])


PAGED = ["--kv-gpu-budget-tokens", "4000"]
"""A budget that holds every layer-page of these requests: the paged layout, nothing offloaded."""


@pytest.fixture(scope="module")
def servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[dict]:
    names = ("eager", "identity", "paged", "offload", "overlap", "flashinfer", "flashinfer-identity",
             "flashinfer-overlap")
    roots = {name: tmp_path_factory.mktemp(f"graphs-{name}") for name in names}
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": fault_inject_path()}

    def graph_env(name: str) -> dict:
        root = roots[name]
        return {**env, "KVPLANE_TEST_TAPE_GRAPHS": str(root / "tape.log"),
                "KVPLANE_TEST_STALE_GRAPH_FILE": str(root / "stale"),
                "KVPLANE_TEST_EMPTY_GRAPH_FETCHES_FILE": str(root / "no-fetches"),
                POOL_STATS_FILE_ENV: str(root / "stats.jsonl")}

    def flashinfer_env(name: str) -> dict:  # the layered FlashInfer backend over the stand-in wrapper
        return {**graph_env(name), "KVPLANE_TEST_FLASHINFER_STAND_IN": "1",
                "KVPLANE_TEST_UNPLANNED_REPLAY_FILE": str(roots[name] / "unplanned")}

    specs = [(roots["eager"], [*TRITON, *OFFLOAD], {**env, POOL_STATS_FILE_ENV: str(roots["eager"] / "stats.jsonl")}),
             (roots["identity"], [*TRITON, *GRAPHS], graph_env("identity")),
             (roots["paged"], [*TRITON, *GRAPHS, *PAGED], graph_env("paged")),
             (roots["offload"], [*TRITON, *GRAPHS, *OFFLOAD], graph_env("offload")),
             (roots["overlap"], [*TRITON, *GRAPHS, *OFFLOAD, "--kv-overlap-schedule", "on"], graph_env("overlap")),
             (roots["flashinfer"], [*TRITON, *GRAPHS, *OFFLOAD], flashinfer_env("flashinfer")),
             (roots["flashinfer-identity"], [*TRITON, *GRAPHS], flashinfer_env("flashinfer-identity")),
             (roots["flashinfer-overlap"], [*TRITON, *GRAPHS, *OFFLOAD, "--kv-overlap-schedule", "on"],
              flashinfer_env("flashinfer-overlap"))]
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as started:
        yield {**dict(zip(names, started, strict=True)), "roots": roots}


def _generate(server: SGLangServer, prompts: list[str]) -> list[dict]:
    """One batched greedy request of ``prompts`` (SGLang runs them as one decode batch)."""
    out = server.post("/generate", {"text": prompts, "return_logprob": True,
                                    "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}})
    return out if isinstance(out, list) else [out]


def _worst(got: list[dict], want: list[dict]) -> float:
    """The largest per-token logprob difference (inf where the tokens differ)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if g["output_ids"] != w["output_ids"]:
            return float("inf")
        worst = max(worst, *(abs(a - b) for a, b in zip(token_logprobs(g), token_logprobs(w), strict=True)))
    return worst


def _tape(root: Path) -> Counter:
    """Captures and replays by size, from the injector's log."""
    lines = (root / "tape.log").read_text().splitlines() if (root / "tape.log").exists() else []
    return Counter(tuple(line.split()[:2]) for line in lines)


def _requests(server: SGLangServer, root: Path) -> tuple[list[dict], Counter]:
    """A lone prompt, then a batch of three (padded to 4); the outputs and what replayed meanwhile."""
    before = _tape(root)
    out = _generate(server, [PROMPTS[0]]) + _generate(server, BATCH)
    server.flush_cache()
    return out, _tape(root) - before


@pytest.mark.parametrize("name", ["identity", "flashinfer-identity"])
def test_identity_decode_replays_sglangs_graphs_and_equals_eager(servers, name):
    """Nothing offloaded (the identity layout, what serves without a budget): every decode step
    replays, on the Triton decode and on FlashInfer's (the stand-in), equal to the eager server's."""
    want, _ = _requests(servers["eager"], servers["roots"]["eager"])
    got, replayed = _requests(servers[name], servers["roots"][name])
    assert _worst(got, want) <= LOGPROB_ATOL
    tape = _tape(servers["roots"][name])
    assert {size for kind, size in tape if kind == "capture"} == {"1", "2", "4"}, tape  # SGLang's sizes
    # every decode step of both requests replayed: the lone one at 1 row, the batch padded to 4
    assert replayed[("replay", "1")] >= NEW_TOKENS - 2 and replayed[("replay", "4")] >= NEW_TOKENS - 2, replayed
    assert "layered_decode_graph_eager" not in servers[name].log_path.read_text()
    if name.startswith("flashinfer"):  # control: the replays' plans skipped, they read their capture's
        root = servers["roots"][name]
        with fault_armed(servers[name], root / "unplanned"):
            broken, replayed = _requests(servers[name], root)
        assert replayed[("replay", "1")] >= 1 and _worst(broken, want) > 100 * LOGPROB_ATOL


def test_replays_over_stale_tables_are_caught(servers):
    """Negative control: admitted steps whose tables never reach the graph buffers replay the last
    loaded step's -- the comparison above fails."""
    want, _ = _requests(servers["eager"], servers["roots"]["eager"])
    server, root = servers["identity"], servers["roots"]["identity"]
    with fault_armed(server, root / "stale"):
        got, replayed = _requests(server, root)
    assert replayed[("replay", "4")] >= 1
    assert _worst(got, want) > 100 * LOGPROB_ATOL


def test_paged_layout_decode_replays_and_equals_eager(servers):
    """A budget that holds everything: the paged layout's tables (rows of the whole pool, the sink
    its last page) replay."""
    want, _ = _requests(servers["eager"], servers["roots"]["eager"])
    got, replayed = _requests(servers["paged"], servers["roots"]["paged"])
    assert _worst(got, want) <= LOGPROB_ATOL
    assert replayed[("replay", "1")] >= NEW_TOKENS - 2 and replayed[("replay", "4")] >= NEW_TOKENS - 2, replayed
    assert "layered_decode_graph_eager" not in servers["paged"].log_path.read_text()


def _stats(root: Path) -> list[dict]:
    return read_jsonl_settled(root / "stats.jsonl") if (root / "stats.jsonl").exists() else []


def _one_at_a_time(server: SGLangServer, root: Path) -> tuple[list[dict], Counter]:
    """:func:`_requests`' prompts sent one after another: every server runs the same forwards (a
    batch's requests may reach two servers' schedulers a step apart, and then their steps differ)."""
    server.flush_cache()  # whatever ran before: no prefix of these prompts cached
    before = _tape(root)
    out = [r for prompt in [PROMPTS[0], *BATCH] for r in _generate(server, [prompt])]
    server.flush_cache()
    return out, _tape(root) - before


def test_steps_that_stage_pages_replay_and_equal_eager(servers):
    """KV on host: a decode step that stages pages replays too -- its fetches and its parked tokens'
    write-back are launches of the graph, their lists loaded after kvplane's boundary
    (``GraphStaging``) -- and the output is the eager server's. The pool writes one stats line per
    boundary, exactly as many as the eager server's for the same requests, with the same tokens
    (no second boundary for any step); the decode steps that staged pages replayed: no step ran
    eagerly for staging, and the replays number the decode steps."""
    roots = servers["roots"]
    before = {name: len(_stats(roots[name])) for name in ("eager", "offload")}
    want, _ = _one_at_a_time(servers["eager"], roots["eager"])
    got, replayed = _one_at_a_time(servers["offload"], roots["offload"])
    assert _worst(got, want) <= LOGPROB_ATOL
    log = servers["offload"].log_path.read_text()
    reasons = re.findall(r"layered_decode_graph_eager\s+reason=.([^'\"]*)", log)
    assert not [r for r in reasons if "stage" in r or "copies" in r], reasons
    lines = {name: _stats(roots[name])[before[name]:] for name in before}
    added = {name: [(line["batch_size"], line["new_tokens"]) for line in lines[name]] for name in before}
    assert added["eager"] and added["offload"] == added["eager"], added
    decode = [line for line in lines["offload"] if line["new_tokens"] == line["batch_size"]]
    staged = [line for line in decode if line["staging_pages"] > 0]
    replays = sum(n for (kind, _), n in replayed.items() if kind == "replay")
    assert len(staged) >= 2 and replays == len(decode), (len(staged), replays, len(decode))
    # the replayed steps' tables were never made on the device (the graph is sent their host half)
    first, last = lines["offload"][0], lines["offload"][-1]
    deferred = last["deferred_tables"] - first["deferred_tables"]
    made = last["materialized_tables"] - first["materialized_tables"]
    assert deferred >= len(decode) - 1 and made <= deferred - (len(decode) - 1), (deferred, made, len(decode))


@pytest.mark.parametrize("name", ["overlap", "flashinfer-overlap"])
def test_under_the_overlap_loop_staged_steps_replay_and_equal_eager(servers, name):
    """SGLang's overlap loop (``--kv-overlap-schedule on``) with decode graphs, on the Triton decode
    and on FlashInfer's (the stand-in; its replays planned while the last step's results wait):
    step k+1's boundary and admission run while step k's results wait (its uploads behind the
    in-flight replay on the forward stream; the step block's twins waited by events on a GPU).
    The outputs are the eager server's; every decode step replays but the layer timer's sampled
    ones (one in ``DEFAULT_EVERY``: the next replay would stamp a sampled replay's events before
    they are read, so they run eagerly, timed by their own -- on FlashInfer, on its eager
    wrappers), staged steps among the replays, and no step runs eagerly for any other reason."""
    from sglang_ext.layer_timing import DEFAULT_EVERY

    roots = servers["roots"]
    before = len(_stats(roots[name]))
    want, _ = _one_at_a_time(servers["eager"], roots["eager"])
    got, replayed = _one_at_a_time(servers[name], roots[name])
    assert _worst(got, want) <= LOGPROB_ATOL
    log = servers[name].log_path.read_text()
    reasons = set(re.findall(r"layered_decode_graph_eager\s+reason=.([^'\"]*)", log))
    assert reasons == {"a sampled step is timed eagerly (the overlap loop)"}, reasons  # the loop ran
    lines = _stats(roots[name])[before:]
    decode = [line for line in lines if line["new_tokens"] == line["batch_size"]]
    replays = sum(n for (kind, _), n in replayed.items() if kind == "replay")
    sampled = -(-len(decode) // DEFAULT_EVERY) + 1  # one in DEFAULT_EVERY decode steps, wherever the count starts
    assert len(decode) - sampled <= replays < len(decode), (replays, len(decode))
    assert sum(line["staging_pages"] > 0 for line in decode) >= 2
    with fault_armed(servers[name], roots[name] / "no-fetches"):  # control: replays copy nothing
        broken, _ = _one_at_a_time(servers[name], roots[name])
    assert _worst(broken, want) > 100 * LOGPROB_ATOL
    if name.startswith("flashinfer"):  # control: the replays' plans skipped, they read their capture's lengths
        with fault_armed(servers[name], roots[name] / "unplanned"):
            broken, _ = _one_at_a_time(servers[name], roots[name])
        assert _worst(broken, want) > 100 * LOGPROB_ATOL


def test_flashinfer_decode_replays_staged_steps_and_equals_eager(servers):
    """The layered FlashInfer backend under decode graphs, most KV on host: its CUDA-graph wrappers
    (one per captured size) planned before each replay from the admitted step's host CSR, each
    captured layer's run reading the graph buffers' row. The outputs are the eager Triton
    server's -- one prompt at a time (staged steps replayed: every decode step), the batch of three
    (the budget fits two of them: SGLang starts the third later; padding is the identity server's),
    and five prompts, more than the largest graph (eager FlashInfer steps) -- and
    the graphs were this backend's. Control: replays that skip their plan read the lengths their
    capture's plan wrote, and the outputs differ."""
    roots, server = servers["roots"], servers["flashinfer"]
    before = len(_stats(roots["flashinfer"]))
    one, _ = _one_at_a_time(servers["eager"], roots["eager"])
    got, replayed = _one_at_a_time(server, roots["flashinfer"])
    assert _worst(got, one) <= LOGPROB_ATOL
    decode = [line for line in _stats(roots["flashinfer"])[before:] if line["new_tokens"] == line["batch_size"]]
    replays = sum(n for (kind, _), n in replayed.items() if kind == "replay")
    assert replays == len(decode) and sum(line["staging_pages"] > 0 for line in decode) >= 2, (replays, len(decode))
    want, _ = _requests(servers["eager"], roots["eager"])
    got, replayed = _requests(server, roots["flashinfer"])
    assert _worst(got, want) <= LOGPROB_ATOL and sum(replayed.values()) >= NEW_TOKENS - 2, replayed
    five = list(PROMPTS[:5])
    assert _worst(_generate(server, five), _generate(servers["eager"], five)) <= LOGPROB_ATOL
    for name in ("eager", "flashinfer"):
        servers[name].flush_cache()
    log = server.log_path.read_text()
    assert re.search(r"layered_decode_graphs\s+backend=.?LayeredFlashInferDecode", log), log[-2000:]
    with fault_armed(server, roots["flashinfer"] / "unplanned"):
        broken, replayed = _one_at_a_time(server, roots["flashinfer"])
    assert sum(n for (kind, _), n in replayed.items() if kind == "replay") >= 1
    assert _worst(broken, one) > 100 * LOGPROB_ATOL


def test_staged_replays_without_their_fetches_are_caught(servers):
    """Negative control: the staged steps' graph lists emptied after they load -- the replays'
    fetches copy nothing, the staged layers read stale staging pages, and the comparison above fails."""
    roots = servers["roots"]
    want, _ = _one_at_a_time(servers["eager"], roots["eager"])
    server, root = servers["offload"], roots["offload"]
    with fault_armed(server, root / "no-fetches"):
        got, replayed = _one_at_a_time(server, root)
    assert sum(n for (kind, _), n in replayed.items() if kind == "replay") >= 1
    assert _worst(got, want) > 100 * LOGPROB_ATOL


def _decode_rows(lines: list[dict]) -> int:
    """Rows of the decode steps among ``lines``: one new token a request (a prefill writes at least
    two a request here: every prompt's uncached part is longer than one token)."""
    return sum(line["batch_size"] for line in lines if line["new_tokens"] == line["batch_size"])


def test_batched_steps_that_stage_pages_run_one_boundary_each(servers):
    """The same with the three requests batched (their step declined as one, padded to 4): SGLang
    may start them a step apart on the two servers, so the lines differ, but each request decodes
    one step per output token after its first on each: the decode rows the lines count are those
    tokens (a second boundary would count every declined step's rows twice)."""
    roots = servers["roots"]
    before = {name: len(_stats(roots[name])) for name in ("eager", "offload")}
    for name in before:
        servers[name].flush_cache()
    want, _ = _requests(servers["eager"], roots["eager"])
    got, _ = _requests(servers["offload"], roots["offload"])
    assert _worst(got, want) <= LOGPROB_ATOL
    rows = {name: _decode_rows(_stats(roots[name])[before[name]:]) for name in before}
    decoded = sum(len(out["output_ids"]) - 1 for out in want)  # the first token comes from the prefill
    assert rows["eager"] == decoded and rows["offload"] == rows["eager"], (rows, decoded)


def test_a_batch_larger_than_every_graph_runs_eagerly(servers):
    """Five requests: more rows than the largest graph (4), so SGLang itself declines the replay
    (kvplane's boundary then runs in the eager forward, once); the output is the eager server's."""
    prompts = list(PROMPTS[:5])
    want = _generate(servers["eager"], prompts)
    server, root = servers["identity"], servers["roots"]["identity"]
    before = _tape(root)
    got = _generate(server, prompts)
    server.flush_cache()
    assert _worst(got, want) <= LOGPROB_ATOL
    replayed = _tape(root) - before
    assert replayed[("replay", "4")] == 0, replayed  # as the batch shrinks at the end, smaller ones may


def test_recompute_steps_run_eagerly_with_one_boundary(servers):
    """eLLM's recompute (``custom_params.kvplane_recompute_ratio``): the step's prefix rows join the
    batch's inputs at kvplane's boundary, so a recompute step is declined before it (SGLang's eager
    copy of the batch then carries the rows) -- two requests in one batch, the eager server's output."""
    payload = {"text": BATCH[:2], "return_logprob": True,
               "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                   "custom_params": {"kvplane_recompute_ratio": 0.5}}}
    want = servers["eager"].post("/generate", payload)
    got = servers["offload"].post("/generate", payload)
    for server in (servers["eager"], servers["offload"]):
        server.flush_cache()
    assert _worst(got, want) <= LOGPROB_ATOL
    assert "reason='the step recomputes a prefix'" in servers["offload"].log_path.read_text()
