"""A scheduler's failed start, written where the offline engine that started it reads it
(:class:`sglang_ext.engine_start_watch.EngineStartWatch`).

When ``KVPLANE_START_FAILURE_FILE`` is set (:func:`sglang_ext.offline_engine.layered_engine` sets
it for its engine's start only), a failed start appends one JSON line there (``type``, ``message``,
``kvplane``: whether kvplane raised it) and goes on as before (SGLang logs it and stops the
scheduler; the engine raises it in the caller's process):

* AROUND ``Scheduler.__init__`` (:func:`around_scheduler_init`, registered last of kvplane's hooks
  there, so it also sees the errors of kvplane's checks after SGLang's ``__init__``): any exception,
  raised on unchanged;
* :func:`sglang_ext.launch_refusal.refuse_launch`: a refusal, wherever in the process it is made
  (the hook check at ``publish``, before the scheduler is built, say).

Without the variable (``sglang.launch_server``) nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sglang_ext.settings import START_FAILURE_FILE_ENV

_PACKAGE = os.path.realpath(Path(__file__).parent) + os.sep


def record_start_failure(kind: str, message: str, *, kvplane: bool) -> None:
    """One line in ``KVPLANE_START_FAILURE_FILE`` when it is set (an unwritable file: nothing; the
    error still reaches SGLang's log)."""
    path = os.environ.get(START_FAILURE_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"type": kind, "message": message, "kvplane": kvplane}) + "\n")
    except OSError:
        pass


def _raised_by_kvplane(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback is in kvplane's package (both paths
    resolved: a checkout reached through a symlink is kvplane's too)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE)


def around_scheduler_init(original: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return original(*args, **kwargs)
    except Exception as exc:
        record_start_failure(type(exc).__name__, str(exc), kvplane=_raised_by_kvplane(exc))
        raise
