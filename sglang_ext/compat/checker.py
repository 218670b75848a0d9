"""Resolve :mod:`sglang_ext.compat.surface` targets in the installed SGLang and check their shape.

:func:`check_target` imports the target's module, walks the attribute path, and compares what it
finds with what kvplane relies on: leading parameter names (``inspect.signature``), keyword
parameters, attributes (class or MRO attribute, dataclass / msgspec field or annotation, or a
``self.<name> = ...`` assignment in a class's source) and dict keys. It returns the problems as
sentences (empty: the target is as expected). No server is started; importing the modules is the
only side effect.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from sglang_ext.compat.surface import TARGETS, Target


def resolve(path: str) -> Any:
    """The object at a dotted path: the longest importable module prefix, then attributes.

    Raises ImportError (no module prefix imports) or AttributeError naming the missing part.
    """
    parts = path.split(".")
    error: ImportError | None = None
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not module_name.startswith(exc.name):
                raise  # the module exists but one of its own imports is missing
            error = exc
            continue
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                raise AttributeError(f"{'.'.join(parts[:j])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no importable module in {path!r}") from error


def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _declares(cls: type, name: str, sources: dict[type, str]) -> bool:
    """Whether ``cls`` or a base has ``name`` as attribute, field, annotation or ``self.name =``
    (``sources`` caches the classes' source text for the call)."""
    if hasattr(cls, name):
        return True
    assigned = re.compile(
        rf"\bself\.{re.escape(name)}\b(?:\s*:[^=\n]+)?\s*=(?!=)"  # self.x = ... / self.x: T = ...
        rf"|\bself\.{re.escape(name)}\s*,[^\n=]*=(?!=)"  # self.x, self.y = ...
        rf"|setattr\(\s*self\s*,\s*['\"]{re.escape(name)}['\"]"
    )
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        struct_fields = vars(klass).get("__struct_fields__", ())  # msgspec's own bases: a descriptor
        if name in getattr(klass, "__dataclass_fields__", {}) or (isinstance(struct_fields, tuple) and name in struct_fields):
            return True
        if name in getattr(klass, "__annotations__", {}):
            return True
        if klass not in sources:
            sources[klass] = _class_source(klass)
        if assigned.search(sources[klass]):
            return True
    return False


def _signature_problems(target: Target, obj: Any) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError) as exc:
        return [f"{target.path}: no inspectable signature ({exc})"]
    names = list(sig.parameters)
    problems: list[str] = []
    if target.params:
        got = tuple(names[: len(target.params)])
        if got != target.params:
            problems.append(
                f"{target.path}: leading parameters are {got}, kvplane expects {target.params} "
                f"(signature {sig})"
            )
    for name in target.keyword:
        param = sig.parameters.get(name)
        if param is None:
            problems.append(f"{target.path}: no parameter {name!r} (signature {sig})")
        elif param.kind is inspect.Parameter.POSITIONAL_ONLY:
            problems.append(f"{target.path}: parameter {name!r} is positional-only (signature {sig})")
    return problems


def check_target(target: Target) -> list[str]:
    """Problems with one target in the installed SGLang (empty when it is as kvplane expects)."""
    try:
        obj = resolve(target.path)
    except (ImportError, AttributeError) as exc:
        return [f"{target.path}: cannot be resolved ({exc})"]
    problems: list[str] = []
    if target.params or target.keyword:
        problems += _signature_problems(target, obj)
    sources: dict[type, str] = {}
    for name in target.attrs:
        present = _declares(obj, name, sources) if inspect.isclass(obj) else hasattr(obj, name)
        if not present:
            problems.append(f"{target.path}: no attribute {name!r}")
    if target.keys:
        if not isinstance(obj, dict):
            problems.append(f"{target.path}: expected a dict, got {type(obj).__name__}")
        else:
            problems += [f"{target.path}: no key {key!r}" for key in target.keys if key not in obj]
    return problems


def check_surface(targets: tuple[Target, ...] = TARGETS) -> dict[str, list[str]]:
    """Problems per target path, only for targets that have some."""
    out: dict[str, list[str]] = {}
    for target in targets:
        problems = check_target(target)
        if problems:
            out[target.path] = problems
    return out
