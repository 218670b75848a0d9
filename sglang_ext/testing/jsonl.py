"""Reading a JSON-lines file another process is still appending to."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path


def read_jsonl(path: Path, start: int = 0) -> list[dict]:
    """The complete records of ``path`` from line ``start`` on ([] while it does not exist).

    A live server appends its stats one line per step; a reader racing a write can see the tail of
    the file without its newline. That last, unterminated line is not a record yet and is left for
    the next read (it failed CI stop 29 as a ``JSONDecodeError`` mid-test)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines()[start:] if line.strip()]


def wait_quiet(paths: Sequence[Path], quiet_s: float = 0.3, timeout_s: float = 30.0, poll_s: float = 0.05) -> bool:
    """Wait until none of ``paths`` has grown for ``quiet_s`` (at most ``timeout_s``); False on
    timeout. A missing file counts as empty."""
    def sizes() -> tuple[int, ...]:
        return tuple(p.stat().st_size if p.exists() else 0 for p in paths)

    deadline, last, since = time.monotonic() + timeout_s, sizes(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now = sizes()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return True
    return False


def read_jsonl_settled(path: Path, start: int = 0, quiet_s: float = 0.3, timeout_s: float = 30.0) -> list[dict]:
    """:func:`read_jsonl` once ``path`` has not grown for ``quiet_s`` (at most ``timeout_s``).

    A scheduler writes a step's ``$KVPLANE_STATS_FILE`` line in kvplane's AFTER hook of
    ``process_batch_result``, i.e. after that step's outputs went to the detokenizer: a client can
    hold its response before the line of the step that finished it is on disk."""
    wait_quiet((path,), quiet_s, timeout_s)
    return read_jsonl(path, start)
