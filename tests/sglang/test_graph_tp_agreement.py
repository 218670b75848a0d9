"""Two real gloo ranks (one process each): :class:`~sglang_ext.graph_tp_agreement.GraphTpAgreement`'s
vote, :class:`~sglang_ext.testing.tape_graph.TapeGraph` replaying a captured all-reduce, and the
graph runner hook under TP when only rank 0 has a layer timer.

The served check is ``test_tp_graph_server.py`` (a TP=2 SGLang server whose ranks replay decode
graphs); this one pins the pieces it rests on, each with its control, in a few seconds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_ext.graph_tp_agreement import GraphTpAgreement
from sglang_ext.testing.tape_graph import TapeGraph

WORLD = 2
VOTES = [(True, True), (True, False), (False, True), (False, False), (True, True)]
"""Per step, each rank's own answer (rank 0, rank 1)."""


def _rank(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        agreement = GraphTpAgreement(dist.group.WORLD, WORLD)
        agreed = [agreement.all_admit(votes[rank]) for votes in VOTES]
        # a captured forward with a TP all-reduce between two ops; the replay reads new inputs
        x = torch.full((3,), float(rank + 1))
        y = torch.empty(3)

        def forward() -> torch.Tensor:
            torch.mul(x, 2.0, out=y)
            dist.all_reduce(y)  # (1 + 2) * 2 = 6 on both ranks
            return y + 1.0

        graph = TapeGraph()
        static = graph.capture(forward)
        x.fill_(float(10 * (rank + 1)))  # (10 + 20) * 2 + 1 = 61 after a replay
        graph.replay()
        replayed = static.tolist()
        # the control: the same tape without its collective gives this rank's own product
        graph.tape = [entry for entry in graph.tape if entry[0] != "collective"]
        graph.replay()
        torch.save({"agreed": agreed, "overruled": agreement.overruled, "votes": agreement.votes,
                    "replayed": replayed, "alone": static.tolist()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_every_rank_admits_only_when_all_do_and_a_captured_all_reduce_replays():
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.start_processes(_rank, args=(f"file://{tmp}/rendezvous", out), nprocs=WORLD, join=True, start_method="fork")
        got = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    want = [all(v) for v in VOTES]
    assert got[0]["agreed"] == got[1]["agreed"] == want  # any rank's "no" is every rank's
    assert want != [v[0] for v in VOTES] and want != [v[1] for v in VOTES]  # control: not one rank's own
    assert [g["overruled"] for g in got] == [1, 1] and got[0]["votes"] == len(VOTES)
    assert got[0]["replayed"] == got[1]["replayed"] == [61.0] * 3
    assert got[0]["alone"] == [21.0] * 3 and got[1]["alone"] == [41.0] * 3


def _hook_rank(rank: int, init: str, out: str, vote: bool) -> None:
    """A decode step through the graph runner hook on each rank; only rank 0 has a layer timer,
    and it samples this step under the overlap loop (its ``wants_eager``)."""
    from datetime import timedelta
    from types import SimpleNamespace

    from sglang_ext import graph_runner_hooks
    from sglang_ext.layer_timing import LayerTimer
    from sglang_ext.layered_decode_graph import LayeredDecodeGraph
    from tests.sglang.test_layered_decode_graph import LAYERS, _identity_core

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
    try:
        agreement = GraphTpAgreement(dist.group.WORLD, WORLD)
        graph = LayeredDecodeGraph(_identity_core(partial=False), max_bs=2, agreement=agreement)
        graph.capture(2)
        boundaries: list[object] = []
        backend = SimpleNamespace(graph=graph, recompute_inputs=None, init_forward_metadata=boundaries.append)
        if rank == 0:
            backend.layer_timer = LayerTimer(LAYERS, every=1, eager_samples=True)
            backend.layer_timer.begin(True)
        if not vote:  # the control: the timer's decline before the boundary, as on one GPU
            graph.agreement = None if rank == 0 else agreement
        runner = SimpleNamespace(attn_backend=backend, capture_bs=[1, 2], _pad_to_bucket=lambda bs, buckets: 2)
        decode = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True), batch_size=1,
                                 out_cache_loc=torch.tensor([6]), rids=["A"], seq_lens_cpu=torch.tensor([4]))
        try:
            got: object = graph_runner_hooks.around_can_run_graph(lambda runner, fb: True, runner, decode)
        except RuntimeError as exc:  # gloo: the peer never voted (it left, or the timeout)
            got = f"raised: {exc}"[:80]
        torch.save({"got": got, "boundaries": len(boundaries), "reasons": dict(graph.eager_reasons)},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("vote", [True, False], ids=["voted", "control-unvoted"])
def test_rank_0s_sampled_step_is_declined_through_the_vote(vote):
    """Under TP only rank 0 has the layer timer: its sampled step (the overlap loop's) is declined
    after the boundary, through the vote, so rank 1 runs the step eagerly too and neither waits
    for a vote the other never casts. Control: declined before the boundary, as without TP, rank
    1's vote is left unmatched (here it fails when rank 0 leaves the group; in a server rank 0's
    next collective, another's, would meet it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.start_processes(_hook_rank, args=(f"file://{tmp}/rendezvous", out, vote), nprocs=WORLD, join=True,
                           start_method="fork")
        got = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    if vote:
        assert [g["got"] for g in got] == [False, False] and [g["boundaries"] for g in got] == [1, 1]
        assert got[0]["reasons"] == {"a sampled step is timed eagerly (the overlap loop)": 1}
        assert got[1]["reasons"] == {"another TP rank runs this step eagerly": 1}
    else:
        assert got[0]["got"] is False and got[0]["boundaries"] == 0
        assert str(got[1]["got"]).startswith("raised"), got[1]


def test_an_agreement_needs_two_ranks():
    with pytest.raises(ValueError, match="two ranks"):
        GraphTpAgreement(None, 1)
