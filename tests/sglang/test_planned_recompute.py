"""The control plane's recompute reaches the served path (issue 16, docs/recompute.md "Served core").

Scenario: a worker whose ``--kv-profile`` file carries ``recompute_ms_per_token`` opens a session
with the real embedded controller (policy ``max_recompute_ratio = 0.5``); a 700-token request
does not fit the 2304 layer-page budget of a 4-layer model, so the planner leaves a prefix
uncached and recomputes it. The decision goes through the real boundary
(:class:`DecisionInbox` -> :class:`StepBoundary` -> :class:`StepInstall` -> :class:`PlacementInstaller`)
into :class:`RecomputeRequests` and the real layered pool (CPU, toy sizes): the installer's
uncached prefix, the attention backend's recompute inputs (a stand-in object that only receives
them: the forward itself runs in ``test_recompute_server.py``) and the pool's device pages follow
the plan. A request's own ``custom_params`` ratio wins over the plan.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from controlplane.api import RequestState, StepReport  # noqa: E402
from controlplane.embedded import EmbeddedControlPlane  # noqa: E402
from controlplane.policy import Policy  # noqa: E402
from controlplane.policy_store import PolicyStore  # noqa: E402
from controlplane.service.convert import worker_info_from_proto, worker_info_to_proto  # noqa: E402
from sglang_ext.admission import AdmissionGate  # noqa: E402
from sglang_ext.args import LayeredKVArgs  # noqa: E402
from sglang_ext.decision_inbox import DecisionInbox  # noqa: E402
from sglang_ext.pause import PauseManager  # noqa: E402
from sglang_ext.recompute_requests import RecomputeRequests  # noqa: E402
from sglang_ext.step_boundary import StepBoundary  # noqa: E402
from sglang_ext.tp_sync import PlacementInstaller, TpSync  # noqa: E402
from sglang_ext.worker_info import build_worker_info  # noqa: E402

pytestmark = pytest.mark.sglang

LAYERS, HEADS, DIM, BUDGET, SLOTS = 4, 2, 16, 2304, 1024
RMS = 1e-4
PROFILE = {
    "device": "CPU: test", "layers": LAYERS, "block_size": 1, "block_bytes": 256,
    "h2d_gbps": 1e-3, "d2h_gbps": 1e-3, "layer_compute_ms": {"fixed_ms": 1.0, "per_token_ms": 0.0},
    "recompute_ms_per_token": RMS,
}
"""A slow link and a cheap recompute: memory pressure is relieved by recomputing, not fetching."""
LONG, SHORT = 700, 20
SOLVE_MS = 2000.0
"""The planner's budget per call: recompute is searched in the time the layout search leaves,
so a fixed generous budget makes the plans independent of the host's load (they finish exact in
~2 ms here)."""


def worker(tmp_path: Path, can_recompute: bool = True, **changes: object):  # noqa: ANN201
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**PROFILE, **changes}))
    args = LayeredKVArgs(enable_layered_kv=True, kv_profile=str(path))
    return build_worker_info(worker_id="w", layers=LAYERS, block_size=1, block_bytes=256,
                             gpu_kv_budget_blocks=BUDGET, args=args, can_recompute=can_recompute)


def decisions_for(info, contexts: dict[str, int], ratio: float = 0.5) -> list:  # noqa: ANN001
    """The real embedded controller's decisions for these running requests (id -> context)."""
    cp = EmbeddedControlPlane(PolicyStore(Policy(max_recompute_ratio=ratio)), synchronous=True,
                              time_budget_ms=SOLVE_MS)
    try:
        session = cp.open_session(info)
        running = tuple(RequestState(id=rid, context_tokens=n, generated_tokens=1) for rid, n in contexts.items())
        return session.report(StepReport(step=1, now_ms=1.0, running=running, observed_step_ms=4.0))
    finally:
        cp.close()


def make_pool():  # noqa: ANN201
    from sglang_ext.layered_pool import LayeredTokenToKVPool

    return LayeredTokenToKVPool(
        size=SLOTS, page_size=1, dtype=torch.float32, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False,
        layered_args=LayeredKVArgs(enable_layered_kv=True, kv_gpu_budget_tokens=BUDGET),
    )


def request(rid: str, prompt: int, start: int, output: int = 1, custom: dict | None = None) -> SimpleNamespace:
    """A decoding request: ``prompt`` prompt tokens, ``output`` generated, its slots from ``start``."""
    return SimpleNamespace(
        rid=rid, origin_input_ids=[(start + i) % 500 for i in range(prompt)], output_ids=[7] * output,
        sampling_params=SimpleNamespace(custom_params=custom), finished=lambda: False,
        slots=tuple(range(start, start + prompt + output)),
    )


