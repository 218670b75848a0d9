"""sglang_ext.logs: kvplane's structlog level inside SGLang processes."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from sglang_ext.logs import LOG_LEVEL_ENV, configure_from_env, export_level, parse_level


def test_parse_level_accepts_names_any_case():
    assert parse_level("Info") == logging.INFO
    assert parse_level(" debug ") == logging.DEBUG


def test_parse_level_rejects_unknown_with_choices():
    with pytest.raises(ValueError, match="KVPLANE_LOG_LEVEL: 'loud' is not a log level"):
        parse_level("loud")


def test_export_level_takes_sglang_level_unless_user_set():
    env: dict[str, str] = {}
    export_level("WARNING", env)
    assert env[LOG_LEVEL_ENV] == "warning"
    env = {LOG_LEVEL_ENV: "debug"}
    export_level("info", env)
    assert env[LOG_LEVEL_ENV] == "debug"
    env = {}
    export_level(None, env)
    assert env[LOG_LEVEL_ENV] == "info"


def test_export_level_rejects_bad_user_value():
    with pytest.raises(ValueError, match="not a log level"):
        export_level("info", {LOG_LEVEL_ENV: "chatty"})


def test_configure_without_exported_level_changes_nothing():
    assert configure_from_env({}) is False


_CHILD = """
import structlog, sys
from sglang_ext.logs import configure_from_env
first = configure_from_env({"KVPLANE_LOG_LEVEL": sys.argv[1]})
again = configure_from_env({"KVPLANE_LOG_LEVEL": "debug"})
log = structlog.get_logger("t")
log.debug("dbg_event")
log.info("info_event")
log.warning("warn_event")
print(first, again)
"""


@pytest.mark.parametrize(
    ("level", "shown", "hidden"),
    [
        ("info", ["info_event", "warn_event"], ["dbg_event"]),
        ("warning", ["warn_event"], ["dbg_event", "info_event"]),
        ("nonsense", ["info_event"], ["dbg_event"]),  # a bad exported value means info
    ],
)
def test_configure_filters_below_level_once(level, shown, hidden):
    """In a fresh process: events below the level are dropped; a second call keeps the first."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, level], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip().splitlines()[-1] == "True False"
    for name in shown:
        assert name in out
    for name in hidden:
        assert name not in out
