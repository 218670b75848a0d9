"""The SGLang objects the test harness relies on (``sglang_ext/testing/``): the launcher module
the server fixture runs, and what the launch zygote (:mod:`sglang_ext.testing.zygote_server`)
pre-imports and emulates.

Part of :mod:`sglang_ext.compat.surface` (imported there, so in its ``TARGETS``).
"""

from __future__ import annotations

from sglang_ext.compat.target import Target

_MANAGERS = "sglang.srt.managers"

LAUNCH_SERVER = Target("sglang.launch_server", used_by=("testing.server", "testing.zygote_server"))
"""Run with ``python -m`` by the server fixture (or as ``__main__`` in a zygote's fork)."""
RUN_SCHEDULER_PROCESS = Target(f"{_MANAGERS}.scheduler.run_scheduler_process",
                               params=("server_args", "port_args", "gpu_id", "tp_rank"),
                               used_by=("testing.zygote_server",))
"""A scheduler process's entry (an ``mp.Process`` target under SGLang's ``spawn`` start method).
Its module is pre-imported by the zygote; it calls ``load_plugins()`` first (kvplane registers
in each process) and finds its parent with ``psutil.Process().parent()``, which the zygote's
children answer with the process that started them (:mod:`sglang_ext.testing.zygote_child`)."""
RUN_DETOKENIZER_PROCESS = Target(f"{_MANAGERS}.detokenizer_manager.run_detokenizer_process",
                                 params=("server_args", "port_args"), used_by=("testing.zygote_server",))
"""The detokenizer process's entry; pre-imported like the scheduler's."""
RUN_DATA_PARALLEL_CONTROLLER_PROCESS = Target(
    f"{_MANAGERS}.data_parallel_controller.run_data_parallel_controller_process",
    params=("server_args", "port_args"), used_by=("testing.zygote_server",))
"""The ``--dp`` controller's entry (it starts the replicas' schedulers); pre-imported too."""
MODEL_REGISTRY = Target("sglang.srt.models.registry.ModelRegistry", attrs=("models", "register"),
                        used_by=("testing.zygote_server",))
"""SGLang's model registry: importing its module imports every model module SGLang ships
(``ModelRegistry.register("sglang.srt.models")``, ~3.5 s of CPU on the 2-core host), which each
scheduler does when it loads its model. Pre-imported by the zygote; the plugin's hooks on names
the model modules import (``models.utils.enable_fused_set_kv_buffer``) still reach them, since
SGLang's ``HookRegistry`` rebinds every module's stale binding when it applies a hook."""

ZYGOTE_PRELOAD: tuple[str, ...] = (
    LAUNCH_SERVER.path,
    RUN_SCHEDULER_PROCESS.path.rsplit(".", 1)[0],
    RUN_DETOKENIZER_PROCESS.path.rsplit(".", 1)[0],
    RUN_DATA_PARALLEL_CONTROLLER_PROCESS.path.rsplit(".", 1)[0],
    MODEL_REGISTRY.path.rsplit(".", 1)[0],
)
"""Modules the launch zygote imports once (and its fork server before forking any process)."""

__all__ = ["LAUNCH_SERVER", "MODEL_REGISTRY", "RUN_DATA_PARALLEL_CONTROLLER_PROCESS", "RUN_DETOKENIZER_PROCESS",
           "RUN_SCHEDULER_PROCESS"]
