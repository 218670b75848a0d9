"""SGLang's offline engine, as :mod:`sglang_ext.offline_engine` builds a layered one.

Part of :mod:`sglang_ext.compat.surface` (imported there, so in its ``TARGETS``). ``Engine(**kwargs)``
builds ``ServerArgs(**kwargs)`` directly, which has no field for kvplane's options and skips the
launcher's parse (where kvplane validates them and sets the SGLang options they need); kvplane's
engine builds the ``ServerArgs`` through that parse and hands it over as ``server_args=``.
"""

from __future__ import annotations

from sglang_ext.compat.target import Target

__all__ = ["ENGINE", "ENGINE_SUBPROCESS_WATCHDOG", "KILL_PROCESS_TREE", "LOAD_PLUGINS", "PORT_ARGS", "REDACT_WATERMARK_SECRETS",
           "SERVER_ARGS_FIELDS"]

ENGINE = Target("sglang.srt.entrypoints.engine.Engine", attrs=("generate", "shutdown", "server_args", "port_args"),
                used_by=("offline_engine", "engine_start_watch"))
"""``Engine(server_args=ServerArgs)`` (its ``__init__(**kwargs)`` takes a built record as is)."""
LOAD_PLUGINS = Target("sglang.srt.plugins.load_plugins", params=(), used_by=("offline_engine",))
"""Runs every plugin's ``register`` and applies the hooks in this process (idempotent): the parse
hooks must be in place before the engine's ``ServerArgs`` is parsed."""
SERVER_ARGS_FIELDS = Target("sglang.srt.server_args.ServerArgs",
                            attrs=("__struct_fields__", "launch_command", "custom_sigquit_handler"),
                            used_by=("offline_engine",))
"""The record's field names: the keyword arguments ``Engine(**kwargs)`` accepts. ``launch_command``
reads how the launch was asked for from the instance attribute ``_launch_command`` (``Engine``
sets ``Engine(k=v, ...)`` there with ``msgspec.Struct.__setattr__``; ``/get_server_info`` shows it).
``custom_sigquit_handler``: installed by ``Engine`` (in the main thread) instead of its own handler,
which kills the engine's process tree, the caller's process included, when a child sends
``SIGQUIT`` (a scheduler that failed to start does)."""
KILL_PROCESS_TREE = Target("sglang.srt.utils.common.kill_process_tree", params=("parent_pid", "include_parent"),
                           used_by=("engine_start_watch",))
"""What ``Engine``'s own ``SIGQUIT`` handler runs (on ``os.getpid()``); kvplane's engine-start watch
runs it on the processes a failed start left, and as ``Engine`` does once the engine is up."""
REDACT_WATERMARK_SECRETS = Target("sglang.srt.sampling.watermarking.core.redact_watermark_secrets",
                                  params=("value",), used_by=("offline_engine",))
"""The watermark keys hidden, as ``Engine`` hides them in its recorded launch."""
ENGINE_SUBPROCESS_WATCHDOG = Target("sglang.srt.utils.watchdog.SubprocessWatchdog", attrs=("stop",),
                                    used_by=("offline_engine",))
"""The engine's watchdog of its processes (``engine.tokenizer_manager._subprocess_watchdog``, set
by ``Engine.__init__``): it sends this process ``SIGQUIT`` when one of them ends with a non-zero
status. ``layered_engine`` stops it before it stops the processes of a start that failed after the
schedulers were ready (``Engine.shutdown()`` would stop every child of the caller's process)."""
PORT_ARGS = Target("sglang.srt.server_args.PortArgs",
                   attrs=("tokenizer_ipc_name", "scheduler_input_ipc_name", "detokenizer_ipc_name", "rpc_ipc_name"),
                   used_by=("engine_start_watch",))
"""An engine's IPC endpoints (``Engine._launch_subprocesses`` builds them; a local of its frame, and
``engine.port_args`` once started): a failed start's zmq sockets are the open ones on these
endpoints, whose contexts kvplane's engine-start watch closes (``EngineStartWatch.close_sockets``)."""
