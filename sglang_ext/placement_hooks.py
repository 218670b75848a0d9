"""``PlacementHooks``: the main-process hooks that deliver the per-request placement info.

Installed by :meth:`sglang_ext.plugin.KvplanePlugin.install` in every SGLang process (only the
main one serves requests), bound to the process's :class:`~sglang_ext.context.PluginContext`;
with ``--enable-layered-kv`` off each one is a pass-through that imports nothing:

* AROUND ``TokenizerManager.update_request_meta_info``: the scheduler's record becomes
  ``meta_info["kvplane"]`` (:mod:`sglang_ext.placement_response`);
* AFTER ``OpenAIServingCompletion._build_completion_response`` /
  ``OpenAIServingChat._build_chat_response`` and AROUND their ``_generate_*_stream``: the record
  as ``sglext.kvplane`` (:mod:`sglang_ext.openai_placement`);
* AROUND ``OpenAIServingResponses.create_responses`` and ``_generate_with_builtin_tools``:
  ``/v1/responses`` gets kvplane's ``custom_params`` keys to the engine (its request model has no
  such field) and the record as ``sglext.kvplane`` (:mod:`sglang_ext.responses_placement`).

The opt-in check and the paced-deposit tap ride on the plugin's ``_stream_one_response`` hook.
Light at import (no torch, no SGLang).
"""

from __future__ import annotations

from typing import Any

from sglang_ext import compat
from sglang_ext.context import PluginContext


class PlacementHooks:
    """The placement-info hooks of one process, bound to its context."""

    def __init__(self, ctx: PluginContext) -> None:
        self.ctx = ctx

    @property
    def enabled(self) -> bool:
        return self.ctx.enabled

    def install(self, hook_registry: Any, hook_type: Any) -> None:
        hook_registry.register(
            compat.TOKENIZER_UPDATE_REQUEST_META_INFO.path, self.around_update_request_meta_info, hook_type.AROUND
        )
        hook_registry.register(compat.OPENAI_COMPLETION_BUILD_RESPONSE.path, self.after_build_response, hook_type.AFTER)
        hook_registry.register(compat.OPENAI_CHAT_BUILD_RESPONSE.path, self.after_build_response, hook_type.AFTER)
        hook_registry.register(compat.OPENAI_COMPLETION_STREAM.path, self.around_completion_stream, hook_type.AROUND)
        hook_registry.register(compat.OPENAI_CHAT_STREAM.path, self.around_chat_stream, hook_type.AROUND)
        hook_registry.register(compat.OPENAI_RESPONSES_CREATE.path, self.around_create_responses, hook_type.AROUND)
        hook_registry.register(compat.OPENAI_RESPONSES_GENERATE.path, self.around_responses_generate, hook_type.AROUND)

    def around_update_request_meta_info(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return original(*args, **kwargs)
        from sglang_ext.placement_response import around_update_request_meta_info

        return around_update_request_meta_info(original, *args, **kwargs)

    def after_build_response(self, result: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return None
        from sglang_ext.openai_placement import after_build_response

        return after_build_response(result, *args, **kwargs)

    def around_completion_stream(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return original(*args, **kwargs)
        from sglang_ext.openai_placement import around_stream

        return around_stream(chat=False)(original, *args, **kwargs)

    def around_chat_stream(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return original(*args, **kwargs)
        from sglang_ext.openai_placement import around_stream

        return around_stream(chat=True)(original, *args, **kwargs)

    def around_create_responses(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return original(*args, **kwargs)
        from sglang_ext.responses_placement import around_create_responses

        return around_create_responses(original, *args, **kwargs)

    def around_responses_generate(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return original(*args, **kwargs)
        from sglang_ext.responses_placement import around_generate

        return around_generate(original, *args, **kwargs)
