"""A --deadline-s / SIGTERM stop whose handler runs inside a finalizer: Python prints the
exception ("Exception ignored in ...") and drops it, and the check ran to its end as PASS -- once
in a full suite run under load (session 43). The stop is remembered and raised again at the next
phase edge (``gpu_check_deadline.raise_if_stopped``)."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from kvplane.cli import main
from sglang_ext.tools import gpu_check_overlap
from sglang_ext.tools.gpu_check_deadline import GpuCheckDeadline, deadline, raise_if_stopped

QUICK = ["gpu-check", "--device", "cpu", "--skip-tests", "--repeat", "1"]


class _StopInFinalizer:
    """Sends SIGTERM from its ``__del__``: the handler's exception is raised inside the finalizer."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # bytecodes for the handler to run in, still inside __del__
            pass


def test_a_stop_dropped_by_a_finalizer_still_stops_the_check(tmp_path, monkeypatch):
    """The overlap phase drops an object whose finalizer receives the SIGTERM: the report still
    fails with the ``deadline`` figure naming the core check, and later phases do not run.
    Control (below): without the re-raise the run went on."""
    def overlap_with_a_finalizer(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        _StopInFinalizer()  # created and finalized at once (refcount 0)
        return []

    dropped: list[type] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    monkeypatch.setattr(gpu_check_overlap.OverlapCheck, "run", overlap_with_a_finalizer)
    assert main([*QUICK, "--out-dir", str(tmp_path)]) == 1
    assert dropped == [GpuCheckDeadline]  # the finalizer did drop it
    [path] = tmp_path.glob("gpu-check-cpu-*.json")
    body = json.loads(path.read_text())
    figs = {f["key"]: f for f in body["figures"]}
    assert figs["deadline"]["status"] == "FAIL"
    assert figs["deadline"]["note"].startswith("stopped by signal SIGTERM after ")
    assert not any(k.startswith(("turnover.", "extend.")) for k in figs), sorted(figs)


def test_raise_if_stopped_raises_only_a_dropped_stop(monkeypatch):
    """Inside a deadline: nothing before a stop; after a stop dropped in a finalizer, the stop.
    Outside any deadline: nothing."""
    raise_if_stopped()
    monkeypatch.setattr(sys, "unraisablehook", lambda u: None)
    with deadline(None):
        raise_if_stopped()  # control: no stop yet
        _StopInFinalizer()
        with pytest.raises(GpuCheckDeadline, match="SIGTERM"):
            raise_if_stopped()
