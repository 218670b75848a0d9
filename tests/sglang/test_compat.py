"""sglang_ext.compat: every SGLang target kvplane touches exists with the shape kvplane relies on.

Each :data:`~sglang_ext.compat.TARGETS` entry is resolved in the installed SGLang and checked with
``inspect`` (parameter names, keyword parameters, attributes, registry keys) without starting a
server. Negative controls show the checker and the version check fail on a wrong expectation.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_ext import compat
from sglang_ext.compat import TARGETS, Target, UnsupportedSGLangVersion, check_target, check_version
from sglang_ext.compat import version as compat_version

REPO = Path(__file__).resolve().parents[2]
SGLANG_EXT = REPO / "sglang_ext"
PENDING_SWITCH: frozenset[str] = frozenset()
"""Files allowed to import SGLang directly (none: everything goes through ``sglang_ext.compat``)."""
_DIRECT_SGLANG = re.compile(r"^\s*(?:from|import)\s+sglang(?:\.|\s|$)|[\"']sglang\.(?:srt|launch_server)\b", re.M)

needs_sglang = pytest.mark.sglang


@needs_sglang
@pytest.mark.parametrize("target", TARGETS, ids=[t.path.removeprefix("sglang.srt.") for t in TARGETS])
def test_target_exists_with_expected_shape(target: Target) -> None:
    """The target resolves in the installed SGLang; its leading parameters, keyword parameters,
    attributes and keys are the ones kvplane uses."""
    assert check_target(target) == []


@needs_sglang
def test_installed_sglang_is_the_supported_version() -> None:
    """The environment runs the one SGLang release the surface was read off."""
    assert check_version().split("+")[0] == compat.SUPPORTED_VERSION


@needs_sglang
def test_lazy_names_resolve_to_sglang_objects() -> None:
    """Every SGLang object the package exports lazily is the object at its target's path."""
    for name in compat.LAZY_NAMES:
        assert getattr(compat, name) is compat.resolve(compat._LAZY[name].path)
    assert "torch_native" in compat.attention_backends()


@needs_sglang
def test_checker_reports_wrong_expectations_on_sglang_targets() -> None:
    """Negative control on real targets: a renamed parameter, a missing attribute, a missing
    method and a missing registry key are each reported by name."""
    wrong_params = dataclasses.replace(compat.SCHEDULER_RUN_BATCH, params=("self", "batches"))
    [problem] = check_target(wrong_params)
    assert "leading parameters are ('self', 'batch'), kvplane expects ('self', 'batches')" in problem
    missing_attr = dataclasses.replace(compat.SCHEDULER, attrs=("waiting_queue", "waiting_queue_v2"))
    assert check_target(missing_attr) == [f"{compat.SCHEDULER.path}: no attribute 'waiting_queue_v2'"]
    missing_method = Target(compat.SCHEDULER.path + ".run_batch_v2", params=("self",))
    [problem] = check_target(missing_method)
    assert "cannot be resolved" in problem and "run_batch_v2" in problem
    missing_key = dataclasses.replace(compat.ATTENTION_BACKEND_FACTORIES, keys=("torch_native", "no_such_backend"))
    assert check_target(missing_key) == [f"{compat.ATTENTION_BACKEND_FACTORIES.path}: no key 'no_such_backend'"]


def test_checker_reports_wrong_expectations_on_stdlib_targets() -> None:
    """The checker itself, on the standard library: found things pass, each wrong expectation is
    one named problem (also where SGLang is not installed)."""
    assert check_target(Target("json.dumps", params=("obj",), keyword=("indent", "sort_keys"))) == []
    assert check_target(Target("json.JSONDecoder", attrs=("decode", "object_hook"))) == []  # self.x = in __init__
    [problem] = check_target(Target("json.dumps", params=("object",)))
    assert problem.startswith("json.dumps: leading parameters are ('obj',), kvplane expects ('object',)")
    [problem] = check_target(Target("json.dumps", keyword=("pretty",)))
    assert problem.startswith("json.dumps: no parameter 'pretty'")
    assert check_target(Target("json.JSONDecoder", attrs=("strict_v2",))) == ["json.JSONDecoder: no attribute 'strict_v2'"]
    [problem] = check_target(Target("json.no_such_function"))
    assert problem.startswith("json.no_such_function: cannot be resolved")
    assert check_target(Target("string.whitespace", keys=("a",))) == ["string.whitespace: expected a dict, got str"]
    [problem] = check_target(Target("no_such_module_kvplane.thing"))
    assert "cannot be resolved" in problem


