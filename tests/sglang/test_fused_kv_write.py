"""Models that fuse the KV write into rotary (Qwen3-MoE: ``enable_fused_set_kv_buffer``; gpt-oss fuses too, but is refused at launch for its sinks)
write through ``set_kv_buffer`` over the layered pool: the fused kernel would write SGLang's flat
per-layer buffers, which the layered pool does not have (``get_key_buffer`` raises)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.sglang


def test_fused_kv_write_is_declined_under_the_layered_backend_only():
    from sglang.srt.model_executor import forward_context as fc

    from sglang_ext import compat
    from sglang_ext.layered_attention import LayeredTorchNativeAttnBackend
    from sglang_ext.plugin import _around_enable_fused_set_kv_buffer as hook

    assert callable(compat.resolve(compat.ENABLE_FUSED_SET_KV_BUFFER.path))
    cuda_bf16 = lambda forward_batch: True  # noqa: E731 -- SGLang's answer on CUDA with a bf16 pool
    batch = SimpleNamespace()
    layered = object.__new__(LayeredTorchNativeAttnBackend)  # only its type is read
    previous = fc.set_forward_context(fc.ForwardContext(attn_backend=layered))
    try:
        assert hook(cuda_bf16, batch) is False
        fc.set_forward_context(fc.ForwardContext(attn_backend=object()))
        assert hook(cuda_bf16, batch) is True  # negative control: other backends keep SGLang's answer
        fc.set_forward_context(None)
        assert hook(cuda_bf16, batch) is True  # no forward running: SGLang's answer
    finally:
        fc.set_forward_context(previous)


def test_the_hook_is_installed_with_the_flag_on(monkeypatch):
    from sglang_ext import compat, plugin, settings
    from sglang_ext.args import LayeredKVArgs

    registered: dict[str, object] = {}

    class Recorder:
        @staticmethod
        def register(target, hook, hook_type):  # noqa: ANN001, ANN205
            registered[target] = hook

    monkeypatch.setenv(settings.LAYERED_KV_ARGS_ENV, LayeredKVArgs(enable_layered_kv=True).to_json())
    monkeypatch.setattr(compat, "check_version", lambda: "0.5.23")
    monkeypatch.setattr(compat, "HookRegistry", Recorder, raising=False)
    monkeypatch.setattr(compat, "HookType", SimpleNamespace(AFTER="after", AROUND="around"), raising=False)
    monkeypatch.setattr(plugin, "_swap_attention_backends", lambda: None)
    monkeypatch.setattr(compat, "register_radix_cache_backend", lambda *a: None, raising=False)
    monkeypatch.setattr("sglang_ext.scheduler_hooks.register", lambda *a: None)
    plugin.register()
    assert registered[compat.ENABLE_FUSED_SET_KV_BUFFER.path] is plugin._around_enable_fused_set_kv_buffer
