"""The exception that stops a launch kvplane refuses, and :func:`refuse_launch`, which raises it."""

from __future__ import annotations

import sys
from typing import NoReturn


class LaunchRefusal(SystemExit):
    """A launch ``--enable-layered-kv`` cannot serve: exit status 2 (a usage error, as argparse's),
    its one line (``kvplane: <message>``) already on stderr. A ``SystemExit``, so SGLang's plugin
    loader, which logs and swallows a plugin's ``Exception``, does not swallow it; the offline
    engine (:func:`sglang_ext.offline_engine.layered_engine`) turns it into a ``ValueError``
    carrying :attr:`message`."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message
        """What was refused, naming the option or the feature (without the ``kvplane:`` prefix)."""


def refuse_launch(message: str) -> NoReturn:
    """Stop the launch before any subprocess starts: one line on stderr (``kvplane: <message>``),
    then :class:`LaunchRefusal` (exit status 2, as argparse's and ``kvplane serve``'s usage errors)."""
    from sglang_ext.scheduler_start_failure import record_start_failure  # an offline engine's start

    print(f"kvplane: {message}", file=sys.stderr)
    record_start_failure("LaunchRefusal", message, kvplane=True)
    raise LaunchRefusal(message)
