"""Level filtering of kvplane's structlog events inside SGLang processes.

structlog's default logger formats and prints every event, debug included. In a scheduler that
is a per-step cost: the controller logs each profile update at debug level, so an unfiltered
server writes a line to stderr on about one step in ten. The launcher exports SGLang's
``--log-level`` (or the user's own ``KVPLANE_LOG_LEVEL``) and every process the flag is on in
filters below it. A process that configured structlog itself keeps its configuration.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import structlog

LOG_LEVEL_ENV = "KVPLANE_LOG_LEVEL"
"""Level of kvplane's events in the server's processes (debug, info, warning, error, critical)."""
LEVELS = ("debug", "info", "warning", "error", "critical")


def parse_level(name: str) -> int:
    """The ``logging`` level of ``name`` (case-insensitive); ValueError naming the choices."""
    key = str(name).strip().lower()
    if key not in LEVELS:
        raise ValueError(f"{LOG_LEVEL_ENV}: {name!r} is not a log level (allowed: {', '.join(LEVELS)})")
    return int(getattr(logging, key.upper()))


def export_level(sglang_level: str | None, environ: dict[str, str] | None = None) -> None:
    """Launcher: export SGLang's ``--log-level`` unless the user set :data:`LOG_LEVEL_ENV`;
    ValueError when the user's value is not a level."""
    env = os.environ if environ is None else environ
    if env.get(LOG_LEVEL_ENV):
        parse_level(env[LOG_LEVEL_ENV])
        return
    level = (sglang_level or "info").lower()
    env[LOG_LEVEL_ENV] = level if level in LEVELS else "info"


def configure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Filter structlog below the exported level; False (nothing changed) when structlog is
    already configured in this process or nothing was exported. A bad value means info."""
    raw = (os.environ if environ is None else environ).get(LOG_LEVEL_ENV)
    if not raw or structlog.is_configured():
        return False
    try:
        level = parse_level(raw)
    except ValueError:
        level = logging.INFO
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))
    return True
