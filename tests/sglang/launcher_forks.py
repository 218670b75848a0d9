"""Run many refused ``python -m sglang.launch_server`` launches on one import of SGLang.

``python launcher_forks.py CASES.json``: CASES is a list of ``{"argv": [...], "out": PATH,
"err": PATH, "code": PATH}``. SGLang is imported once here (with its plugins, kvplane among
them: what ``import sglang`` does in every launcher), then each case is a fork that runs the
launcher module as ``__main__`` with the case's ``sys.argv`` (``runpy``: the code
``python -m sglang.launch_server ARGV`` runs), its stdout and stderr in the case's files and its
exit status in ``code``. A fork that is still running after :data:`CASE_TIMEOUT_S` (a case that
was not refused and went on to start a server) is killed and its status recorded as ``timeout``.

Why: a launcher spends ~25 s of CPU importing SGLang before it can refuse anything, so one
process per case cost ~6 minutes of the suite. The environment is the parent's: kvplane reads its
``KVPLANE_*`` variables when the plugin loads, so the variable cases launch fresh processes
(``test_launch_validation.launch``), as do the cases that need a live server beside them.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

CASE_TIMEOUT_S = 120.0


def _child(case: dict) -> int:
    out = os.open(case["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(case["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = ["sglang.launch_server", *case["argv"]]
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception in a launcher
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _wait(pid: int) -> str:
    deadline = time.monotonic() + CASE_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status))
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout"


def main(cases_file: str) -> int:
    with open(cases_file) as f:
        cases = json.load(f)
    import sglang.launch_server  # noqa: F401 - the import every fork shares
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what the launcher's __main__ does first (idempotent): the hooks' targets import

    for case in cases:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_child(case))
        with open(case["code"], "w") as f:
            f.write(_wait(pid))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
