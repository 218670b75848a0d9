"""``victim_rule: lost-first`` (session 88; the default since session 89: the policy file below
leaves it unset, so this is the rule a server runs by default) in a real SGLang server: the pause server's
setting (``test_pause_server.py``: a device KV budget of 96 token-layers, a starvation guard after 6
paused steps) with the rule that pauses first the requests whose TPOT is provably lost and lets
the guard force a starving request in only by pausing those. The rule reads each request's
``max_new_tokens`` as the worker reports it. Requests are paused and resumed, every one finishes,
and the greedy outputs match vanilla SGLang's token for token. The TBT SLO (60 ms, against an
all-resident step the controller learns at 10-12 ms on the 2-core CPU host) makes requests that
wait paused provably lost: a probe of ``tpot_lost`` in this run (session 88) answered True 117
times of 974, so the rule's lost branch runs, not only its ``largest`` order."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.policy import Policy
from sglang_ext.settings import STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import PROMPTS, concurrent_as_vanilla, running_server

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lost_first_server(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, Path]]:
    root = tmp_path_factory.mktemp("lost-first")
    policy = root / "policy.json"
    policy.write_text(json.dumps({"max_paused_steps": 6, "window_min": 2, "window_max": 4, "slo_tbt_ms": 60.0}))
    assert Policy.from_dict(json.loads(policy.read_text())).victim_rule == "lost-first"  # the default
    stats = root / "stats.jsonl"
    flags = ["--enable-layered-kv", "--kv-policy", str(policy), "--kv-gpu-budget-tokens", "96",
             "--mem-fraction-static", "0.3"]
    with running_server(tiny_model_dir, root, flags, {STATS_FILE_ENV: str(stats)}, zygote=launch_zygote) as server:
        yield server, stats


def test_lost_first_pauses_resumes_and_matches_vanilla(lost_first_server, vanilla_server):
    server, stats_path = lost_first_server
    concurrent_as_vanilla(server, vanilla_server, PROMPTS, MAX_NEW_TOKENS)
    lines = read_jsonl(stats_path)
    paused = [rid for line in lines for rid in line.get("paused_now") or ()]
    resumed = {rid for line in lines for rid in line.get("resumed_now") or ()}
    finished = {rid for line in lines for rid in line["finished"]}
    assert len(paused) >= 5, f"expected pauses, stats show {len(paused)}"
    assert set(paused) <= resumed and set(paused) <= finished
    assert lines[-1]["paused"] == [] and not any(line["fallback"] for line in lines)
