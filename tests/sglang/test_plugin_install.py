"""A plugin that cannot install its hooks stops the process under ``--enable-layered-kv``.

SGLang's plugin loader (``sglang.srt.plugins.load_plugins``) logs a plugin's exception and goes
on. When kvplane's layered hooks failed half-way (a broken hook reference in session 82's work
did this: ``AttributeError`` in ``scheduler_hooks.register``), the server served with the hooks
registered before the failure -- the layered pool and step boundary, without the parked requests'
lifecycle hooks after it. Now the install refuses: one line naming the flag and the error, exit
status 2 (``SystemExit``, which the loader's ``except Exception`` does not swallow). Control: the
same failure with the flag off is never reached (nothing layered is installed), and a working
install returns.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sglang_ext import compat, settings
from sglang_ext.args import LayeredKVArgs
from sglang_ext.context import PluginContext
from sglang_ext.plugin import KvplanePlugin
from tests.sglang.conftest import FAULT_INJECT_DIR, fault_inject_path, result_line
from tests.sglang.test_launch_validation import forkable, launch, launch_forked


class _Registry:
    def __init__(self) -> None:
        self.paths: list[str] = []

    def register(self, path: str, hook: Any, kind: Any) -> None:
        self.paths.append(path)


_KINDS = type("HookType", (), {"AFTER": "after", "AROUND": "around", "BEFORE": "before"})


def _plugin(enabled: bool) -> KvplanePlugin:
    env = {settings.LAYERED_KV_ARGS_ENV: LayeredKVArgs(enable_layered_kv=enabled).to_json()}
    return KvplanePlugin(PluginContext.from_environ(env))


def test_a_half_installed_plugin_refuses_to_serve(monkeypatch, capsys):
    def broken(self: KvplanePlugin, registry: Any, kinds: Any) -> None:
        registry.register("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run", None, kinds.AROUND)
        raise AttributeError("module 'sglang_ext.parked_lifecycle' has no attribute 'around_x'")

    monkeypatch.setattr(KvplanePlugin, "_register_layered", broken)
    with pytest.raises(SystemExit) as stopped:
        _plugin(enabled=True).install(_Registry(), _KINDS)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "kvplane: --enable-layered-kv: kvplane could not install its SGLang hooks (AttributeError:" in err
    assert "around_x" in err
    _plugin(enabled=False).install(registry := _Registry(), _KINDS)  # flag off: never reached
    assert registry.paths and "get_next_batch_to_run" not in " ".join(registry.paths)
    monkeypatch.setattr(KvplanePlugin, "_register_layered", lambda self, registry, kinds: None)
    _plugin(enabled=True).install(_Registry(), _KINDS)  # a working install returns


# ----- SGLang's apply_hooks leaves a target out ---------------------------------------------------

_PROBE = """
import json, os, sys
sys.path.insert(0, {fault_dir!r})
from sglang_ext import compat, settings
from sglang_ext.args import LayeredKVArgs
os.environ[settings.LAYERED_KV_ARGS_ENV] = LayeredKVArgs(enable_layered_kv=True).to_json()
if {failing!r}:
    os.environ["KVPLANE_TEST_UNPATCHED_HOOK"] = {failing!r}
    import kvplane_unpatched_hook
    kvplane_unpatched_hook.patch(sys.modules[compat.HookRegistry.__module__])
if {early!r}:  # another plugin's hook on a kvplane target, applied before kvplane registers
    compat.HookRegistry.register({early!r}, lambda original, *a, **k: original(*a, **k), compat.HookType.AROUND)
    compat.HookRegistry.apply_hooks()
from sglang_ext.plugin import register
plugin = register()
compat.HookRegistry.apply_hooks()
import argparse
parser = argparse.ArgumentParser()
compat.resolve(compat.SERVER_ARGS.path).add_cli_args(parser)
result = {{"targets": plugin.hooks.targets, "unapplied": plugin.hooks.unapplied(compat.patched_hook_targets()),
           "offers_flag": any("--enable-layered-kv" in a.option_strings for a in parser._actions)}}
try:
    plugin.check_hooks_applied()
    result["exit"] = None
except SystemExit as stop:
    result["exit"] = stop.code
