"""The layered pool's slot space beyond the device: SGLang's memory profile widened to ``--max-total-tokens``.

AROUND ``KVCacheConfigurator.config_from_budget`` (registered by :mod:`sglang_ext.plugin` under
``--enable-layered-kv``; the reasoning is :mod:`sglang_ext.device_capacity`'s). SGLang's own call
sizes the pool from the device bytes its profile found, capped by ``--max-total-tokens``. When that
cap is above what the profile fits, the hook sizes the pool again from a budget scaled up so that
the cap binds -- SGLang's own path, so page alignment, pipeline ranks' agreement and the request
count derived from it stay SGLang's -- and records the profiled figure for that configurator, whose pool class
resolver (AROUND ``KVCacheConfigurator._resolve_kv_pool_class``, called later in the same
``configure``) hands it to the layered pool. Both hooks are methods of one :class:`CapacityHooks`,
which the plugin registers (SGLang's configurator is a slotted dataclass: nothing can be set on it).

Left as SGLang sized them: a post-capture resize (``cap_tokens``; the layered pool refuses
post-capture backing), unified and hybrid (SWA) pools (their layouts are not the layered pool's,
and their models are refused at launch), and a ``--max-total-tokens`` the profile already fits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from sglang_ext import compat
from sglang_ext.device_capacity import DeviceCapacity

log = structlog.get_logger(__name__)


def wanted_tokens() -> int | None:
    """``--max-total-tokens`` as SGLang's runtime context holds it in this process (None: not given)."""
    value = compat.resolve(compat.SCHEDULE_CONTEXT.path)().max_total_tokens
    return None if value is None else int(value)


class CapacityHooks:
    """The two configurator hooks of a slot space beyond the device, and what the first told the
    second (module docstring)."""

    def __init__(self, wanted: Callable[[], int | None] = wanted_tokens) -> None:
        self.wanted = wanted
        """``--max-total-tokens`` of the process (SGLang's runtime context; tests pass their own)."""
        self.capacities: dict[int, DeviceCapacity] = {}
        """Widened configurators (by ``id``; a scheduler has one, a draft worker a second) ->
        the capacity their profile measured."""

    def capacity_of(self, configurator: Any) -> DeviceCapacity | None:
        """The :class:`DeviceCapacity` recorded for ``configurator`` (None: SGLang's sizing stands)."""
        return self.capacities.get(id(configurator))

    def around_resolve_kv_pool_class(self, original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
        """AROUND ``KVCacheConfigurator._resolve_kv_pool_class``: the layered pool for kind ``mha``,
        bound to the configurator's capacity when its slot space was widened."""
        if kwargs.get(compat.KV_POOL_CLASS_RESOLVER.keyword[0]) == "mha":
            from sglang_ext.layered_pool import LayeredTokenToKVPool

            return LayeredTokenToKVPool.for_capacity(self.capacity_of(configurator))
        return original(configurator, *args, **kwargs)

    def around_config_from_budget(self, original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
        """AROUND ``KVCacheConfigurator.config_from_budget(budget_bytes, *, cap_tokens=None)``:
        SGLang's config, widened to ``--max-total-tokens`` when that is above it."""
        config = original(configurator, *args, **kwargs)
        budget = args[0] if args else kwargs.get("budget_bytes")
        if kwargs.get("cap_tokens") is not None or len(args) > 1 or not isinstance(budget, int):
            return config
        if (config.unified_total_bytes is not None or config.full_max_total_num_tokens is not None
                or config.swa_max_total_num_tokens is not None):
            return config
        asked, profiled = self.wanted(), int(config.max_total_num_tokens)
        if asked is None or profiled >= asked:
            return config
        rest = {k: v for k, v in kwargs.items() if k != "budget_bytes"}
        # (budget * k - fixed) // cell >= k * profiled > asked: SGLang's cap then binds
        wide = original(configurator, budget * (-(-asked // profiled) + 1), **rest)
        slot_tokens = int(wide.max_total_num_tokens)
        if slot_tokens <= profiled:  # --max-total-tokens within the profile's last page
            return config
        self.capacities[id(configurator)] = DeviceCapacity(profiled_tokens=profiled, slot_tokens=slot_tokens)
        log.info("layered_kv_slot_space_beyond_device", slot_tokens=slot_tokens, device_tokens_all_layers=profiled,
                 note=("SGLang's warning that max_total_tokens is larger than the profiled value does not apply: "
                       "the layered pool keeps every layer of the slot space in host memory and the profiled "
                       "tokens' worth of layer-pages on the device"))
        return wide
