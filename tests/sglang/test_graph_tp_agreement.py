"""Two real gloo ranks (one process each): :class:`~sglang_ext.graph_tp_agreement.GraphTpAgreement`'s
vote, and :class:`~sglang_ext.testing.tape_graph.TapeGraph` replaying a captured all-reduce.

The served check is ``test_tp_graph_server.py`` (a TP=2 SGLang server whose ranks replay decode
graphs); this one pins the two pieces it rests on, each with its control, in ~5 s.
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


def test_an_agreement_needs_two_ranks():
    with pytest.raises(ValueError, match="two ranks"):
        GraphTpAgreement(None, 1)
