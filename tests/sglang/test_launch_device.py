"""An unset ``--device`` is decided for the device SGLang will resolve it to (its ``get_device()``,
through ``compat.default_device``), not assumed to be CUDA: the launcher's hook
(``KvplanePlugin.around_from_cli_args``) on SGLang's real parser and ``get_device``, no launch."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from typing import Any

import pytest

from sglang_ext import compat, layered_kv_cli
from sglang_ext.context import PluginContext
from sglang_ext.plugin import KvplanePlugin


class _Resolved(Exception):
    """Raised by the stand-in for SGLang's ``from_cli_args`` body: the hook is done deciding."""


@pytest.fixture
def cpu_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """SGLang's ``SGLANG_USE_CPU_ENGINE`` as set or unset by the test (``is_cpu`` caches its
    answer: cleared before and after)."""
    is_cpu = compat.resolve("sglang.srt.utils.common.is_cpu")
    is_cpu.cache_clear()
    yield lambda on: (monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1") if on
                      else monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False), is_cpu.cache_clear())
    is_cpu.cache_clear()


def _hooked(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compat.resolve(compat.SERVER_ARGS.path).add_cli_args(parser)
    layered_kv_cli.add_arguments(parser)
    namespace = parser.parse_args(["--model-path", "m", "--enable-layered-kv", *argv])
    seen: list[argparse.Namespace] = []

    def original(cls: Any, ns: argparse.Namespace) -> Any:
        seen.append(ns)
        raise _Resolved

    saved = dict(os.environ)  # the hook exports the options for SGLang's processes: not for later tests
    try:
        with pytest.raises(_Resolved):
            KvplanePlugin(PluginContext()).around_from_cli_args(original, object, namespace)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return seen[0]


def test_an_unset_device_is_decided_for_the_device_sglang_resolves(cpu_engine: Any) -> None:
    """Scenario (plugin review, session 77): under ``SGLANG_USE_CPU_ENGINE=1`` SGLang resolves an
    unset ``--device`` to ``cpu``, but kvplane decided for CUDA (FlashInfer, ``--page-size 16``),
    which failed in the scheduler after the model loaded. Now the device is resolved first and the
    CPU's backend is implied. Controls: with no device SGLang can find, the decision stays CUDA's
    (SGLang refuses the launch itself); an explicit ``--device`` is kept."""
    cpu_engine(True)
    assert compat.default_device() == "cpu"
    ns = _hooked()
    assert ns.device == "cpu" and ns.attention_backend == "torch_native" and ns.page_size is None
    cpu_engine(False)
    if compat.default_device() is None:  # this host has no accelerator: SGLang finds nothing
        ns = _hooked()
        assert ns.device is None and ns.attention_backend == "flashinfer" and ns.page_size == 16
    cpu_engine(True)
    ns = _hooked("--device", "cuda")
    assert ns.device == "cuda" and ns.attention_backend == "flashinfer"
