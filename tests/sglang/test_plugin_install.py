"""A plugin that cannot install its hooks stops the process under ``--enable-layered-kv``.

SGLang's plugin loader (``sglang.srt.plugins.load_plugins``) logs a plugin's exception and goes
on. When kvplane's layered hooks failed half-way (a broken hook reference in session 82's work
did this: ``AttributeError`` in ``scheduler_hooks.register``), the server served with the hooks
registered before the failure -- the layered pool and step boundary, without the parked requests'
lifecycle hooks after it. Now the install refuses: one line naming the flag and the error, exit
status 2 (``SystemExit``, which the loader's ``except Exception`` does not swallow). Control: the
same failure with the flag off is never reached (nothing layered is installed), and a working
install returns.
"""

from __future__ import annotations

from typing import Any

import pytest

from sglang_ext import settings
from sglang_ext.args import LayeredKVArgs
from sglang_ext.context import PluginContext
from sglang_ext.plugin import KvplanePlugin


class _Registry:
    def __init__(self) -> None:
        self.paths: list[str] = []

    def register(self, path: str, hook: Any, kind: Any) -> None:
        self.paths.append(path)


_KINDS = type("HookType", (), {"AFTER": "after", "AROUND": "around", "BEFORE": "before"})


def _plugin(enabled: bool) -> KvplanePlugin:
    env = {settings.LAYERED_KV_ARGS_ENV: LayeredKVArgs(enable_layered_kv=enabled).to_json()}
    return KvplanePlugin(PluginContext.from_environ(env))


def test_a_half_installed_plugin_refuses_to_serve(monkeypatch, capsys):
    def broken(self: KvplanePlugin, registry: Any, kinds: Any) -> None:
        registry.register("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run", None, kinds.AROUND)
        raise AttributeError("module 'sglang_ext.parked_lifecycle' has no attribute 'around_x'")

    monkeypatch.setattr(KvplanePlugin, "_register_layered", broken)
    with pytest.raises(SystemExit) as stopped:
        _plugin(enabled=True).install(_Registry(), _KINDS)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "kvplane: --enable-layered-kv: kvplane could not install its SGLang hooks (AttributeError:" in err
    assert "around_x" in err
    _plugin(enabled=False).install(registry := _Registry(), _KINDS)  # flag off: never reached
    assert registry.paths and "get_next_batch_to_run" not in " ".join(registry.paths)
    monkeypatch.setattr(KvplanePlugin, "_register_layered", lambda self, registry, kinds: None)
    _plugin(enabled=True).install(_Registry(), _KINDS)  # a working install returns
