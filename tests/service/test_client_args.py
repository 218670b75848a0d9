"""GrpcControlPlane's deadlines are checked when it is made, naming the parameter and the range."""

from __future__ import annotations

import math

import pytest

from controlplane.service.client import GrpcControlPlane

BAD = (0, 0.0, -1.0, math.nan, math.inf, 3601.0, None, True, "5")


@pytest.mark.parametrize("name", ["timeout_s", "plan_timeout_s"])
@pytest.mark.parametrize("value", BAD, ids=[repr(v) for v in BAD])
def test_a_bad_deadline_is_refused_naming_it(name: str, value: object) -> None:
    """Scenario: ``plan_timeout_s`` was not checked; 0, -1, NaN or inf made every ``plan()`` fail
    at once as if the control plane were down, and None removed the deadline (control-plane
    review, session 77). Each bad value of either deadline is a ValueError naming it."""
    with pytest.raises(ValueError, match=rf"^{name}: .* is out of range \(allowed \(0, 3600\]\)"):
        GrpcControlPlane("127.0.0.1:1", **{name: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0.001, 1, 30.0, 3600])
def test_deadlines_in_range_are_taken(value: float) -> None:
    """The control: deadlines in (0, 3600] make a client (nothing is dialled until a call)."""
    client = GrpcControlPlane("127.0.0.1:1", timeout_s=value, plan_timeout_s=value)
    client.close()
