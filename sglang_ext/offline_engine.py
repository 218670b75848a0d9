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
does with the same options as flags (path-like values of kvplane's options as strings; anything
that is neither a ``ServerArgs`` field nor one of kvplane's options, the launcher's own flags
included, is a ``TypeError``, as ``Engine`` raises). A refusal of the parse is a ``ValueError``
naming the option (the launcher's exit status 2 would end the caller's process). One made later,
in a scheduler process (a partial hook install, or a check that needs the slot space SGLang sizes
there), is a ``ValueError`` too where :func:`layered_engine` watches the start (in the main thread,
without a ``custom_sigquit_handler`` of the caller's: :class:`~sglang_ext.engine_start_watch.EngineStartWatch`;
before session 84, SGLang's engine answered the failed scheduler by killing the caller's process).

The parse changes this process: it exports variables for SGLang's subprocesses and sets the
plugin's options, which kvplane's request-side hooks here read (SLO checks, pacing, placement
info). :func:`layered_engine` puts the variables back once the engine has started its
subprocesses and the plugin's options when the engine shuts down (or fails to start), so a stock
``sgl.Engine`` after it runs without kvplane; :func:`layered_server_args` puts both back at once.
One layered engine at a time per process. The ``KVPLANE_*`` variables are read when SGLang loads
the plugins in this process, once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import threading
from typing import Any

from sglang_ext import compat, settings
from sglang_ext.args import LayeredKVArgs
from sglang_ext.engine_start_watch import EngineStartWatch
from sglang_ext.launch_refusal import LaunchRefusal

_EXPORTED = (settings.LAYERED_KV_ARGS_ENV, settings.HOST_MEMORY_ENV, settings.LOG_LEVEL_ENV,
             settings.START_FAILURE_FILE_ENV)
"""The variables the parse exports for SGLang's subprocesses (``KvplanePlugin.around_from_cli_args``)
and the engine's start watch's failure file (:func:`layered_engine`)."""


def _kvplane_options() -> frozenset[str]:
    """The names of kvplane's options: :class:`LayeredKVArgs`' fields (its flags' ``dest``, which
    ``LayeredKVArgs.from_namespace`` reads)."""
    return frozenset(field.name for field in dataclasses.fields(LayeredKVArgs))


class _Parse:
    """One parse of the engine's options and what it left in this process: the exported variables
    and the plugin's options (:meth:`undo` puts both back)."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        if "model_path" not in kwargs:
            raise TypeError("layered_server_args() needs model_path")
        self.saved = {name: os.environ.get(name) for name in _EXPORTED}
        self.context: tuple[Any, Any] | None = None
        compat.resolve(compat.LOAD_PLUGINS.path)()
        server_args_cls = compat.resolve(compat.SERVER_ARGS.path)
        parser = argparse.ArgumentParser(prog="kvplane layered_engine")
        server_args_cls.add_cli_args(parser)
        namespace = parser.parse_args(["--model-path", str(kwargs["model_path"])])
        if not hasattr(namespace, "enable_layered_kv"):
            raise RuntimeError("kvplane: its parse hooks are not applied in this process (its SGLang plugin "
                               "not loaded -- SGLANG_PLUGINS without 'kvplane'? -- or SGLang failed to apply "
                               "them: its log says why); no layered engine without them")
        ours, fields = _kvplane_options(), set(server_args_cls.__struct_fields__)
        unknown = sorted(k for k in kwargs if k not in fields and k not in ours)
        if unknown:
            raise TypeError(f"layered_server_args() got unexpected keyword arguments: {', '.join(unknown)} "
                            "(neither SGLang's ServerArgs fields nor kvplane's options)")
        for name, value in {"log_level": "error", **kwargs}.items():
            setattr(namespace, name, os.fspath(value) if name in ours and isinstance(value, os.PathLike) else value)
        import msgspec  # SGLang's record type (installed with SGLang)

        shown = compat.resolve(compat.REDACT_WATERMARK_SECRETS.path)(kwargs)  # as Engine records its own
        try:
            self.server_args = server_args_cls.from_cli_args(namespace)
            msgspec.Struct.__setattr__(self.server_args, "_launch_command",  # as Engine sets its own
                                       "layered_engine(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")")
        except LaunchRefusal as refusal:
            self.undo(namespace)
            raise ValueError(f"kvplane: {refusal.message}") from None
        except BaseException:
            self.undo(namespace)
            raise
        self.context = getattr(namespace, "kvplane_context", None)

    def undo(self, namespace: Any = None) -> None:
        """The variables and the plugin's options as they were before the parse."""
        _set_environ(self.saved)
        ctx, layered = getattr(namespace, "kvplane_context", None) or self.context or (None, None)
        if ctx is not None:
            ctx.layered = layered


