"""The test-only injector's one-rank graph decline (``KVPLANE_TEST_GRAPH_DECLINE_FILE``, loaded by
this directory's ``sitecustomize``): while the flag file exists, the graph buffers of the process
of ``torch.distributed`` rank ``KVPLANE_TEST_GRAPH_DECLINE_RANK`` (default 1) refuse every step
(``GraphStepBuffers.why_not``), as a rank whose own state kept a step from its graph would: the TP
graph server's check that its other ranks then run the step eagerly too
(:class:`sglang_ext.graph_tp_agreement.GraphTpAgreement`)."""

from __future__ import annotations

import os

TARGET = "sglang_ext.layered_decode_graph"
REASON = "declined on this rank by the test injector"


def patch(module) -> None:  # noqa: ANN001
    """The module's ``GraphStepBuffers`` (looked up when a graph state is built) refuses while the
    flag exists, on the chosen rank only."""
    flag = os.environ["KVPLANE_TEST_GRAPH_DECLINE_FILE"]
    rank = int(os.environ.get("KVPLANE_TEST_GRAPH_DECLINE_RANK", "1"))
    from kvplane_rank import this_rank

    class DecliningBuffers(module.GraphStepBuffers):
        def why_not(self, tables, padded_to=None):  # noqa: ANN001, ANN202
            if os.path.exists(flag) and this_rank() == rank:
                return REASON
            return super().why_not(tables, padded_to)

    module.GraphStepBuffers = DecliningBuffers