print("RESULT " + json.dumps(result))
"""


def _probe(failing: str = "", early: str = "") -> tuple[dict, str]:
    """Install the plugin (flag on) into SGLang's real ``HookRegistry`` in a fresh process (its
    patches are process-global), apply the hooks with ``failing`` made to fail (none: "") and,
    with ``early``, another hook on that target applied before kvplane registers; run the check
    and report whether SGLang's parser then offers ``--enable-layered-kv``."""
    script = _PROBE.format(fault_dir=str(FAULT_INJECT_DIR), failing=failing, early=early)
    proc = subprocess.run([sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=300, cwd=str(Path(__file__).parents[2]))
    result = result_line(proc.stdout)
    assert proc.returncode == 0 and result is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    return result, proc.stderr


@pytest.mark.sglang
def test_a_target_sglang_did_not_patch_is_named_and_refused():
    """SGLang's ``apply_hooks`` logs a target it cannot patch and patches the rest; the plugin
    names the one left out and refuses (exit status 2). Control: with nothing failing every target
    kvplane registered (the layered ones too) is in SGLang's patched set and the check passes."""
    whole, _ = _probe()
    assert len(whole["targets"]) > 30 and compat.SCHEDULER_CAN_SCHEDULE_LORA_REQ.path in whole["targets"]
    assert whole["unapplied"] == [] and whole["exit"] is None and whole["offers_flag"]
    failing = compat.SCHEDULER_CAN_SCHEDULE_LORA_REQ.path
    part, err = _probe(failing)
    assert f"Failed to apply hooks to {failing}" in err  # SGLang's own log line
    assert part["unapplied"] == [failing] and part["exit"] == 2 and part["offers_flag"]
    assert (f"kvplane: --enable-layered-kv: SGLang did not apply kvplane's hooks on 1 of "
            f"{len(whole['targets'])} targets ({failing};") in err


@pytest.mark.sglang
def test_a_target_patched_before_kvplane_registered_is_refused():
    """Another plugin whose ``apply_hooks`` ran before kvplane registered leaves kvplane's hook
    on that target out of its chain (SGLang skips a patched target), though the target is in
    SGLang's patched set: counted as not applied, and refused."""
    early = compat.SCHEDULER_RUN_BATCH.path
    late, err = _probe(early=early)
    assert late["unapplied"] == [early] and late["exit"] == 2, err[-3000:]
    assert f"patched before kvplane registered on it (another plugin applied SGLang's hooks early): {early};" in err


@pytest.mark.sglang
def test_without_the_parse_hook_the_flag_is_not_offered():
    """SGLang failing to patch ``ServerArgs.from_cli_args``, where kvplane reads its options: the
    parse would drop them and SGLang serve without kvplane though ``--enable-layered-kv`` was
    given. SGLang's parser is then not offered the flag (argparse rejects it), with one line
    saying why. (Control: the other tests' probes offer it.)"""
    failing = compat.SERVER_ARGS_FROM_CLI_ARGS.path
    part, err = _probe(failing)
    assert not part["offers_flag"] and part["unapplied"] == [failing]
    assert ("kvplane: SGLang did not apply kvplane's hook on ServerArgs.from_cli_args (its log says why); "
            "--enable-layered-kv is not offered") in err


@pytest.mark.sglang
def test_a_scheduler_sglang_left_a_hook_out_of_does_not_serve(tiny_model_dir, launch_zygote, tmp_path):
    """A real launch whose scheduler processes cannot patch one of kvplane's scheduler hooks (the
    test-only injector's fault; SGLang logs it and goes on): the scheduler refuses before loading
    the model, naming the target, and the launcher exits instead of serving. (Every other server
    test is the control: all hooks applied, the server serves.)"""
    failing = compat.SCHEDULER_CAN_SCHEDULE_LORA_REQ.path
    env = {"PYTHONPATH": fault_inject_path(), "KVPLANE_TEST_UNPATCHED_HOOK": failing}
    if forkable(launch_zygote, env):
        proc = launch_forked(launch_zygote, tiny_model_dir, {"unpatched": ((), env)}, tmp_path)["unpatched"]
    else:
        proc = launch(tiny_model_dir, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert f"Failed to apply hooks to {failing}" in output, output[-3000:]
    refusals = [line for line in output.splitlines() if "SGLang did not apply kvplane's hooks" in line]
    assert refusals and all("on 1 of" in line and f"({failing};" in line for line in refusals), output[-3000:]
    assert "Load weight" not in output and "fired up" not in output, output[-3000:]
