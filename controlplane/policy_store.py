"""The versioned policy store behind the policy-tuning API (get / update / watch).

* ``get()``: the current :class:`~controlplane.policy.Policy`.
* ``update(changes, token, actor)``: validate (``InvalidArgument`` naming the field and range),
  check the bearer token when one is configured (constant-time compare; ``Unauthenticated``
  otherwise), bump the version, write an audit record (structlog ``policy_updated`` with actor,
  old and new version, changed fields), and notify watchers.
* ``watch()``: a :class:`PolicyWatch` iterator yielding the current policy, then every new
  version in order; ``close()`` ends it (used by gRPC Watch streams).

Sessions read ``store.get`` at every report, so an update reaches live sessions at their next
step and its new version triggers a re-plan there.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import queue
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import structlog

from controlplane.api import InvalidArgument, PolicyUpdate, Unauthenticated
from controlplane.model import SchemaError
from controlplane.policy import Policy

log = structlog.get_logger(__name__)

AUDIT_HISTORY = 256
"""Audit records kept in memory (the log keeps all)."""

_CLOSED = object()


class PolicyWatch(Iterator[Policy]):
    """One watcher: the current policy first, then each new version. Thread-safe ``close()``."""

    def __init__(self, store: PolicyStore, first: Policy) -> None:
        self._store = store
        self._queue: queue.Queue[Any] = queue.Queue()
        self._queue.put(first)
        self._closed = False

    def __iter__(self) -> PolicyWatch:
        return self

    def __next__(self) -> Policy:
        item = self._queue.get()
        if item is _CLOSED:
            self._queue.put(_CLOSED)  # keep ending any further next()
            raise StopIteration
        return item

    def get(self, timeout_s: float | None = None) -> Policy | None:
        """The next version, or None on timeout or once closed."""
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if item is _CLOSED:
            self._queue.put(_CLOSED)
            return None
        return item

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop watching; a blocked ``next()`` returns (StopIteration)."""
        if not self._closed:
            self._closed = True
            self._store._unsubscribe(self)
            self._queue.put(_CLOSED)

    def _push(self, policy: Policy) -> None:
        self._queue.put(policy)


class PolicyStore:
    """Thread-safe, versioned holder of the live policy."""

    def __init__(self, policy: Policy | None = None, *, token: str | None = None) -> None:
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ValueError("token: must be a non-empty string when given")
        self._policy = policy or Policy()
        self._token = token.strip().encode() if token is not None else None
        self._lock = threading.Lock()
        self._watchers: list[PolicyWatch] = []
        self._audit: deque[PolicyUpdate] = deque(maxlen=AUDIT_HISTORY)

    @classmethod
    def from_files(
        cls, policy_file: str | Path | None = None, token_file: str | Path | None = None
    ) -> PolicyStore:
        """A store loaded from an optional policy file (YAML or JSON) and token file."""
        policy = load_policy_file(policy_file) if policy_file is not None else Policy()
        token = load_token_file(token_file) if token_file is not None else None
        return cls(policy, token=token)

    @property
    def auth_required(self) -> bool:
        """True when updates need the bearer token."""
        return self._token is not None

    def get(self) -> Policy:
        return self._policy

    def audit_log(self) -> list[PolicyUpdate]:
        """The most recent accepted updates, oldest first."""
        with self._lock:
            return list(self._audit)

    def update(
        self, changes: Mapping[str, Any], token: str | None = None, actor: str = "local"
    ) -> Policy:
        """Apply ``changes`` (validated) as a new version; see the module docstring."""
        self._check_token(token, actor)
        with self._lock:
            old = self._policy
            try:
                candidate = old.merged(changes)
            except SchemaError as exc:
                raise InvalidArgument(str(exc)) from exc
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"policy: {exc}") from exc
            if candidate == old:
                return old  # nothing changed: no new version, no audit record
            new = dataclasses.replace(candidate, version=old.version + 1)
            self._policy = new
            record = PolicyUpdate(policy=new, old_version=old.version, actor=actor)
            self._audit.append(record)
            for w in self._watchers:  # under the lock: every watcher sees versions in order
                w._push(new)
        new_d, old_d = new.to_dict(), old.to_dict()
        changed = sorted(k for k in new_d if k != "version" and new_d[k] != old_d[k])
        log.info(
            "policy_updated",
            actor=actor,
            old_version=old.version,
            new_version=new.version,
            changed=changed,
        )
        return new

    def watch(self) -> PolicyWatch:
        """Subscribe: yields the current policy, then every new version in order."""
        with self._lock:
            w = PolicyWatch(self, self._policy)
            self._watchers.append(w)
            return w

    def watcher_count(self) -> int:
        with self._lock:
            return len(self._watchers)

    def _unsubscribe(self, w: PolicyWatch) -> None:
        with self._lock:
            if w in self._watchers:
                self._watchers.remove(w)

    def _check_token(self, token: str | None, actor: str) -> None:
        if self._token is None:
            return
        given = token.strip().encode() if isinstance(token, str) else b""
        if not hmac.compare_digest(given, self._token):
            log.warning("policy_update_rejected", actor=actor, reason="bad or missing token")
            raise Unauthenticated("policy update requires a valid bearer token")


