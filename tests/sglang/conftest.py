"""Fixtures for tests against real SGLang 0.5.23 on CPU: the tiny model and a vanilla server.

Servers are expensive on CPU (tens of seconds to start), so the vanilla server is
session-scoped and shared by every module that compares against it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from sglang_ext.testing.server import SGLangServer  # noqa: E402
from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model  # noqa: E402

PROMPTS: tuple[str, ...] = tuple(
    f"{head} {tail}"
    for head in (
        "The quick brown fox",
        "A cache keeps recent data",
        "Time to first token",
        "Once upon a time there was",
        "Colors: red orange",
    )
    for tail in ("jumps", "is fast", "measures how long", "and then")
)
"""20 greedy prompts used for token-identity checks."""

STARTUP_TIMEOUT_S = 600.0
"""Server start-up deadline: 30-200 s normally, longer when several servers start at once here."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Llama model, built once per session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), TinyModelSpec())


@contextmanager
def running_server(
    model_dir: Path, root: Path, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> Iterator[SGLangServer]:
    """An SGLang server on a free port, logging to ``root/server.log``, healthy on entry and
    stopped on exit (module fixtures wrap one)."""
    server = SGLangServer(
        model_dir,
        log_path=root / "server.log",
        extra_args=list(extra_args),
        env=dict(env or {}),
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vanilla_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """SGLang with kvplane installed (entry point) but --enable-layered-kv off."""
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("vanilla")) as server:
        yield server


def greedy(server: SGLangServer, prompt: str, max_new_tokens: int = 6) -> dict:
    """One greedy /generate call; returns the response dict."""
    return server.post(
        "/generate",
        {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}},
    )
