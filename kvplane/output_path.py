"""Output paths the CLI checks before doing any work: a run that ends by writing to a directory
it cannot create lost its results and ended in a traceback (``kvplane demo --json``,
``kvplane sim run --json``, ``kvplane sim trace --out``, ``kvplane sim reproduce --out``)."""

from __future__ import annotations

import os
from pathlib import Path


def output_path_error(path: Path, flag: str, *, directory: bool = False) -> str | None:
    """None when ``path`` (a file, or with ``directory`` a folder) can be written: its folder is
    created if missing; else one line naming the flag, the path and why."""
    folder = path if directory else path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{flag}={str(path)!r}: cannot create {str(folder)!r} ({exc.strerror or exc})"
    if not folder.is_dir():
        return f"{flag}={str(path)!r}: {str(folder)!r} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{flag}={str(path)!r}: {str(folder)!r} is not writable"
    if not directory and path.is_dir():
        return f"{flag}={str(path)!r} is a directory"
    return None
