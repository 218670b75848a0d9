"""Layered KV data plane: per-request, per-layer KV residency, transfers and attention.

Exports are resolved lazily (PEP 562) so that ``sglang_ext.dataplane.profile_schema`` can be
imported without torch (the launcher's argument check validates ``--kv-profile`` files through it).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LayeredKVCore": "sglang_ext.dataplane.layered_kv_core",
    "SlotStoreConfig": "sglang_ext.dataplane.slot_store_config",
    "StepTables": "sglang_ext.dataplane.step_tables",
    "LayerView": "sglang_ext.dataplane.results",
    "torch_layered_attention": "sglang_ext.dataplane.attention",
    "dense_attention": "sglang_ext.dataplane.attention",
    "DeviceProfile": "sglang_ext.dataplane.profile_schema",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
