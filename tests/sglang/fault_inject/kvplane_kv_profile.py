"""The test-only injector's small device (``KVPLANE_TEST_KV_PROFILE_BYTES=N``, loaded by this
directory's ``sitecustomize``): SGLang's memory profile finds at most N bytes for the KV cache."""

from __future__ import annotations

import os

TARGET = "sglang.srt.mem_cache.kv_cache_configurator"


def patch(module) -> None:  # noqa: ANN001
    """``KVCacheConfigurator._profile_available_bytes`` capped at N bytes."""
    cap = int(os.environ["KVPLANE_TEST_KV_PROFILE_BYTES"])
    real = module.KVCacheConfigurator._profile_available_bytes

    def profile(self, pre_model_load_memory):  # noqa: ANN001, ANN202
        return min(real(self, pre_model_load_memory), cap)

    module.KVCacheConfigurator._profile_available_bytes = profile