class Worker:
    """The served path's per-scheduler parts, wired as the scheduler hooks wire them (rank 0)."""

    def __init__(self, pool=None) -> None:  # noqa: ANN001
        self.pool = pool if pool is not None else make_pool()
        self.installer = PlacementInstaller(self.pool, LAYERS)
        self.inbox = DecisionInbox()
        self.boundary = StepBoundary(
            tp=TpSync(0, 1), installer=self.installer, pauser=PauseManager(), admission=AdmissionGate(enabled=False),
            inbox=self.inbox, client=None, pages_of=lambda req: req.slots,
        )
        self.backend = SimpleNamespace(recompute_inputs={}, recompute_ok=True)
        self.recompute = RecomputeRequests(layers=LAYERS, page_size=1, installer=self.installer, backend=self.backend)
        self.step = 0

    def run_step(self, reqs: list, decisions: list | None = None) -> None:
        """One boundary: install what was received, build the decode batch, install the wants."""
        self.inbox.receive(decisions or [])
        batch = SimpleNamespace(reqs=reqs, is_empty=lambda: not reqs,
                                forward_mode=SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False))
        self.boundary.apply(batch, None, self.step)
        plan = SimpleNamespace(running_batch=batch, batch_to_run=batch)
        self.recompute.prepare(plan)
        self.boundary.after_schedule(plan, self.step)
        self.step += 1


def test_profile_recompute_cost_reaches_the_controller(tmp_path: Path) -> None:
    """The file's recompute_ms_per_token is the worker's per-layer figure, in the embedded and the
    gRPC hello alike; absent from the file, or on a worker that cannot recompute, it is absent."""
    info = worker(tmp_path)
    assert info.profile.recompute_ms_per_token == (RMS,) * LAYERS
    assert worker_info_from_proto(worker_info_to_proto(info)).profile == info.profile
    # negative controls: no figure in the file, or a worker that cannot serve recompute
    without = {k: v for k, v in PROFILE.items() if k != "recompute_ms_per_token"}
    (tmp_path / "p2.json").write_text(json.dumps(without))
    args = LayeredKVArgs(enable_layered_kv=True, kv_profile=str(tmp_path / "p2.json"))
    assert build_worker_info(worker_id="w", layers=LAYERS, block_size=1, block_bytes=256, gpu_kv_budget_blocks=BUDGET,
                             args=args, can_recompute=True).profile.recompute_ms_per_token is None
    assert worker(tmp_path, can_recompute=False).profile.recompute_ms_per_token is None
    assert worker_info_from_proto(worker_info_to_proto(worker(tmp_path, False))).profile.recompute_ms_per_token is None


def test_controller_offers_recompute_only_with_the_profile_figure(tmp_path: Path) -> None:
    """Under memory pressure the controller plans an uncached prefix when the worker reports its
    recompute cost; without the figure (or with the policy's ratio at 0) it never does."""
    plan = decisions_for(worker(tmp_path), {"a": LONG})[-1].plan
    assert plan.recompute_blocks and set(plan.recompute_blocks) == {"a"}
    assert 0 < plan.recompute_blocks["a"] <= (LONG + 1 + plan.window_steps) // 2  # sized at the window's end
    assert plan.transient_blocks == (plan.recompute_blocks["a"] if plan.recompute_layers["a"] else 0)
    assert not decisions_for(worker(tmp_path, can_recompute=False), {"a": LONG})[-1].plan.recompute_blocks
    assert not decisions_for(worker(tmp_path), {"a": LONG}, ratio=0.0)[-1].plan.recompute_blocks


def test_planned_recompute_reaches_the_installer_the_pool_and_the_forward_inputs(tmp_path: Path) -> None:
    """The plan's (u, k) become the installer's uncached prefix, the pool's wants (u pages in no
    device layer) and the backend's recompute inputs (u, k, the prefix's token ids); a request the
    plan leaves out recomputes nothing; the next plan without recompute undoes it."""
    a, b = request("a", LONG - 1, 0), request("b", SHORT - 1, LONG)
    plan = decisions_for(worker(tmp_path), {"a": LONG, "b": SHORT})
    u, k = plan[-1].plan.recompute_blocks["a"], plan[-1].plan.recompute_layers["a"]
    w = Worker()
    w.run_step([a, b], plan)
    assert w.installer.planned_recompute == {"a": (u, k)}
    assert w.installer.uncached == {"a": u}
    assert set(w.backend.recompute_inputs) == {"a"}  # b: not in the plan's recompute
    got_u, got_k, ids = w.backend.recompute_inputs["a"]
    assert (got_u, got_k) == (u, k) and ids.tolist() == a.origin_input_ids[:u]
    assert w.installer.last_wants["a"].uncached_pages == u
    assert w.installer.last_wants["b"].uncached_pages == 0
    used = w.pool.residency_stats().device_pages_used
    rows = {rid: plan[-1].plan.placements[rid] for rid in ("a", "b")}
    assert used == (LONG - u) * sum(rows["a"]) + SHORT * sum(rows["b"])
    # negative control: the wants without the uncached prefix would hold u more pages per layer
    assert used != LONG * sum(rows["a"]) + SHORT * sum(rows["b"])
    # a new plan without recompute (the request shrank in the controller's eyes): undone
    w.run_step([a, b], decisions_for(worker(tmp_path), {"a": SHORT, "b": SHORT}))
    assert w.installer.planned_recompute == {} and w.installer.uncached == {}
    assert w.backend.recompute_inputs == {}
    assert w.installer.last_wants["a"].uncached_pages == 0