def test_version_check_names_supported_and_installed_versions(monkeypatch) -> None:
    """A different SGLang release is refused with both versions in the message; a local build
    of the supported release is accepted; a missing SGLang is named as such."""
    with pytest.raises(UnsupportedSGLangVersion, match=r"SGLang 0\.5\.24 is installed, but kvplane supports SGLang 0\.5\.23"):
        check_version("0.5.24", supported="0.5.23")
    assert check_version("0.5.23+cpu", supported="0.5.23") == "0.5.23+cpu"
    monkeypatch.setattr(compat_version, "installed_version", lambda: None)
    with pytest.raises(UnsupportedSGLangVersion, match=r"SGLang 0\.5\.23 is required, but no 'sglang'"):
        check_version(supported="0.5.23")


@needs_sglang
def test_register_refuses_an_unsupported_version_before_installing_anything(monkeypatch) -> None:
    """register() raises naming both versions and registers no hook (SGLang logs the error)."""
    from sglang_ext import plugin

    registered: list[str] = []

    class Recorder:
        @staticmethod
        def register(target: str, *args: object, **kwargs: object) -> None:
            registered.append(target)

    monkeypatch.setattr(compat_version, "installed_version", lambda: "0.6.0")
    monkeypatch.setattr(compat, "HookRegistry", Recorder, raising=False)
    with pytest.raises(UnsupportedSGLangVersion, match=r"SGLang 0\.6\.0 is installed, but kvplane supports SGLang 0\.5\.23"):
        plugin.register()
    assert registered == []


def test_only_compat_names_sglang() -> None:
    """Outside ``sglang_ext/compat`` no module imports SGLang or names an SGLang dotted path
    (the two files being rewritten excepted, until they switch)."""
    offenders = sorted(
        str(path.relative_to(REPO))
        for path in SGLANG_EXT.rglob("*.py")
        if "compat" not in path.relative_to(SGLANG_EXT).parts[:1]
        and path.name not in PENDING_SWITCH
        and _DIRECT_SGLANG.search(path.read_text())
    )
    assert offenders == []


def test_every_target_names_existing_users() -> None:
    """Each target's ``used_by`` names modules that exist in ``sglang_ext``."""
    for target in TARGETS:
        assert target.used_by, target.path
        for user in target.used_by:
            path = SGLANG_EXT / (user.replace(".", "/") + ".py")
            assert path.exists(), f"{target.path}: used_by {user!r} is not a module"


def test_plugin_args_and_compat_import_without_torch_or_sglang() -> None:
    """plugin.py, args.py and the compat package stay light at import (loaded in every process)."""
    code = (
        "import sys; import sglang_ext.plugin, sglang_ext.args, sglang_ext.compat; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang')); "
        "assert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@needs_sglang
def test_replica_rank_reads_sglangs_dp_rank_and_refuses_to_guess() -> None:
    """``dp_rank`` is a field of SGLang's parallel context (resolved dynamically, so the target's
    attribute check cannot see it); without replicas the rank is 0 and SGLang is not asked; with
    ``--dp-size 2`` in a process SGLang's DP controller did not start (this one), the rank is
    unknown and ``replica_rank`` raises instead of answering 0 for every replica."""
    from sglang.srt import runtime_context

    from sglang_ext import compat

    assert "dp_rank" in runtime_context._parallel_fields()
    assert compat.replica_rank(1) == 0
    with pytest.raises(RuntimeError, match="--dp-size 2"):
        compat.replica_rank(2)
