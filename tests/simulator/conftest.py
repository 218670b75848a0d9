"""Simulator tests: quiet the control plane's per-plan logging, and restore structlog's
configuration afterwards (other test packages capture info-level events)."""

import pytest
import structlog

from simulator.logs import quiet


@pytest.fixture(autouse=True, scope="package")
def _quiet_logs():
    saved = structlog.get_config()
    quiet()
    yield
    structlog.configure(**saved)
