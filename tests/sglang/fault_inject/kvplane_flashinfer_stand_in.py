"""The test-only injector's FlashInfer on the CPU (``KVPLANE_TEST_FLASHINFER_STAND_IN``, loaded by
this directory's ``sitecustomize``): SGLang's ``triton`` attention backend is built as the
layered FlashInfer backend (``LayeredFlashInferDecode``) over
:class:`~sglang_ext.testing.flashinfer_stand_in.FlashInferStandIn` -- FlashInfer's decode
wrapper's behaviour, computing real attention -- so the backend's eager decode and its decode
graph hooks serve real requests here. While ``KVPLANE_TEST_UNPLANNED_REPLAY_FILE`` exists, graph
wrappers skip their plans after the capture's: each replay reads the lengths its capture's plan
wrote (the graph test's negative control)."""

from __future__ import annotations

import os

TARGET = "sglang_ext.layered_attention"


def patch(module) -> None:  # noqa: ANN001
    """The module's ``triton`` factory (looked up when the plugin swaps SGLang's backends)."""
    flag = os.environ.get("KVPLANE_TEST_UNPLANNED_REPLAY_FILE", "")

    def create_layered_triton_backend(runner):  # noqa: ANN001, ANN202
        from sglang_ext.layered_flashinfer_decode import LayeredFlashInferDecode
        from sglang_ext.testing.flashinfer_stand_in import FlashInferStandIn

        class Wrapper(FlashInferStandIn):
            def plan(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                if self.graph and self.plans and flag and os.path.exists(flag):
                    return None  # the replay reads the last plan's lengths
                return super().plan(*args, **kwargs)

        return LayeredFlashInferDecode(runner, wrapper_class=Wrapper)

    module.create_layered_triton_backend = create_layered_triton_backend
