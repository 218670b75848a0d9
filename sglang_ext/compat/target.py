"""Target: one SGLang object kvplane relies on (the unit of :mod:`sglang_ext.compat.surface`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """One SGLang object kvplane relies on."""

    path: str
    """Dotted path: a module, or a module followed by attribute names (class, function, method)."""
    params: tuple[str, ...] = ()
    """Leading parameter names in order (``self`` included for methods reached through their
    class; a classmethod reached through its class starts after ``cls``). Hooks bind these
    positionally."""
    keyword: tuple[str, ...] = ()
    """Parameters kvplane passes or reads by name (any position, keyword-capable)."""
    attrs: tuple[str, ...] = ()
    """Attributes (fields, methods, instance attributes) kvplane reads, calls or overrides."""
    keys: tuple[str, ...] = ()
    """Keys kvplane reads or replaces (the target is a dict)."""
    used_by: tuple[str, ...] = ()
    """kvplane modules (under ``sglang_ext/``) relying on it."""

    @property
    def args(self) -> tuple[str, ...]:
        """``params`` without a leading ``self``: the hooked call's own arguments."""
        return self.params[1:] if self.params[:1] == ("self",) else self.params

    @property
    def name(self) -> str:
        """Last component of the path."""
        return self.path.rsplit(".", 1)[-1]
