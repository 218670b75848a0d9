"""The scheduler's AFTER hooks on SGLang's KV allocation (flag on; installed by
``sglang_ext.plugin``): ``mem_cache.allocation.alloc_for_extend`` / ``alloc_for_decode`` hand the
new KV slots to the :class:`~sglang_ext.radix_cache.LayeredRadixCache`, which attributes them to
their requests for the residency hooks. A batch over another tree cache is left alone."""

from __future__ import annotations

from typing import Any

from sglang_ext import compat


def _layered_tree_cache(batch: Any) -> Any:
    from sglang_ext.radix_cache import LayeredRadixCache

    cache = getattr(batch, "tree_cache", None)
    return cache if isinstance(cache, LayeredRadixCache) else None


def after_alloc_for_extend(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    cache = _layered_tree_cache(batch)
    if cache is not None:
        cache.on_alloc_extend(batch, result[0])
    return None


def after_alloc_for_decode(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    cache = _layered_tree_cache(batch)
    if cache is not None:
        token_per_req = kwargs.get(compat.ALLOC_FOR_DECODE.args[1], args[0] if args else 1)
        cache.on_alloc_decode(batch, result, token_per_req)
    return None
