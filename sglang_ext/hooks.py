"""KV residency hooks: a small public API to subscribe to per-request, per-layer KV events.

Primitives:

- :class:`ResidencyEventKind` -- what happened: ``allocated`` (a request's first KV
  blocks), ``extended`` (more blocks for a running request: a later prefill chunk or a
  decode step), ``checkpointed`` (blocks of a request handed to the radix tree, so
  other requests may share them), ``evicted`` (the tree dropped blocks; they are freed
  right after), ``offloaded`` / ``loaded`` (layers of blocks moved device->host /
  host->device), ``paused`` / ``resumed`` (a request left / re-entered the running
  batch keeping its KV), ``freed`` (blocks returned to the allocator).
- :class:`ResidencyEvent` -- one immutable event.
- :class:`ResidencyHooks` -- per-cache hub: ``subscribe(callback, kinds=...)`` returns a
  :class:`Subscription` (``close()`` to stop); ``emit(...)`` delivers synchronously, in
  order, on the scheduler thread. A subscriber that raises is logged and counted
  (``subscriber_errors``) and never breaks the step that emitted the event.
- :class:`JsonlEventWriter` -- a subscriber that appends one JSON object per event to a file.

A *block* is one page of SGLang's KV slot space (``slot // page_size``; with page size
1 a block is one token slot). ``layers`` is ``None`` when an event covers every layer
(allocation, tree hand-over, eviction, free) and the affected layer ids otherwise
(offload/load). Invariant the tests check: every block id is freed exactly once per
allocation, and only after it was allocated.

Pure Python (no torch / SGLang import): subscribers run anywhere.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO

import structlog

log = structlog.get_logger(__name__)


class ResidencyEventKind(StrEnum):
    """What happened to a set of KV blocks."""

    ALLOCATED = "allocated"
    EXTENDED = "extended"
    CHECKPOINTED = "checkpointed"
    EVICTED = "evicted"
    OFFLOADED = "offloaded"
    LOADED = "loaded"
    PAUSED = "paused"
    RESUMED = "resumed"
    FREED = "freed"


@dataclass(frozen=True)
class ResidencyEvent:
    """One residency event, emitted on the scheduler thread of one TP rank."""

    seq: int
    """Per-hub sequence number, starting at 0, gap-free."""
    kind: ResidencyEventKind
    """What happened."""
    blocks: tuple[int, ...]
    """Block (page) ids concerned, in SGLang's KV slot space."""
    rid: str | None = None
    """Request id when the event belongs to one request (None for tree-owned blocks)."""
    layers: tuple[int, ...] | None = None
    """Layer ids concerned; None means every layer."""
    time_s: float = 0.0
    """``time.monotonic()`` when the event was emitted."""

    def to_dict(self) -> dict:
        """JSON-ready form (``kind`` as its string value)."""
        return {
            "seq": self.seq,
            "kind": self.kind.value,
            "blocks": list(self.blocks),
            "rid": self.rid,
            "layers": None if self.layers is None else list(self.layers),
            "time_s": self.time_s,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ResidencyEvent:
        """Inverse of :meth:`to_dict`."""
        layers = data.get("layers")
        return cls(
            seq=int(data["seq"]),
            kind=ResidencyEventKind(data["kind"]),
            blocks=tuple(int(b) for b in data["blocks"]),
            rid=data.get("rid"),
            layers=None if layers is None else tuple(int(x) for x in layers),
            time_s=float(data.get("time_s", 0.0)),
        )


Callback = Callable[[ResidencyEvent], None]


class Subscription:
    """Handle returned by :meth:`ResidencyHooks.subscribe`; ``close()`` unsubscribes."""

    def __init__(self, hooks: ResidencyHooks, callback: Callback, kinds: frozenset | None):
        self._hooks = hooks
        self.callback = callback
        self.kinds = kinds

    def wants(self, kind: ResidencyEventKind) -> bool:
        """Whether this subscription receives events of ``kind``."""
        return self.kinds is None or kind in self.kinds

    def close(self) -> None:
        """Stop receiving events (idempotent)."""
        self._hooks._remove(self)


class ResidencyHooks:
    """Fan-out of residency events to subscribers, in emission order."""

    def __init__(self) -> None:
        self._subscriptions: list[Subscription] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self.subscriber_errors = 0
        """Number of subscriber calls that raised (each one logged)."""
        self._wanted: frozenset[ResidencyEventKind] = frozenset()
        """Kinds some subscriber receives (rebuilt on subscribe / remove: :meth:`wants` is asked
        per decode token)."""

    def _rebuild_wanted(self) -> None:
        every = frozenset(ResidencyEventKind)
        self._wanted = frozenset().union(*(every if s.kinds is None else s.kinds for s in self._subscriptions))

    def subscribe(
        self, callback: Callback, kinds: Iterable[ResidencyEventKind | str] | None = None
    ) -> Subscription:
        """Call ``callback(event)`` for every event (or only those of ``kinds``)."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        wanted = None
        if kinds is not None:
            allowed = [k.value for k in ResidencyEventKind]
            try:
                wanted = frozenset(ResidencyEventKind(k) for k in kinds)
            except ValueError as exc:
                raise ValueError(f"unknown event kind in {list(kinds)!r}; allowed: {allowed}") from exc
        sub = Subscription(self, callback, wanted)
        with self._lock:
            self._subscriptions.append(sub)
            self._rebuild_wanted()
        return sub

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subscriptions:
                self._subscriptions.remove(sub)
                self._rebuild_wanted()

    def wants(self, kind: ResidencyEventKind) -> bool:
        """Whether any subscriber receives ``kind`` (emitters skip building unwanted events)."""
        return kind in self._wanted

    @property
    def has_subscribers(self) -> bool:
        """Whether anyone listens (emitters may skip building events otherwise)."""
        return bool(self._subscriptions)

    def emit(
        self,
        kind: ResidencyEventKind,
        blocks: Iterable[int],
        *,
        rid: str | None = None,
        layers: Iterable[int] | None = None,
    ) -> ResidencyEvent | None:
        """Deliver one event to the subscribers that want it; returns it (None if empty)."""
        block_tuple = tuple(map(int, blocks))  # C-level: a turnover frees thousands of blocks
        if not block_tuple and kind not in (ResidencyEventKind.PAUSED, ResidencyEventKind.RESUMED):
            return None
        event = ResidencyEvent(
            seq=next(self._seq),
            kind=kind,
            blocks=block_tuple,
            rid=rid,
            layers=None if layers is None else tuple(int(x) for x in layers),
            time_s=time.monotonic(),
        )
        for sub in list(self._subscriptions):
            if not sub.wants(kind):
                continue
            try:
                sub.callback(event)
            except Exception:  # a subscriber must never break a scheduler step
                self.subscriber_errors += 1
                log.exception("residency_subscriber_failed", kind=kind.value, seq=event.seq)
        return event


class JsonlEventWriter:
    """Subscriber appending each event as one JSON line to ``path`` (flushed per event)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def __call__(self, event: ResidencyEvent) -> None:
        self._file.write(json.dumps(event.to_dict()) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def read_jsonl_events(path: str | Path) -> list[ResidencyEvent]:
    """Load the events a :class:`JsonlEventWriter` wrote (a torn last line is skipped)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    events = []
    for index, line in enumerate(lines):
        try:
            events.append(ResidencyEvent.from_dict(json.loads(line)))
        except json.JSONDecodeError:
            if index != len(lines) - 1:  # only a write in progress may be torn
                raise
    return events
