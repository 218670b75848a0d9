"""Simulator tests: quiet the control plane's per-plan logging."""

import pytest

from simulator.logs import quiet


@pytest.fixture(autouse=True, scope="session")
def _quiet_logs():
    quiet()
