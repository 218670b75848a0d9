"""The launch zygote (``sglang_ext/testing/zygote_server.py``): what it imports, which launches it
takes, that a launch it forks behaves as a fresh launcher's, and that a server it forked leaves no
process behind.

The servers themselves -- outputs, logprobs, negative controls with the fault injector -- are the
other server modules' tests: all but ``test_layered_server.py`` (a fresh process, compared with
the zygote's vanilla server) run on servers forked from the session's zygote.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from sglang_ext.testing.launch_zygote import LaunchZygote
from sglang_ext.testing.server import SGLangServer, cpu_env
from sglang_ext.tools.sglang_bench import group_processes
from tests.sglang.conftest import FAULT_INJECT_DIR, TEST_DTYPE_ARGS, greedy

pytestmark = pytest.mark.sglang


@pytest.fixture
def zygote(launch_zygote: LaunchZygote | None) -> LaunchZygote:
    if launch_zygote is None:
        pytest.skip("no launch zygote in this session (--sglang-fresh-launch)")
    return launch_zygote


def _env(**changes: str | None) -> dict[str, str]:
    """The environment a test server gets (``SGLangServer.spawn``), with ``changes``."""
    env = {**os.environ, **cpu_env()}
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def test_the_zygote_imports_sglang_but_not_kvplane_nor_what_reads_the_free_variables(zygote: LaunchZygote) -> None:
    """What makes a forked launcher's plugin load as a fresh one's: SGLang's launcher and process
    entry modules are imported, kvplane is not (beyond the harness modules the zygote runs and
    the SGLang-free ``compat`` data), nor ``prometheus_client`` (it reads
    ``PROMETHEUS_MULTIPROC_DIR`` when imported). (SGLang reads the two free ``SGLANG_*`` variables
    inside the functions that use them, ``find_nccl_library`` and the CPU thread binding.)"""
    modules = set(zygote.imported_modules())
    assert {"sglang.launch_server", "sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager",
            "sglang.srt.models.registry", "sglang.srt.models.llama"} <= modules  # the model modules too
    kvplane = sorted(m for m in modules if m.split(".")[0] in ("sglang_ext", "controlplane", "kernels"))
    harness = {"sglang_ext", "sglang_ext.testing", "sglang_ext.testing.zygote_child", "sglang_ext.testing.zygote_server"}
    assert [m for m in kvplane if m not in harness and not m.startswith("sglang_ext.compat")] == []
    assert "prometheus_client" not in modules
    assert "sglang.srt.plugins" in modules and "sglang_ext.plugin" not in modules  # no plugin loaded


def test_launches_it_can_reproduce_and_those_it_cannot(zygote: LaunchZygote) -> None:
    """Free variables and extra ``PYTHONPATH`` directories go through the zygote; a variable read
    at import, a ``PYTHONPATH`` without the zygote's own entries or another interpreter start a
    fresh process, and the reason names it."""
    assert zygote.why_not(_env(), sys.executable) is None
    assert zygote.why_not(_env(KVPLANE_TEST_CORRUPT_FILE="/x", TRITON_INTERPRET="1",
                               PROMETHEUS_MULTIPROC_DIR="/p"), sys.executable) is None
    base = os.environ.get("PYTHONPATH", "")
    extra = os.pathsep.join(d for d in (str(FAULT_INJECT_DIR), base) if d)
    assert zygote.why_not(_env(PYTHONPATH=extra), sys.executable) is None
    assert zygote._site_dirs(_env(PYTHONPATH=extra)) == [str(FAULT_INJECT_DIR)]
    reason = zygote.why_not(_env(OMP_NUM_THREADS="2"), sys.executable)
    assert reason is not None and "OMP_NUM_THREADS" in reason
    reason = zygote.why_not(_env(SGLANG_SOMETHING="1"), sys.executable)
    assert reason is not None and "SGLANG_SOMETHING" in reason
    reason = zygote.why_not(_env(), "/usr/bin/python3")
    assert reason is not None and "interpreter" in reason
    if base:
        reason = zygote.why_not(_env(PYTHONPATH=str(FAULT_INJECT_DIR)), sys.executable)
        assert reason is not None and "PYTHONPATH" in reason


def test_a_forked_launcher_exits_as_a_fresh_one_would(zygote: LaunchZygote, tmp_path: Path) -> None:
    """An unknown flag: status 2 and argparse's message, in the launch's own log; ``--help``:
    status 0 and the flags kvplane's plugin adds (the plugin loaded in the fork)."""
    bad = zygote.launch(["--model-path", "m", "--no-such-flag"], _env(), tmp_path / "bad.log", os.getcwd())
    assert bad.wait(timeout=120) == 2
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "bad.log").read_text()
    good = zygote.launch(["--help"], _env(), tmp_path / "help.log", os.getcwd())
    assert good.wait(timeout=120) == 0
    text = (tmp_path / "help.log").read_text()
    assert "--enable-layered-kv" in text and "error:" not in text


def _group(pgid: int) -> dict[int, int]:
    """pid -> parent pid of the live, not yet reaped processes in process group ``pgid``."""
    return {pid: ppid for pid, (state, ppid, _) in group_processes(pgid).items() if state != "Z"}


def test_a_forked_servers_processes_die_with_its_launcher(zygote: LaunchZygote, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """A forked server's scheduler and detokenizer are children of the zygote's fork server,
    in the launcher's process group (``SGLangServer.stop``'s ``killpg`` reaches them). SIGKILL of
    the launcher alone ends them too: SGLang's ``PR_SET_PDEATHSIG`` watches their real parent,
    the fork server, which lives on; the adoption's watch of the launcher and the zygote's kill
    of the exited launcher's group do it. The server served a request first (control: it was a
    working server)."""
    server = SGLangServer(tiny_model_dir, log_path=tmp_path / "server.log", extra_args=TEST_DTYPE_ARGS,
                          startup_timeout_s=600, zygote=zygote)
    server.start()
    try:
        assert server.launched_by == "zygote"
        assert greedy(server, "The quick brown fox", 4)["output_ids"]
        launcher = server._proc.pid
        members = _group(launcher)
        children = {pid: ppid for pid, ppid in members.items() if pid != launcher}
        assert len(children) >= 2, members  # scheduler, detokenizer
        assert all(ppid != launcher for ppid in children.values()), "not forked by the fork server"
        os.kill(launcher, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _group(launcher) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group(launcher) == {}, "processes outlived their launcher"
    finally:
        server.stop()
