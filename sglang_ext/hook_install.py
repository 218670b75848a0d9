"""The SGLang hook targets one process's plugin registers, and the check that SGLang applied them.

SGLang's ``HookRegistry.apply_hooks`` patches each registered target in turn; one it cannot patch
(a renamed method, a hook chain that raises while it is built) is logged ("Failed to apply hooks
to ...") and skipped, and the process goes on with every other target patched. Under
``--enable-layered-kv`` that is a partial install: the layered pool and step boundary without,
say, the parked requests' lifecycle hooks, serving wrong. :class:`HookInstall` stands between the
plugin and the registry, keeps the targets it registered, and names those SGLang left out of its
patched set (``compat.patched_hook_targets``); the plugin refuses to serve with any
(``KvplanePlugin.check_hooks_applied``: at launch in the launcher, at ``publish`` in every SGLang
process, when a scheduler builds its tree cache).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


class HookInstall:
    """A ``HookRegistry`` stand-in that passes every registration on and keeps its target."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry
        self._targets: dict[str, None] = {}  # insertion-ordered set

    def register(self, target: str, hook: Any, hook_type: Any) -> None:
        """``HookRegistry.register(target, hook, hook_type)``, with ``target`` kept."""
        self._registry.register(target, hook, hook_type)
        self._targets[target] = None

    @property
    def targets(self) -> tuple[str, ...]:
        """Every target registered through this install, in order, each once."""
        return tuple(self._targets)

    def unapplied(self, patched: Collection[str]) -> tuple[str, ...]:
        """The registered targets not in ``patched`` (SGLang's set of targets it patched)."""
        return tuple(t for t in self._targets if t not in patched)

    def refusal(self, patched: Collection[str]) -> str | None:
        """The launch error when a registered target is not in ``patched``; None when all are."""
        missing = self.unapplied(patched)
        if not missing:
            return None
        return (f"--enable-layered-kv: SGLang did not apply kvplane's hooks on {len(missing)} of "
                f"{len(self._targets)} targets ({', '.join(missing)}; SGLang's log says why: "
                "\"Failed to apply hooks to ...\"); not serving with part of them")
