"""Priority scheduling (``--enable-priority-scheduling``, preemption on) with kvplane pausing.

SGLang makes room for a higher-priority arrival by preempting running requests of a lower
priority (their KV freed, prefilled again later). Parked requests were out of its reach: it
preempted running requests of a higher priority than parked ones, or refused the arrival
(scheduler audit, session 82). The reserving prefill adder now merges back first the parked
requests SGLang's own choice (a dry run on a copy) takes (``parked_lifecycle._preempting``; ``test_parked_inflight.py`` runs SGLang's
``preempt_to_schedule`` with and without it).

Stock SGLang (``--disable-overlap-schedule``) and the layered server forced to pause (the pause
server's flags) start side by side with priority scheduling and 4 request rows; priority-0
requests are sent, then priority-100 ones while they decode (past SGLang's preemption threshold, 10). The layered server resumes parked
requests for SGLang's preemption, stays up, and every output matches stock's (greedy tokens and
logprobs: a preempted request prefills again to the same tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import PROMPTS, assert_same_generation, running_servers
from tests.sglang.test_pause_server import pause_flags

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # two server start-ups on a loaded host

NEW_TOKENS = {0: 160, 100: 24}
"""Per priority: the low ones still decode when the high ones arrive."""
COMMON = ["--enable-priority-scheduling", "--max-running-requests", "4", "--disable-overlap-schedule"]


@pytest.fixture(scope="module")
def priority_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, SGLangServer]]:
    root = tmp_path_factory.mktemp("priority")
    (root / "stock").mkdir()
    (root / "layered").mkdir()
    specs = [(root / "stock", COMMON, None), (root / "layered", [*COMMON, *pause_flags(root / "layered")], None)]
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as servers:
        yield servers


def _generate(server: SGLangServer, prompt: str, priority: int, delay_s: float) -> dict:
    time.sleep(delay_s)
    return server.post("/generate", {
        "text": prompt, "priority": priority, "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS[priority], "temperature": 0.0, "ignore_eos": True}}, timeout_s=600.0)


def _waves(server: SGLangServer, jobs: list[tuple[str, int, float]]) -> list[dict]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: _generate(server, *job), jobs))


def test_parked_requests_join_sglangs_priority_preemption_and_outputs_match_stock(priority_servers):
    stock, layered = priority_servers
    jobs = [(prompt, 0, 0.0) for prompt in PROMPTS[:6]] + [(prompt, 100, 0.5) for prompt in PROMPTS[6:12]]
    with ThreadPoolExecutor(2) as pool:
        want, got = pool.map(lambda server: _waves(server, jobs), (stock, layered))
    log = layered.log_path.read_text()
    assert "requests_paused" in log, "no pause: the scenario did not happen"
    assert "paused_requests_resumed_for_preemption" in log, "no parked request reached SGLang's preemption"
    for (prompt, priority, _), g, w in zip(jobs, got, want, strict=True):
        assert_same_generation(g, w, f"priority {priority}: {prompt[:40]}")
