"""Logging setup for simulator entry points (CLI, reproduce, tests).

The control plane logs every plan at info level; a simulation makes thousands of plans, so the
simulator's entry points raise structlog's level to WARNING (an explicit, opt-in call).
"""

from __future__ import annotations

import logging

import structlog

_log = structlog.get_logger(__name__)


def quiet(level: int = logging.WARNING) -> None:
    """Drop structlog events below ``level`` process-wide."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))
