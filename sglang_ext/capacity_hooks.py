"""The layered pool's slot space beyond the device: SGLang's memory profile widened to ``--max-total-tokens``.

AROUND ``KVCacheConfigurator.config_from_budget`` (registered by :mod:`sglang_ext.plugin` under
``--enable-layered-kv``; the reasoning is :mod:`sglang_ext.device_capacity`'s). SGLang's own call
sizes the pool from the device bytes its profile found, capped by ``--max-total-tokens``. When that
cap is above what the profile fits, the hook sizes the pool again from a budget scaled up so that
the cap binds -- SGLang's own path, so page alignment and pipeline ranks' agreement stay SGLang's
-- and records the profiled figure for that configurator, whose pool class
resolver (AROUND ``KVCacheConfigurator._resolve_kv_pool_class``, called later in the same
``configure``) hands it to the layered pool. The hooks are methods of one :class:`CapacityHooks`,
which the plugin registers (SGLang's configurator is a slotted dataclass: nothing can be set on it).
A third, AROUND ``resolve_max_num_reqs``, keeps SGLang's request count (and the device's request
table it sizes) at the profile's, unless ``--max-running-requests`` is given.

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


def wanted_requests() -> int | None:
    """``--max-running-requests`` as SGLang's runtime context holds it (None: not given)."""
    value = compat.resolve(compat.SCHEDULE_CONTEXT.path)().max_running_requests
    return None if value is None else int(value)


class CapacityHooks:
    """The configurator hooks of a slot space beyond the device, and what the sizing hook told
    the others (module docstring)."""

    def __init__(self, wanted: Callable[[], int | None] = wanted_tokens,
                 requests: Callable[[], int | None] = wanted_requests) -> None:
        self.wanted = wanted
        """``--max-total-tokens`` of the process (SGLang's runtime context; tests pass their own)."""
        self.requests = requests
        """``--max-running-requests`` of the process (likewise)."""
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
        self.capacities.pop(id(configurator), None)  # a new profile: an earlier object's id may be reused
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

    def around_resolve_max_num_reqs(self, original: Any, configurator: Any, token_capacity: Any, *args: Any,
                                    **kwargs: Any) -> Any:
        """AROUND ``KVCacheConfigurator.resolve_max_num_reqs(token_capacity)``: for a widened slot
        space without ``--max-running-requests``, SGLang's request count for the *profiled* tokens.
        Its estimate grows with the pool (``capacity / context_len x 512``, in [2048, 4096]), and
        the request table it sizes (``[requests + 1, context_len + 4]`` int32, 1.07 GB at 2048 x
        128k) is on the device, outside the profile: widening would double it into SGLang's slack.
        Given explicitly, the user's count stands (SGLang still caps it at half the tokens)."""
        capacity = self.capacity_of(configurator)
        if capacity is not None and token_capacity == capacity.slot_tokens and self.requests() is None:
            token_capacity = capacity.profiled_tokens
        return original(configurator, token_capacity, *args, **kwargs)
