"""The SGLang version kvplane supports, and the check ``register()`` runs at load.

Pure Python: ``importlib.metadata`` reads the installed distribution's version without
importing SGLang.
"""

from __future__ import annotations

import importlib.metadata

SUPPORTED_VERSION = "0.5.23"
"""The one SGLang release whose internals :mod:`sglang_ext.compat.surface` was read off
(pinned in ``requirements/constraints.txt``)."""
DISTRIBUTION = "sglang"


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is not the release kvplane's hooks were written against."""


def installed_version() -> str | None:
    """The installed ``sglang`` distribution's version, None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> str:
    """``0.5.23+cpu`` -> ``0.5.23`` (a local build of the same release is the same release)."""
    return version.split("+", 1)[0].strip()


def check_version(installed: str | None = None, supported: str = SUPPORTED_VERSION) -> str:
    """Return the installed version; raise :class:`UnsupportedSGLangVersion` naming both
    versions when it is not ``supported``. ``installed`` defaults to the installed distribution's."""
    found = installed_version() if installed is None else installed
    if found is None:
        raise UnsupportedSGLangVersion(
            f"kvplane: SGLang {supported} is required, but no '{DISTRIBUTION}' distribution is "
            f"installed (pip install -c requirements/constraints.txt 'sglang=={supported}')"
        )
    if _release(found) != _release(supported):
        raise UnsupportedSGLangVersion(
            f"kvplane: SGLang {found} is installed, but kvplane supports SGLang {supported} only "
            f"(its hooks patch that release's internals; see sglang_ext/compat). Install "
            f"'sglang=={supported}' (requirements/constraints.txt) or disable the plugin with "
            "SGLANG_PLUGINS set to the other plugins' names"
        )
    return found
