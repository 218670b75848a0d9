"""kvplane on SGLang's offline engine: :func:`layered_engine` is ``sgl.Engine(**kwargs)`` that also
takes kvplane's options.

``sgl.Engine(**kwargs)`` builds ``ServerArgs(**kwargs)`` directly: kvplane's options are no field of
it (``enable_layered_kv=True`` is a ``TypeError``), and the launcher's parse, where kvplane
validates its options and sets the SGLang options they need (``LaunchDecision``: attention
backend, CUDA graphs, the overlap scheduler; the host pool floor; the model's features), never
runs. Setting ``KVPLANE_LAYERED_KV_ARGS`` by hand skipped all of it.

:func:`layered_server_args` runs that parse on the keyword arguments instead: SGLang's plugins are
loaded in this process (so kvplane's parse hooks are applied), SGLang's own parser gives every
option its command-line default, the arguments are set over them (any ``ServerArgs`` field, or
one of kvplane's options by its flag's name: ``kv_gpu_budget_tokens=...``), and
``ServerArgs.from_cli_args`` builds the record through kvplane's hook, as ``sglang.launch_server``
does with the same options as flags. A refusal is a ``ValueError`` naming the option (the
launcher's exit status 2 would end the caller's process); an unknown argument is a
``TypeError``, as ``Engine`` raises. :func:`layered_engine` hands the record to
``Engine(server_args=...)``; the variables the parse exports for SGLang's subprocesses are put
back once the engine has started them, so a later engine in this process starts from the caller's
environment.

One layered engine per process at a time: the process's plugin keeps the options of the last
parse (its tokenizer-side hooks read them).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from sglang_ext import compat, settings
from sglang_ext.launch_refusal import LaunchRefusal

_EXPORTED = (settings.LAYERED_KV_ARGS_ENV, settings.HOST_MEMORY_ENV, settings.LOG_LEVEL_ENV)
"""The variables the parse exports for SGLang's subprocesses (``KvplanePlugin.around_from_cli_args``)."""


def layered_server_args(**kwargs: Any) -> Any:
    """SGLang's ``ServerArgs`` for ``kwargs`` (``Engine``'s keyword arguments and kvplane's options),
    built through the launcher's parse (module docstring). ``log_level`` defaults to ``"error"``,
    as in ``Engine``. Raises ``TypeError`` for a missing ``model_path`` or an unknown argument,
    ``ValueError`` (``kvplane: ...``) for a refused launch."""
    if "model_path" not in kwargs:
        raise TypeError("layered_server_args() needs model_path")
    compat.resolve(compat.LOAD_PLUGINS.path)()
    server_args_cls = compat.resolve(compat.SERVER_ARGS.path)
    parser = argparse.ArgumentParser(prog="kvplane layered_engine")
    server_args_cls.add_cli_args(parser)
    namespace = parser.parse_args(["--model-path", str(kwargs["model_path"])])
    if not hasattr(namespace, "enable_layered_kv"):
        raise RuntimeError("kvplane: its parse hooks are not applied in this process (its SGLang plugin "
                           "not loaded -- SGLANG_PLUGINS without 'kvplane'? -- or SGLang failed to apply "
                           "them: its log says why); no layered engine without them")
    fields = set(server_args_cls.__struct_fields__)
    unknown = sorted(k for k in kwargs if k not in fields and not hasattr(namespace, k))
    if unknown:
        raise TypeError(f"layered_server_args() got unexpected keyword arguments: {', '.join(unknown)} "
                        "(neither SGLang's ServerArgs fields nor kvplane's options)")
    for name, value in {"log_level": "error", **kwargs}.items():
        setattr(namespace, name, value)
    try:
        return server_args_cls.from_cli_args(namespace)
    except LaunchRefusal as refusal:
        raise ValueError(f"kvplane: {refusal.message}") from None


def layered_engine(**kwargs: Any) -> Any:
    """``sgl.Engine`` for ``kwargs`` with kvplane's options (:func:`layered_server_args`); with
    ``enable_layered_kv=True`` it serves from the layered KV pool, as the launcher's server does."""
    saved = {name: os.environ.get(name) for name in _EXPORTED}
    try:
        server_args = layered_server_args(**kwargs)
        try:
            return compat.resolve(compat.ENGINE.path)(server_args=server_args)
        except LaunchRefusal as refusal:  # this process's own check at publish
            raise ValueError(f"kvplane: {refusal.message}") from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
