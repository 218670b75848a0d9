"""The SGLang hook targets one process's plugin registers, and the check that SGLang applied them.

SGLang's ``HookRegistry.apply_hooks`` patches each registered target in turn; one it cannot patch
(a renamed method, a hook chain that raises while it is built) is logged ("Failed to apply hooks
to ...") and skipped, and the process goes on with every other target patched. Under
``--enable-layered-kv`` that is a partial install: the layered pool and step boundary without,
say, the parked requests' lifecycle hooks, serving wrong. :class:`HookInstall` stands between the
plugin and the registry, keeps the targets it registered, and names those SGLang left out of its
patched set (``compat.patched_hook_targets``); the plugin refuses to serve with any
(``KvplanePlugin.check_hooks_applied``: at launch in the launcher, at ``publish`` in every SGLang
process, when a scheduler builds its tree cache). Two more ways a hook is left out:

* a target SGLang had patched before this plugin registered on it (another plugin's early
  ``apply_hooks``; SGLang's ``apply_hooks`` skips a patched target): kept as never applied;
* ``ServerArgs.from_cli_args`` itself, where the launcher's check runs: unpatched, the parse would
  drop the flag family and SGLang would serve without kvplane, so the parser is not offered
  ``--enable-layered-kv`` (``plugin._after_add_cli_args``: one line saying why; argparse then
  rejects the flag).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


class HookInstall:
    """A ``HookRegistry`` stand-in that passes every registration on and keeps its target."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry
        self._targets: dict[str, None] = {}  # insertion-ordered set
        self._late: set[str] = set()  # patched before they were registered here

    def register(self, target: str, hook: Any, hook_type: Any) -> None:
        """``HookRegistry.register(target, hook, hook_type)``, with ``target`` kept. A target the
        registry had patched already (its ``_patched``: hooks applied before this plugin
        registered, e.g. by another plugin's early ``apply_hooks``) is kept as never applied:
        ``apply_hooks`` skips a patched target, so this hook would never join its chain."""
        late = target in getattr(self._registry, "_patched", ())
        self._registry.register(target, hook, hook_type)
        self._targets[target] = None
        if late:
            self._late.add(target)

    @property
    def targets(self) -> tuple[str, ...]:
        """Every target registered through this install, in order, each once."""
        return tuple(self._targets)

    def unapplied(self, patched: Collection[str]) -> tuple[str, ...]:
        """The registered targets not in ``patched`` (SGLang's set of targets it patched), or
        patched before they were registered here."""
        return tuple(t for t in self._targets if t not in patched or t in self._late)

    def refusal(self, patched: Collection[str]) -> str | None:
        """The launch error when a registered target is not in ``patched``; None when all are."""
        missing = self.unapplied(patched)
        if not missing:
            return None
        late = [t for t in missing if t in self._late]
        why = ("patched before kvplane registered on it (another plugin applied SGLang's hooks early): "
               + ", ".join(late) + "; ") if late else ""
        return (f"--enable-layered-kv: SGLang did not apply kvplane's hooks on {len(missing)} of "
                f"{len(self._targets)} targets ({', '.join(missing)}; {why}SGLang's log says why for the "
                "others: \"Failed to apply hooks to ...\"); not serving with part of them")
