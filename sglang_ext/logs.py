"""Level filtering of kvplane's structlog events inside SGLang processes.

structlog's default logger formats and prints every event, debug included. In a scheduler that
is a per-step cost: the controller logs each profile update at debug level, so an unfiltered
server writes a line to stderr on about one step in ten. The launcher exports SGLang's
``--log-level`` (or the user's own ``KVPLANE_LOG_LEVEL``) and every process the flag is on in
filters below it. A process that configured structlog itself keeps its configuration.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping

import structlog

from sglang_ext import settings

LOG_LEVEL_ENV = settings.LOG_LEVEL_ENV
"""Level of kvplane's events in the server's processes (debug, info, warning, error, critical)."""
LEVELS = settings.LOG_LEVELS


def parse_level(name: str) -> int:
    """The ``logging`` level of ``name`` (case-insensitive); ValueError naming the choices."""
    return int(getattr(logging, settings.parse_log_level(name).upper()))


def export_level(sglang_level: str | None, environ: MutableMapping[str, str] | None = None) -> None:
    """Launcher: export SGLang's ``--log-level`` unless the user set :data:`LOG_LEVEL_ENV`;
    ValueError when the user's value is not a level."""
    settings.export_log_level(sglang_level, environ)


def configure(level: str | None) -> bool:
    """Filter structlog below ``level`` (a :data:`LEVELS` name); False (nothing changed) when
    structlog is already configured in this process or no level is given."""
    if not level or structlog.is_configured():
        return False
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(parse_level(level)))
    return True


def configure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """:func:`configure` with the exported level (:func:`sglang_ext.settings.read_log_level`); a
    bad value means info here (the plugin has reported it already)."""
    try:
        level = settings.read_log_level(environ)
    except ValueError:
        level = "info"
    return configure(level)
