"""The suite's hypothesis draws no constants from the project's modules (``tests/conftest.py``):
a derandomized test draws the same examples whatever else the run imported."""

from hypothesis.internal.conjecture import providers

import sglang_ext.tools.gpu_check_graph  # noqa: F401 - a project module with literals of its own


def test_no_local_constants_reach_the_draws():
    got = providers._get_local_constants()
    assert not got.integers and not got.floats and not got.strings
    # control: hypothesis' own collection finds this project's literals
    found = providers._kvplane_local_constants()
    assert len(found.integers) + len(found.floats) + len(found.strings) > 0
