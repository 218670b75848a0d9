"""A short mixed workload for SGLang's OpenAI-compatible API, timed on the client side.

Shared by ``kvplane demo`` (what happened, TTFT/TBT attainment) and ``kvplane bench sglang``
(tokens/s): a few concurrent streaming and non-streaming requests of different prompt and
output lengths, greedy, ``ignore_eos`` so every run generates exactly the requested tokens.

Streaming requests record the arrival time of every chunk that carries text, so TTFT (first
text chunk) and the gaps a user sees between tokens (TBT, after pacing) are measured where the
user is. Non-streaming requests only have an end-to-end latency. Standard library only
(``urllib`` + threads): no SGLang or torch import.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from sglang_ext.pacing import SLO_PARAM

SHARED_HOST_ARGS: tuple[str, ...] = ("--mem-fraction-static", "0.3", "--sleep-on-idle")
"""Appended after the CPU recipe by the demo, the bench and the pacing e2e test.

* ``--mem-fraction-static 0.3``: on CPU SGLang sizes the KV cache from free *host* RAM measured
  before and after loading the weights; on a shared host other processes' allocations in between
  make that negative with the recipe's 0.05 ("Loaded weights leave no GPU memory for the KV
  cache"). ``--max-total-tokens`` still caps the pool, so a larger fraction only adds headroom.
