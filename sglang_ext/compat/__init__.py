"""kvplane's whole SGLang surface: the only package in ``sglang_ext`` that names SGLang.

Everything else in ``sglang_ext/`` reaches SGLang through here:

* **Hook points and shapes** -- one :class:`~sglang_ext.compat.surface.Target` per SGLang module,
  class, function or method kvplane patches, calls, subclasses or reads, with the parameter names
  it binds and the attributes it uses (``compat.SCHEDULER_RUN_BATCH.path``,
  ``compat.SCHEDULER_GET_NEXT_BATCH_TO_RUN.args``); all of them in :data:`TARGETS`.
* **SGLang objects**, imported on first access (PEP 562), so importing this package stays light
  (no torch, no SGLang) and ``plugin.py`` / ``args.py`` can import it at module level:
  ``HookRegistry``, ``HookType``, ``RadixCache``, ``TreeNode``, ``MHATokenToKVPool``,
  ``unwrap_write_loc``, ``TorchNativeAttnBackend``, ``SamplingBatchInfo``, ``get_schedule``, ``broadcast_pyobj``,
  ``register_radix_cache_backend``, ``get_radix_cache_factory``, ``get_attn_backend``, the OpenAI
  response models ``SglExt``, ``CompletionResponse``, ``CompletionStreamResponse``,
  ``ChatCompletionResponse``, ``ChatCompletionStreamResponse``, ``ResponsesResponse``,
  ``TypeBasedDispatcher``, ``should_use_tensor_core``;
  :func:`attention_backends` for
  the backend registry dict, :func:`patched_hook_targets` for the hook targets SGLang patched and
  :func:`resolve` for any target.
* **The supported version**: :data:`SUPPORTED_VERSION` and :func:`check_version`, run by
  ``sglang_ext.plugin.register`` before it installs anything.

``tests/sglang/test_compat.py`` checks every target against the installed SGLang with
``inspect`` (no server). Upgrading SGLang: bump :data:`SUPPORTED_VERSION`, run that test, fix the
targets it names and the modules listed in their ``used_by``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from sglang_ext.compat import surface as _surface
from sglang_ext.compat.checker import check_surface, check_target, resolve
from sglang_ext.compat.surface import *  # noqa: F403 -- the Target constants are this package's API
from sglang_ext.compat.surface import (
    ATTENTION_BACKEND_FACTORIES,
    BROADCAST_PYOBJ,
    DEFAULT_DEVICE,
    FLASHINFER_TENSOR_CORES,
    GET_ATTN_BACKEND,
    GET_RADIX_CACHE_FACTORY,
    HOOK_REGISTRY,
    HOOK_TYPE,
    MHA_TOKEN_TO_KV_POOL,
    OPENAI_CHAT_RESPONSE,
    OPENAI_CHAT_STREAM_RESPONSE,
    OPENAI_COMPLETION_RESPONSE,
    OPENAI_COMPLETION_STREAM_RESPONSE,
    OPENAI_RESPONSES_RESPONSE,
    OPENAI_SGLEXT,
    PARALLEL_CONTEXT,
    RADIX_CACHE,
    REGISTER_RADIX_CACHE_BACKEND,
    SAMPLING_BATCH_INFO,
    SCHEDULE_POLICY_GET_SCHEDULE,
    TORCH_NATIVE_ATTN_BACKEND,
    TREE_NODE,
    TYPE_BASED_DISPATCHER,
    UNWRAP_WRITE_LOC,
    Target,
)
from sglang_ext.compat.version import (
    SUPPORTED_VERSION,
    UnsupportedSGLangVersion,
    check_version,
    installed_version,
)

_LAZY: MappingProxyType[str, Target] = MappingProxyType({
    "HookRegistry": HOOK_REGISTRY,
    "HookType": HOOK_TYPE,
    "RadixCache": RADIX_CACHE,
    "TreeNode": TREE_NODE,
    "MHATokenToKVPool": MHA_TOKEN_TO_KV_POOL,
    "unwrap_write_loc": UNWRAP_WRITE_LOC,
    "TorchNativeAttnBackend": TORCH_NATIVE_ATTN_BACKEND,
    "SamplingBatchInfo": SAMPLING_BATCH_INFO,
    "get_schedule": SCHEDULE_POLICY_GET_SCHEDULE,
    "broadcast_pyobj": BROADCAST_PYOBJ,
    "register_radix_cache_backend": REGISTER_RADIX_CACHE_BACKEND,
    "get_radix_cache_factory": GET_RADIX_CACHE_FACTORY,
    "get_attn_backend": GET_ATTN_BACKEND,
    "SglExt": OPENAI_SGLEXT,
    "CompletionResponse": OPENAI_COMPLETION_RESPONSE,
    "CompletionStreamResponse": OPENAI_COMPLETION_STREAM_RESPONSE,
    "ChatCompletionResponse": OPENAI_CHAT_RESPONSE,
    "ChatCompletionStreamResponse": OPENAI_CHAT_STREAM_RESPONSE,
    "TypeBasedDispatcher": TYPE_BASED_DISPATCHER,
    "ResponsesResponse": OPENAI_RESPONSES_RESPONSE,
    "should_use_tensor_core": FLASHINFER_TENSOR_CORES,
})
"""SGLang objects importable from this package, imported on first access."""

LAZY_NAMES = tuple(_LAZY)


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    obj = resolve(target.path)
    globals()[name] = obj  # later accesses skip this function, like a module-level import
    return obj


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def attention_backends() -> dict[str, Any]:
    """SGLang's ``ATTENTION_BACKENDS`` registry (name -> factory), shared with the model runner."""
    backends: dict[str, Any] = resolve(ATTENTION_BACKEND_FACTORIES.path)
    return backends


def default_device() -> str | None:
    """The device SGLang gives a launch without ``--device`` (its ``get_device()``), or None when
    it finds none (SGLang says so itself when it resolves the launch)."""
    try:
        return str(resolve(DEFAULT_DEVICE.path)())
    except Exception:
        return None


def patched_hook_targets() -> frozenset[str]:
    """The hook targets SGLang's ``HookRegistry.apply_hooks`` patched in this process (its
    ``_patched``); one it failed to patch is logged by SGLang and left out of it."""
    return frozenset(resolve(HOOK_REGISTRY.path)._patched)


def replica_rank(dp_size: int) -> int:
    """This process's data-parallel replica under ``--dp-size dp_size``: 0 without replicas
    (``dp_size <= 1``); otherwise SGLang's ``get_parallel().dp_rank``. Raises ``RuntimeError``
    when SGLang does not say, rather than letting two replicas share one worker id and one set of
    files."""
    if dp_size <= 1:
        return 0
    try:
        rank = resolve(PARALLEL_CONTEXT.path)().dp_rank
    except (AttributeError, ImportError, RuntimeError, ValueError) as exc:
        raise RuntimeError(f"kvplane: --dp-size {dp_size}, but SGLang's parallel context has no dp_rank: {exc}") from exc
    if rank is None or not 0 <= int(rank) < dp_size:
        raise RuntimeError(f"kvplane: --dp-size {dp_size}, but SGLang's parallel context says dp_rank={rank!r}")
    return int(rank)


__all__ = [
    *_surface.__all__,
    "LAZY_NAMES",
    "SUPPORTED_VERSION",
    "UnsupportedSGLangVersion",
    "attention_backends",
    "check_surface",
    "check_target",
    "check_version",
    "installed_version",
    "patched_hook_targets",
    "replica_rank",
    "resolve",
    *_LAZY,
]
