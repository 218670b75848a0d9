"""Every request kind a layered server answers, and the check that a bad per-request SLO is a 400 on each.

Shared by the server tests with ``--kv-pacing off`` (``test_request_slo_server.py``) and on
(``test_pacing_e2e.py``): one server per configuration, every kind and value sent to it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from sglang_ext.request_slo import SLO_PARAM
from sglang_ext.testing.server import SGLangServer

BAD_SLO_VALUES: tuple[Any, ...] = (-5, 0, "NaN", "fast", True, [150], {"ms": 150})
"""Issue 17's hostile values of ``custom_params.kvplane_slo_tbt_ms``."""
VALID_SLO_MS = 150
"""A valid override: every kind must still serve it."""
PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
KINDS: tuple[tuple[str, bool], ...] = tuple((path, stream) for path in PATHS for stream in (False, True))
"""(endpoint, streaming) pairs."""
MAX_TOKENS = 4


def request_body(path: str, stream: bool, slo: Any) -> dict:
    """A small greedy request of kind (path, stream) carrying ``slo`` as its SLO override."""
    custom = {SLO_PARAM: slo}
    if path == "/generate":
        return {
            "text": "hello",
            "stream": stream,
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0.0, "custom_params": custom},
        }
    body: dict[str, Any] = {"model": "default", "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream,
                            "custom_params": custom}
    if path == "/v1/completions":
        body["prompt"] = "hello"
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    return body


def send(server: SGLangServer, path: str, body: dict, timeout_s: float = 120.0) -> tuple[int, str]:
    """POST ``body``; the HTTP status and the whole response text (a stream read to its end)."""
    req = urllib.request.Request(
        server.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def served_tokens(path: str, stream: bool, text: str) -> bool:
    """Whether a 200 response carries generated output and no error event."""
    if not stream:
        data = json.loads(text)
        if path == "/generate":
            return data["meta_info"]["completion_tokens"] == MAX_TOKENS
        return data["usage"]["completion_tokens"] == MAX_TOKENS
    events = [line[len("data:"):].strip() for line in text.splitlines() if line.startswith("data:")]
    payloads = [json.loads(e) for e in events if e != "[DONE]"]
    return bool(payloads) and events[-1] == "[DONE]" and not any("error" in p for p in payloads)


def in_json(message: str) -> str:
    """``message`` as it appears inside a JSON response body (quotes escaped: the value is named
    in the client's JSON spelling, ``"fast"``)."""
    return json.dumps(message)[1:-1]


def assert_slo_checked_on_every_kind(server: SGLangServer) -> None:
    """Each bad value is HTTP 400 naming the field and the value on every kind; the valid one is
    served (200, generated tokens) on every kind, so the 400s are not a broken endpoint."""
    wrong: list[str] = []
    for path, stream in KINDS:
        for value in BAD_SLO_VALUES:
            status, text = send(server, path, request_body(path, stream, value))
            if status != 400 or in_json(f"custom_params.{SLO_PARAM}={json.dumps(value)}") not in text:
                wrong.append(f"{path} stream={stream} {value!r}: {status} {text[:300]}")
        status, text = send(server, path, request_body(path, stream, VALID_SLO_MS))
        if status != 200 or not served_tokens(path, stream, text):
            wrong.append(f"{path} stream={stream} valid {VALID_SLO_MS}: {status} {text[:300]}")
    assert not wrong, "\n".join(wrong) + "\n" + server.log_tail()
