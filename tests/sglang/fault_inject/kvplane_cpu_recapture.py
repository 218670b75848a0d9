"""The test-only injector's decode graph recapture on a CPU (``KVPLANE_TEST_CPU_RECAPTURE``, loaded
by this directory's ``sitecustomize``): SGLang's ``update_weights_from_disk`` recaptures its decode
graphs after the update when asked (``recapture_cuda_graph``) on CUDA only (or an out-of-tree
platform that captures); here, where the test injector's tape graphs capture on the CPU, it calls
the same ``recapture_cuda_graph`` after a successful update, as on a GPU."""

from __future__ import annotations

TARGET = "sglang.srt.model_executor.model_runner_components.weight_updater"


def patch(module) -> None:  # noqa: ANN001
    real = module.WeightUpdater.update_weights_from_disk

    def update_weights_from_disk(self, *args, recapture_cuda_graph: bool = False, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        ok, message = real(self, *args, recapture_cuda_graph=recapture_cuda_graph, **kwargs)
        if ok and recapture_cuda_graph and self.device == "cpu":
            from sglang.srt.runtime_context import get_flags

            get_flags().capture.enable_torch_compile = True  # as sitecustomize's capture_decode_graph patch
            self.recapture_cuda_graph()  # (model_runner calls its own import of that function)
        return ok, message

    module.WeightUpdater.update_weights_from_disk = update_weights_from_disk