@pytest.mark.parametrize(("ratio", "want_u"), [(0.2, int(0.2 * (LONG - 1))), (0.0, 0)])
def test_a_forced_ratio_wins_over_the_plan(tmp_path: Path, ratio: float, want_u: int) -> None:
    """custom_params.kvplane_recompute_ratio (0 included: forced to recompute nothing) overrides
    the plan's u for its request; a request without it next to it takes the plan."""
    forced = request("a", LONG - 1, 0, custom={"kvplane_recompute_ratio": ratio})
    free = request("c", LONG - 1, 0)  # the same length, no override: planned
    plan = decisions_for(worker(tmp_path), {"a": LONG})
    planned_u = plan[-1].plan.recompute_blocks["a"]
    assert planned_u != want_u  # else the check below could not tell them apart
    w = Worker()
    w.run_step([forced], plan)
    assert w.installer.uncached.get("a", 0) == want_u
    if want_u:
        assert w.backend.recompute_inputs["a"][0] == want_u
    else:
        assert "a" not in w.backend.recompute_inputs
    # negative control: the same request without the override takes the plan's u
    w2 = Worker()
    w2.run_step([free], [_renamed(plan[-1], "a", "c")])
    assert w2.installer.uncached == {"c": planned_u}


def _renamed(decision, old: str, new: str):  # noqa: ANN001, ANN202
    """The decision with request ``old`` called ``new``."""
    import dataclasses

    p = decision.plan
    plan = dataclasses.replace(
        p, placements={new if r == old else r: v for r, v in p.placements.items()},
        recompute_blocks={new if r == old else r: v for r, v in p.recompute_blocks.items()},
        recompute_layers={new if r == old else r: v for r, v in p.recompute_layers.items()},
    )
    return dataclasses.replace(decision, plan=plan)


def test_planned_prefix_is_clamped_to_the_request_and_reaches_into_its_output(tmp_path: Path) -> None:
    """The plan sizes u at its window's end: each step u is clamped to the request's pages - 1,
    and a prefix longer than the prompt takes its ids from the generated tokens."""
    decision = decisions_for(worker(tmp_path), {"a": LONG})[-1]
    u = decision.plan.recompute_blocks["a"]
    short = request("a", 10, 0, output=6)  # 16 tokens: u is at most 15
    w = Worker()
    w.run_step([short], [decision])
    got_u, _, ids = w.backend.recompute_inputs["a"]
    assert got_u == 15 < u
    assert ids.tolist() == (short.origin_input_ids + short.output_ids)[:15]
    short.output_ids.append(9)  # one more token decoded: one more page may be left uncached
    short.slots = short.slots + (short.slots[-1] + 1,)
    w.run_step([short])
    got_u, _, ids = w.backend.recompute_inputs["a"]
    assert got_u == 16 and ids.tolist() == (short.origin_input_ids + short.output_ids)[:16]
    assert w.installer.uncached == {"a": 16} and w.installer.last_wants["a"].uncached_pages == 16


def test_a_pool_without_a_host_tier_recomputes_nothing(tmp_path: Path) -> None:
    """No budget (the identity layout: every layer of the slot space on the device, no host
    pool): the plan's recompute and a request's forced ratio reach neither the installer nor the
    forward, the worker reports it cannot recompute, and every page stays on the device in every
    layer. Control: the budget pool takes the same plan (the test above)."""
    from sglang_ext.layered_pool import LayeredTokenToKVPool

    pool = LayeredTokenToKVPool(size=SLOTS, page_size=1, dtype=torch.float32, head_num=HEADS, head_dim=DIM,
                                layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                layered_args=LayeredKVArgs(enable_layered_kv=True))
    assert not pool.store.host_tier
    a, b = request("a", LONG - 1, 0), request("b", SHORT - 1, LONG, custom={"kvplane_recompute_ratio": 0.5})
    plan = decisions_for(worker(tmp_path), {"a": LONG, "b": SHORT})
    assert plan[-1].plan.recompute_blocks  # the same plan recomputes on the budget pool
    w = Worker(pool)
    assert not w.recompute.enabled and not w.recompute.plannable
    w.run_step([a, b], plan)
    assert w.backend.recompute_inputs == {} and w.installer.uncached == {}
    assert pool.residency_stats().device_pages_used == (LONG + SHORT) * LAYERS
    control = Worker()
    assert control.recompute.enabled and control.recompute.plannable
