"""``HostPoolFloor``: the smallest host KV pool a launch can run with, known before any process starts.

Where the slot space does not fit the device (``--max-total-tokens`` above SGLang's memory
profile, or a ``--kv-gpu-budget-tokens`` below every layer of it) the layered pool keeps every
layer of every KV page in host memory (``LayeredTokenToKVPool``: ``logical_pages = ceil((size +
page_size) / page_size)``, one padding page included, times the layers, times K and V of every KV
head), and refuses at start-up when ``--kv-host-pool-gb`` cannot hold that -- inside the
scheduler, after the model is loaded. Where all of the slot space is on the device (the identity
layout) no host pool is pinned, but the launcher cannot tell the two apart before SGLang profiles
memory, so the floor assumes the first. The launcher already knows the model's KV shape
(SGLang's ``ModelConfig``: layers, KV heads per TP rank, head dim, dtype), the page size when
given and ``--max-total-tokens``, the most tokens SGLang sizes the pool to. So it refuses a cap
below:

* with ``--max-total-tokens T``: every layer of ``T // page + 1`` pages (what the pool holds when
  SGLang's memory profile allows T tokens, the usual case; the scheduler checks the size it
  actually chose again);
* without it: every layer of 2 pages (one page and the padding page), the least any pool holds;
  the exact need is then known only once SGLang has profiled memory (the scheduler's check).

A refusal names the ``--kv-gpu-budget-tokens`` that holds every layer of ``--max-total-tokens``
(:meth:`HostPoolFloor.identity_hint`): with it the launcher knows the identity layout, and the
scheduler refuses it where the device cannot hold it. On ``--device cpu`` the device pool is host
memory too, so the launcher names it only where every layer fits this host's memory; elsewhere
the refusal says that no budget helps.

The page size defaults to 1 when not given (SGLang's default; a larger page only adds padding,
so the floor stays a lower bound). Bytes per value: 2 with ``--kv-cache-dtype bf16``, else the
model dtype SGLang resolved (quantized KV caches are refused before this runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_ext import compat
from sglang_ext.args import MAX_HOST_POOL_GB

GB = 1e9
"""``--kv-host-pool-gb`` counts 1e9 bytes (as the pool's own check)."""


@dataclass(frozen=True)
class HostPoolFloor:
    """KV shape of one TP rank's pool and the token count it must hold; all in [1, 2**40]."""

    layers: int
    """Attention layers (each holds K and V of every page)."""
    kv_heads: int
    """KV heads on one TP rank."""
    head_dim: int
    """Per-head dimension of K (and V)."""
    dtype_bytes: int
    """Bytes per stored K or V value."""
    page_size: int
    """Tokens per KV page (1 when SGLang's ``--page-size`` is not given)."""
    max_total_tokens: int | None
    """``--max-total-tokens`` (None: not given, SGLang sizes the pool from memory)."""

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "dtype_bytes", "page_size", "max_total_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_total_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 40:
                raise ValueError(f"HostPoolFloor.{name}={value!r} is out of range [1, {1 << 40}]")

    @property
    def token_bytes(self) -> int:
        """Host bytes of one token across all layers: K and V of every KV head."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def min_pages(self) -> int:
        """Pages the pool holds at least, the padding page included."""
        if self.max_total_tokens is None:
            return 2
        return self.max_total_tokens // self.page_size + 1

    @property
    def min_bytes(self) -> int:
        """The floor in bytes: every layer of :attr:`min_pages` pages."""
        return self.min_pages * self.page_size * self.token_bytes

    def on_device(self, budget_tokens: int | None) -> bool:
        """Whether ``--kv-gpu-budget-tokens`` holds every layer of every page of
        ``--max-total-tokens``: the identity layout, which pins no host pool (or, beyond SGLang's
        memory profile, a budget the scheduler refuses); the launcher knows it without the profile."""
        if self.max_total_tokens is None or budget_tokens is None:
            return False
        return budget_tokens // self.page_size >= self.layers * self.min_pages

    @property
    def on_device_budget(self) -> int | None:
        """The least ``--kv-gpu-budget-tokens`` that :meth:`on_device` takes (every layer of every
        page of ``--max-total-tokens``), None without it: what a launch whose memory profile holds
        ``--max-total-tokens`` on the device passes to tell the launcher so (a refusal's hint)."""
        return None if self.max_total_tokens is None else self.layers * self.min_pages * self.page_size

    def identity_hint(self, budget_tokens: int | None) -> str:
        """What a refusal of the host pool adds: where SGLang's memory profile holds
        ``--max-total-tokens`` on the device, the pool pins no host memory, and the budget that
        says so (the launcher cannot know the profile; the scheduler refuses the budget when the
        device cannot hold it). Empty when it does not apply."""
        every = self.on_device_budget
        if every is None or self.on_device(budget_tokens):
            return ""
        return (f"; if the device holds all of --max-total-tokens {self.max_total_tokens} (SGLang's memory "
                f"profile), no host pool is pinned: pass --kv-gpu-budget-tokens {every} (every layer of it) "
                "to say so, which the scheduler refuses if the device cannot hold it")

    def device_min_bytes(self, budget_tokens: int | None) -> int:
        """The device pool the layered pool builds beside :attr:`min_bytes` (host memory on
        ``--device cpu``): every layer of every page, or ``--kv-gpu-budget-tokens`` token-layers
        when that is less (``SlotStoreConfig.device_bytes``)."""
        if budget_tokens is None:
            return self.min_bytes
        return min(self.min_bytes, budget_tokens * self.token_bytes // self.layers)

    @property
    def min_gb(self) -> float:
        """The floor in GB, rounded up to the kB (so that passing this figure is accepted)."""
        return -(-self.min_bytes // 1000) / 1e6

    def check(self, cap_gb: float) -> None:
        """Raise ValueError naming ``--kv-host-pool-gb``, its value, the floor and what it holds
        when ``cap_gb`` is below the floor."""
        if cap_gb * GB >= self.min_bytes:
            return
        if self.max_total_tokens is None:
            holds = (f"one page of {self.page_size} token(s) and the padding page (the least any pool "
                     "holds; set --max-total-tokens to have the full need checked here)")
        else:
            holds = (f"--max-total-tokens {self.max_total_tokens} in pages of {self.page_size} "
                     "plus the padding page")
        raise ValueError(
            f"--kv-host-pool-gb={cap_gb:g} is out of range [{self.min_gb:.6f}, {MAX_HOST_POOL_GB}] "
            f"(GB) for this launch: the host KV pool holds every layer of {holds}, "
            f"{self.min_pages * self.page_size} tokens x {self.token_bytes} B ({self.layers} layers x K,V "
            f"x {self.kv_heads} KV heads x {self.head_dim} x {self.dtype_bytes} B) = {self.min_bytes} B"
        )

    @classmethod
    def from_server_args(cls, server_args: Any) -> HostPoolFloor:
        """The floor for SGLang's parsed ``ServerArgs`` (reads the model's config through SGLang's
        ``ModelConfig``, as the scheduler will)."""
        return cls.from_model_config(compat.resolve(compat.MODEL_CONFIG_FROM_SERVER_ARGS.path)(server_args),
                                     server_args)

    @classmethod
    def from_model_config(cls, model_config: Any, server_args: Any) -> HostPoolFloor:
        """The floor for SGLang's ``ModelConfig`` of the launch and its ``ServerArgs``."""
        kv_dtype = str(server_args.kv_cache_dtype or "auto")
        dtype_bytes = 2 if kv_dtype in ("bf16", "bfloat16") else int(model_config.dtype.itemsize)
        return cls(
            layers=int(model_config.num_hidden_layers),
            kv_heads=int(model_config.get_num_kv_heads(int(server_args.tp_size or 1))),
            head_dim=int(model_config.head_dim),
            dtype_bytes=dtype_bytes,
            page_size=int(server_args.page_size or 1),
            max_total_tokens=server_args.max_total_tokens,
        )