* ``--sleep-on-idle``: an idle scheduler blocks in ``zmq.Poller.poll`` (woken by the next
  request) instead of spinning at ~25% of a core -- which matters with several servers up on a
  2-core host (the bench keeps three)."""

_WORDS = (
    "The quick brown fox jumps over the lazy dog. A cache keeps recent data close to the "
    "processor so that the next read is fast. Large language models generate one token at a "
    "time and keep the keys and values of every previous token in a key-value cache. When the "
    "cache does not fit in device memory, some layers can live in host memory. "
).split()


def prompt_of(words: int, seed: int = 0) -> str:
    """A deterministic prompt of ``words`` words drawn from the tiny model's corpus."""
    if words < 1:
        raise ValueError(f"words: {words} is out of range [1, inf)")
    return " ".join(_WORDS[(seed * 7 + i) % len(_WORDS)] for i in range(words))


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload."""

    name: str
    """Request id sent as ``rid`` (appears in the server's per-step stats)."""
    prompt_words: int
    """Prompt length in words (roughly 1-2 tokens each with the tiny tokenizer)."""
    max_tokens: int
    """Output tokens to generate (``ignore_eos``: exactly this many)."""
    stream: bool
    """Streaming (SSE) or a single JSON response."""
    chat: bool = False
    """``/v1/chat/completions`` instead of ``/v1/completions``."""
    start_s: float = 0.0
    """Send time relative to the workload start."""
    slo_tbt_ms: float | None = None
    """Per-request TBT SLO sent as ``custom_params.kvplane_slo_tbt_ms`` (None: policy default)."""

    def __post_init__(self) -> None:
        if self.prompt_words < 1:
            raise ValueError(f"prompt_words: {self.prompt_words} is out of range [1, inf)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: {self.max_tokens} is out of range [1, inf)")
        if not math.isfinite(self.start_s) or self.start_s < 0:
            raise ValueError(f"start_s: {self.start_s} is out of range [0, inf)")


@dataclass(frozen=True)
class RequestResult:
    """What the client saw for one request."""

    spec: RequestSpec
    """The request."""
    ok: bool
    """True when a complete response arrived."""
    error: str | None
    """Why not, when ``ok`` is False."""
    completion_tokens: int
    """Output tokens reported by the server (usage)."""
    prompt_tokens: int
    """Prompt tokens reported by the server (usage)."""
    sent_s: float
    """Send time, seconds since the workload start."""
    e2e_ms: float
    """Send to last byte."""
    ttft_ms: float | None
    """Send to first text chunk (streaming only)."""
    chunk_ms: tuple[float, ...] = field(default=())
    """Arrival of each text chunk, ms since send (streaming only)."""
    text: str = ""
    """Concatenated output text."""

    @property
    def gaps_ms(self) -> tuple[float, ...]:
        """Gaps between consecutive text chunks (the TBT the user saw)."""
        return tuple(b - a for a, b in zip(self.chunk_ms, self.chunk_ms[1:], strict=False))


def mixed_workload() -> tuple[RequestSpec, ...]:
    """The demo/bench workload: 6 requests, 3 streaming, short to long, staggered by 20 ms.

    The stagger is shorter than any request's life on any host, so the long ones always run
    together and the demo's default budget always has to pause one: with 0.2 s, a quiet 2-core
    host (5 ms decode steps) finished each request before the next arrived and nothing paused."""
    return (
        RequestSpec("s-short", 8, 24, stream=True, slo_tbt_ms=60.0),
        RequestSpec("n-long", 300, 24, stream=False, start_s=0.02),
        RequestSpec("s-chat", 40, 32, stream=True, chat=True, start_s=0.04),
        RequestSpec("n-short", 12, 16, stream=False, start_s=0.06),
        RequestSpec("s-long", 200, 40, stream=True, start_s=0.08, slo_tbt_ms=120.0),
        RequestSpec("n-chat", 60, 24, stream=False, chat=True, start_s=0.1),
    )


def _payload(spec: RequestSpec, model: str) -> tuple[str, dict]:
    body: dict = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": spec.stream,
        "rid": spec.name,
    }
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.slo_tbt_ms is not None:
        body["custom_params"] = {SLO_PARAM: spec.slo_tbt_ms}
    prompt = prompt_of(spec.prompt_words, seed=len(spec.name))
    if spec.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def _delta_text(event: dict, chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def run_one(
    base_url: str, spec: RequestSpec, model: str, t0: float, timeout_s: float
) -> RequestResult:
    """Send one request now and time it (``t0``: the workload start, ``time.monotonic()``)."""
    path, body = _payload(spec, model)
    req = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    sent = time.monotonic()
    chunks: list[float] = []
    text: list[str] = []
    usage: dict = {}
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            if spec.stream:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if event.get("usage"):
                        usage = event["usage"]
                    piece = _delta_text(event, spec.chat)
                    if piece:
                        chunks.append((time.monotonic() - sent) * 1000.0)
                        text.append(piece)
            else:
                body_out = json.loads(resp.read())
                usage = body_out.get("usage") or {}
                choice = (body_out.get("choices") or [{}])[0]
                text.append(
                    (choice.get("message") or {}).get("content") or choice.get("text") or ""
                )
    except (urllib.error.URLError, OSError, ValueError) as exc:
        detail = (
            exc.read().decode(errors="replace") if isinstance(exc, urllib.error.HTTPError) else ""
        )
        return RequestResult(
            spec,
            False,
            f"{type(exc).__name__}: {exc} {detail}".strip(),
            0,
            0,
            sent - t0,
            (time.monotonic() - sent) * 1000.0,
            None,
            tuple(chunks),
            "".join(text),
        )
    e2e = (time.monotonic() - sent) * 1000.0
    return RequestResult(
        spec,
        True,
        None,
        int(usage.get("completion_tokens") or 0),
        int(usage.get("prompt_tokens") or 0),
        sent - t0,
        e2e,
        chunks[0] if chunks else None,
        tuple(chunks),
        "".join(text),
    )


def run_workload(
    base_url: str,
    specs: Sequence[RequestSpec],
    *,
    model: str = "default",
    timeout_s: float = 120.0,
) -> list[RequestResult]:
    """Send every request at its ``start_s`` (one thread each); results in ``specs`` order."""
    results: list[RequestResult | None] = [None] * len(specs)
    t0 = time.monotonic()

    def worker(i: int, spec: RequestSpec) -> None:
        delay = spec.start_s - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)  # the arrival schedule itself, not a wait for a condition
        results[i] = run_one(base_url, spec, model, t0, timeout_s)

    threads = [
        threading.Thread(target=worker, args=(i, s), daemon=True) for i, s in enumerate(specs)
    ]
    for thread in threads:
        thread.start()
    deadline = t0 + timeout_s + max((s.start_s for s in specs), default=0.0) + 5.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    out: list[RequestResult] = []
    for spec, res in zip(specs, results, strict=True):
        if res is None:
            res = RequestResult(
                spec, False, f"no response within {timeout_s}s", 0, 0, 0.0, timeout_s * 1000, None
            )
        out.append(res)
    return out