def load_policy_file(path: str | Path) -> Policy:
    """A policy from a YAML (``.yaml``/``.yml``) or JSON file; errors name the file and field."""
    p = Path(path)
    text = _read_text(p, "policy file")
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # json.JSONDecodeError / yaml.YAMLError
        raise InvalidArgument(f"policy file {str(p)!r}: not valid YAML/JSON ({_parse_error(exc)})") from exc
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise InvalidArgument(
            f"policy file {str(p)!r}: expected an object at the top level, got {type(data).__name__}"
        )
    try:
        return Policy.from_dict(data)
    except SchemaError as exc:
        raise InvalidArgument(f"policy file {str(p)!r}: {exc}") from exc


def load_token_file(path: str | Path) -> str:
    """The bearer token in ``path`` (surrounding whitespace stripped); errors if empty or if any
    character is outside printable ASCII (0x20-0x7E: spaces inside are taken, as gRPC metadata
    and the server's ``Bearer`` parse take them): gRPC metadata cannot carry a line break, a tab,
    a control or non-ASCII character, so every policy write would fail with an ``Invalid
    metadata`` naming nothing."""
    p = Path(path)
    token = _read_text(p, "token file").strip()
    if not token:
        raise InvalidArgument(f"token file {str(p)!r}: is empty (or whitespace only)")
    bad = next((i for i, ch in enumerate(token) if not "\x20" <= ch <= "\x7e"), None)
    if bad is not None:
        raise InvalidArgument(
            f"token file {str(p)!r}: character {bad + 1} of the token is {_char_class(token[bad])}; "
            "a token is one line of printable ASCII (0x20-0x7E), which gRPC metadata "
            "can carry (make one with `openssl rand -hex 32`; `openssl rand -base64 64` wraps onto two lines)"
        )
    return token


def _char_class(ch: str) -> str:
    """What a character a token cannot hold is, in words (the token itself is never echoed)."""
    if ch in "\r\n":
        return "a line break (the token spans several lines)"
    if ch == "\t":
        return "a tab"
    if not ch.isascii():
        return f"a non-ASCII character (U+{ord(ch):04X})"
    return f"a control character (0x{ord(ch):02X})"


def _read_text(p: Path, what: str) -> str:
    try:
        return p.read_text()
    except OSError as exc:
        raise InvalidArgument(f"{what} {str(p)!r}: cannot read ({exc.strerror})") from exc
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{what} {str(p)!r}: not UTF-8 text (byte {exc.start})") from exc


def _parse_error(exc: Exception) -> str:
    """A parser's complaint in one line: YAML's multi-line report as its problem and position."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:  # yaml.MarkedYAMLError
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())
