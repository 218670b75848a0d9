"""SGLang's KV memory sizing, as the layered pool widens it (:mod:`sglang_ext.capacity_hooks`).

Part of :mod:`sglang_ext.compat.surface` (imported there, so in its ``TARGETS``). SGLang sizes the
KV slot space from its device memory profile and caps it by ``--max-total-tokens``; the layered
pool, which keeps every layer of every slot in host memory, honours a cap above the profile.
"""

from __future__ import annotations

from sglang_ext.compat.target import Target

__all__ = ["KV_CONFIG_FROM_BUDGET", "KV_RESOLVE_MAX_NUM_REQS", "MEMORY_POOL_CONFIG", "SCHEDULE_CONTEXT",
           "SCHEDULE_FIELDS"]

KV_CONFIG_FROM_BUDGET = Target(
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget",
    params=("self", "budget_bytes"), keyword=("cap_tokens",), used_by=("capacity_hooks", "plugin"))
"""Device KV bytes -> the pool's token count (``MemoryPoolConfig``), capped by ``--max-total-tokens``
and page-aligned; called once at start (and by the post-capture resize, with ``cap_tokens``)."""
MEMORY_POOL_CONFIG = Target(
    "sglang.srt.model_executor.pool_configurator.MemoryPoolConfig",
    attrs=("max_total_num_tokens", "full_max_total_num_tokens", "swa_max_total_num_tokens", "unified_total_bytes"),
    used_by=("capacity_hooks",))
SCHEDULE_CONTEXT = Target("sglang.srt.runtime_context.get_schedule", used_by=("capacity_hooks",))
"""The process's scheduling arguments (a ``Schedule`` bag: ``max_total_tokens``)."""
KV_RESOLVE_MAX_NUM_REQS = Target(
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.resolve_max_num_reqs",
    params=("self", "token_capacity"), used_by=("capacity_hooks", "plugin"))
"""The request count (and so the device's ``[requests, context]`` request table) from the pool's
token count, unless ``--max-running-requests`` is given."""
SCHEDULE_FIELDS = Target("sglang.srt.arg_groups.fields.schedule.Schedule",
                         attrs=("max_total_tokens", "max_running_requests"), used_by=("capacity_hooks",))
