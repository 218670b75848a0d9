"""The recompute override's pure parts: the entry check and the (ratio, layers) a request gets."""

from __future__ import annotations

import pytest

from sglang_ext.recompute_param import recompute_param_error, recompute_request


@pytest.mark.parametrize(
    ("custom", "fragment"),
    [
        ({"kvplane_recompute_ratio": 1}, "kvplane_recompute_ratio=1 is invalid"),
        ({"kvplane_recompute_ratio": -0.1}, "kvplane_recompute_ratio=-0.1"),
        ({"kvplane_recompute_ratio": "0.5"}, 'kvplane_recompute_ratio="0.5"'),
        ({"kvplane_recompute_ratio": True}, "kvplane_recompute_ratio=true"),
        ({"kvplane_recompute_ratio": 0.5, "kvplane_recompute_layers": 1.5}, "kvplane_recompute_layers=1.5"),
        ({"kvplane_recompute_layers": 2}, "needs custom_params.kvplane_recompute_ratio"),
    ],
)
def test_bad_values_are_named(custom, fragment):
    error = recompute_param_error(custom)
    assert error is not None and fragment in error


@pytest.mark.parametrize("custom", [None, {}, {"other": 1}, {"kvplane_recompute_ratio": 0},
                                    {"kvplane_recompute_ratio": 0.9, "kvplane_recompute_layers": 0}])
def test_good_values_pass(custom):
    assert recompute_param_error(custom) is None


def test_request_override_beats_the_launch_default_and_layers_clamp():
    assert recompute_request({"kvplane_recompute_ratio": 0.5}, 4) == (0.5, 4)
    assert recompute_request({"kvplane_recompute_ratio": 0.5, "kvplane_recompute_layers": 9}, 4) == (0.5, 4)
    assert recompute_request({"kvplane_recompute_ratio": 0.5, "kvplane_recompute_layers": 1}, 4, 0.2, 3) == (0.5, 1)
    assert recompute_request({}, 4, 0.2, 3) == (0.2, 3)  # the launch's --kv-recompute-ratio / -layers
    assert recompute_request(None, 4, 0.2) == (0.2, 4)
    assert recompute_request({"kvplane_recompute_ratio": 0}, 4, 0.2) is None  # a request opts out
    assert recompute_request({}, 4) is None  # negative control: nothing asked, nothing recomputed