def _set_environ(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def layered_server_args(**kwargs: Any) -> Any:
    """SGLang's ``ServerArgs`` for ``kwargs`` (``Engine``'s keyword arguments and kvplane's options),
    built through the launcher's parse (module docstring), with every change the parse made to this
    process put back: the record alone, to inspect (an engine started on it would lack kvplane's
    subprocess options: start one with :func:`layered_engine`). ``log_level`` defaults to
    ``"error"``, as in ``Engine``. Raises ``TypeError`` for a missing ``model_path`` or an unknown
    argument, ``ValueError`` (``kvplane: ...``) for a refused launch."""
    parse = _Parse(kwargs)
    parse.undo()
    return parse.server_args


def layered_engine(**kwargs: Any) -> Any:
    """``sgl.Engine`` for ``kwargs`` with kvplane's options (:func:`layered_server_args`); with
    ``enable_layered_kv=True`` it serves from the layered KV pool, as the launcher's server does.
    The exported variables are put back once the engine has started its subprocesses, the plugin's
    options in this process (its request-side hooks read them) when it shuts down or fails to start.
    Started in the main thread without a ``custom_sigquit_handler`` of the caller's, the start is
    watched (:class:`~sglang_ext.engine_start_watch.EngineStartWatch`): a scheduler that fails to
    start raises here (kvplane's refusal as ``ValueError``) instead of SGLang killing this process."""
    parse = _Parse(kwargs)
    watch = _watch(parse.server_args)
    try:
        engine = compat.resolve(compat.ENGINE.path)(server_args=parse.server_args)
    except LaunchRefusal as refusal:  # this process's own check at publish
        parse.undo()
        if watch is not None:
            watch.failed(refusal)
        else:
            EngineStartWatch.close_sockets(refusal)
        raise ValueError(f"kvplane: {refusal.message}") from None
    except BaseException as error:
        parse.undo()
        if watch is None:  # unwatched: the error as SGLang raised it, its sockets closed
            EngineStartWatch.close_sockets(error)
            raise
        raised = watch.failed(error)
        if raised is error:
            raise
        raise raised from error
    _set_environ(parse.saved)
    if watch is not None:
        if not watch.started():  # a child failed after the schedulers were ready (SGLang would end this process)
            parse.undo()
            watchdog = getattr(getattr(engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
            if watchdog is not None:  # it would report the processes stopped below with a SIGQUIT
                watchdog.stop()  # (not engine.shutdown(): it stops every child of this process)
            error = RuntimeError("a process of the engine failed during its start (it sent SIGQUIT; its error "
                                 "is in the log above): the engine is stopped")
            raised = watch.failed(error, engine)
            raise raised from (None if raised is error else error)
        _off_the_record(engine)
    shutdown = engine.shutdown

    def shutdown_and_undo(*args: Any, **kwargs: Any) -> Any:
        try:
            return shutdown(*args, **kwargs)
        finally:
            parse.undo()

    engine.shutdown = shutdown_and_undo
    return engine


def _watch(server_args: Any) -> EngineStartWatch | None:
    """The start's watch, as the engine's ``custom_sigquit_handler`` (``Engine`` installs one only
    in the main thread), with the failure file exported for the schedulers; None where the caller
    set a handler of its own or this is not the main thread."""
    if server_args.custom_sigquit_handler is not None or threading.current_thread() is not threading.main_thread():
        return None
    handle, path = tempfile.mkstemp(prefix="kvplane-engine-start-", suffix=".jsonl")
    os.close(handle)
    watch = EngineStartWatch.before_start(path)
    import msgspec

    msgspec.Struct.__setattr__(server_args, "custom_sigquit_handler", watch)
    os.environ[settings.START_FAILURE_FILE_ENV] = path
    return watch


def _off_the_record(engine: Any) -> None:
    """The installed watch off the engine's record, where the caller set no handler: its
    ``server_args`` field back to None, and ``get_server_info()`` (which reads the record SGLang
    published, with the watch in it) answering None for it, so it stays plain JSON, as a stock
    engine's does."""
    import msgspec

    msgspec.Struct.__setattr__(engine.server_args, "custom_sigquit_handler", None)
    server_info = engine.get_server_info

    def get_server_info(*args: Any, **kwargs: Any) -> Any:
        info = server_info(*args, **kwargs)
        if isinstance(info, dict) and isinstance(info.get("custom_sigquit_handler"), EngineStartWatch):
            info["custom_sigquit_handler"] = None
        return info

    engine.get_server_info = get_server_info
