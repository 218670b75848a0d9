"""GraphTpAgreement: under ``--kv-cuda-graphs on`` with ``--tp-size > 1``, every TP rank replays a
decode step's graph or none does.

Each TP rank runs its own layered pool, boundary and graph admission
(:meth:`~sglang_ext.layered_decode_graph.LayeredDecodeGraph.admit`) over its shard of the KV
heads. The install they act on is one (rank 0's, broadcast: :class:`~sglang_ext.tp_sync.TpSync`),
so their admissions agree by construction -- but a disagreement would not fail loudly: a rank
replaying its graph while another runs the step eagerly pairs a graph's all-reduce with an eager
one, and SGLang's custom all-reduce reads its peers' buffers at addresses registered for the mode
each was captured in (graph or eager): wrong sums, or a hang. So after the boundary each rank's
answer is reduced over the TP group's CPU (gloo) group, one ``MAX`` of one int32 a decode step
that SGLang would replay: any rank that runs the step eagerly makes all of them do so.

The ranks reach the reduce in the same order as every other collective of the step: SGLang asks
``can_run_graph`` of every rank for the same batch (its own answer is the batch's), the declines
kvplane makes before its boundary (not a decode step, a recomputing step) read what every rank
holds alike, rank 0's own (its layer timer's sampled step under the overlap loop) goes through the
vote (:mod:`sglang_ext.graph_runner_hooks`), and the install's broadcast comes before the forward.
Cost: one gloo all-reduce a replayable step, on the host (no device sync; 0.56-0.60 ms wall
between two processes on the 2-core CI host, ``docs/cuda-graphs.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_ext import compat


class GraphTpAgreement:
    """One vote a step over the TP group's CPU group ``group`` of ``world_size`` ranks (module docstring)."""

    def __init__(self, group: Any, world_size: int) -> None:
        if world_size < 2:
            raise ValueError(f"world_size={world_size}: an agreement needs two ranks or more")
        self.group = group
        self.world_size = world_size
        self._vote = torch.zeros(1, dtype=torch.int32)
        """The reduced flag (1: some rank runs the step eagerly); a host tensor, gloo's."""
        self._read = self._vote.numpy()
        self.votes = 0
        self.overruled = 0
        """Steps this rank would have replayed that another rank ran eagerly."""

    @classmethod
    def for_process(cls) -> GraphTpAgreement | None:
        """This process's TP group (SGLang's ``get_tp_group()``), or None without TP."""
        tp = compat.resolve(compat.TP_GROUP.path)()
        if int(tp.world_size) < 2:
            return None
        return cls(tp.cpu_group, int(tp.world_size))

    def all_admit(self, ok: bool) -> bool:
        """Whether every rank admits the step (this one's answer ``ok``); a collective: every
        rank of the group calls it once per replayable step, in the same order."""
        self._vote[0] = 0 if ok else 1
        torch.distributed.all_reduce(self._vote, op=torch.distributed.ReduceOp.MAX, group=self.group)
        self.votes += 1
        agreed = not int(self._read[0])
        self.overruled += ok and not agreed
        return agreed
