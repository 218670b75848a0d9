"""The test-only injector's failed hook (``KVPLANE_TEST_UNPATCHED_HOOK=TARGET``, loaded by this
directory's ``sitecustomize``): SGLang's ``HookRegistry`` fails to patch ``TARGET`` in every process,
as it fails on a target it cannot resolve or wrap. Its ``apply_hooks`` logs the failure and patches
every other target: the partial install kvplane must refuse to serve with
(``sglang_ext/hook_install.py``)."""

from __future__ import annotations

import os

TARGET = "sglang.srt.plugins.hook_registry"


def patch(module) -> None:  # noqa: ANN001
    """``HookRegistry._apply_target`` raises for the named target (SGLang logs "Failed to apply
    hooks to ..." and goes on); every other target is applied as SGLang applies it."""
    failing = os.environ["KVPLANE_TEST_UNPATCHED_HOOK"]
    registry = module.HookRegistry
    real = registry._apply_target.__func__

    def _apply_target(cls, target, hooks):  # noqa: ANN001, ANN202
        if target == failing:
            raise AttributeError(f"test fault: {target} cannot be patched")
        return real(cls, target, hooks)

    registry._apply_target = classmethod(_apply_target)
