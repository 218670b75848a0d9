"""Every ``KVPLANE_*`` environment variable kvplane's SGLang plugin reads: names, typed readers, one
frozen snapshot (:class:`KvplaneEnv`).

Nothing else in ``sglang_ext`` reads ``os.environ`` for these. A bad value raises ``ValueError``
naming the variable, the value and what is allowed; unset or empty means the default (off).

=================================  =====================================================================
``KVPLANE_LAYERED_KV_ARGS``        the launch options (:class:`~sglang_ext.args.LayeredKVArgs` as a JSON
                                   object), set by the launcher for SGLang's subprocesses
``KVPLANE_LOG_LEVEL``              level of kvplane's events: debug, info, warning, error, critical
                                   (exported from SGLang's ``--log-level`` unless set)
``KVPLANE_RESIDENCY_EVENTS_FILE``  residency events appended as JSON lines (per TP rank: :func:`rank_output_file`)
``KVPLANE_STATS_FILE``             one JSON line per scheduler step (TP rank 0)
``KVPLANE_POOL_STATS_FILE``        one JSON line per forward from the layered KV pool (per TP rank)
``KVPLANE_OVERHEAD_FILE``          kvplane's own time per step, rewritten every 64 steps
``KVPLANE_WORKER_ID``              worker id sent to the control plane (default ``sglang-HOST-PORT``;
                                   ``ID-dpD`` per replica with ``--dp-size > 1``: :func:`replica_worker_id`)
``KVPLANE_HOST_MEMORY``            the host memory the launcher saw and the scheduler processes sharing it
                                   (:class:`~sglang_ext.dataplane.host_memory_share.HostMemoryShare` as
                                   JSON), set by the launcher with ``--enable-layered-kv``
=================================  =====================================================================

Files must be in an existing directory (and not be a directory). With ``--dp-size > 1`` every
file is per data-parallel replica too (:func:`rank_output_file`). Pure Python: imported by
``plugin.py`` / ``args.py`` in every SGLang process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_ext.args import LayeredKVArgs
    from sglang_ext.dataplane.host_memory_share import HostMemoryShare

LAYERED_KV_ARGS_ENV = "KVPLANE_LAYERED_KV_ARGS"
LOG_LEVEL_ENV = "KVPLANE_LOG_LEVEL"
RESIDENCY_EVENTS_FILE_ENV = "KVPLANE_RESIDENCY_EVENTS_FILE"
STATS_FILE_ENV = "KVPLANE_STATS_FILE"
POOL_STATS_FILE_ENV = "KVPLANE_POOL_STATS_FILE"
OVERHEAD_FILE_ENV = "KVPLANE_OVERHEAD_FILE"
WORKER_ID_ENV = "KVPLANE_WORKER_ID"
HOST_MEMORY_ENV = "KVPLANE_HOST_MEMORY"
ALL_VARIABLES = (
    LAYERED_KV_ARGS_ENV,
    LOG_LEVEL_ENV,
    RESIDENCY_EVENTS_FILE_ENV,
    STATS_FILE_ENV,
    POOL_STATS_FILE_ENV,
    OVERHEAD_FILE_ENV,
    WORKER_ID_ENV,
    HOST_MEMORY_ENV,
)
"""Every variable this module reads, in the table's order."""
START_FAILURE_FILE_ENV = "KVPLANE_START_FAILURE_FILE"
"""Set by :func:`sglang_ext.offline_engine.layered_engine` for its engine's start only: where a
scheduler that fails to start writes its error (:mod:`sglang_ext.scheduler_start_failure`, which
reads it; not part of :class:`KvplaneEnv`)."""

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MAX_WORKER_ID_CHARS = 256
_WORKER_ID = re.compile(rf"^[^\s\x00-\x1f\x7f]{{1,{MAX_WORKER_ID_CHARS}}}$")


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _raw(environ: Mapping[str, str] | None, name: str) -> str | None:
    """The variable's value, None when unset or empty (whitespace only counts as empty)."""
    value = _environ(environ).get(name)
    return value if value is not None and value.strip() else None


# ----- typed readers -----------------------------------------------------------------------------


def parse_log_level(value: str, name: str = LOG_LEVEL_ENV) -> str:
    """``value`` as one of :data:`LOG_LEVELS` (case and surrounding space ignored)."""
    key = str(value).strip().lower()
    if key not in LOG_LEVELS:
        raise ValueError(f"{name}: {value!r} is not a log level (allowed: {', '.join(LOG_LEVELS)})")
    return key


def read_log_level(environ: Mapping[str, str] | None = None) -> str | None:
    """``KVPLANE_LOG_LEVEL`` normalised (``"debug"`` ...), None when unset."""
    raw = _raw(environ, LOG_LEVEL_ENV)
    return None if raw is None else parse_log_level(raw)


def read_output_file(name: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """A file kvplane writes: None when unset; the directory must exist and the path must not be
    a directory."""
    raw = _raw(environ, name)
    if raw is None:
        return None
    path = Path(raw).expanduser()
    if path.is_dir():
        raise ValueError(f"{name}={raw!r} is a directory (allowed: a file path in an existing directory)")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(
            f"{name}={raw!r}: directory {str(parent)!r} does not exist "
            "(allowed: a file path in an existing directory, or unset)"
        )
    return path


def rank_output_file(path: Path, tp_rank: int, dp_rank: int = 0) -> Path:
    """Where TP rank ``tp_rank`` of data-parallel replica ``dp_rank`` writes a file that several
    ranks write (the residency events, the layered pool's stats; per replica: the step stats and
    the overhead meter). TP rank 0 of replica 0 writes ``path`` itself, so a server without TP or
    DP is unchanged; otherwise ``STEM[.dpD][.tpR].SUFFIX`` beside it (``events.jsonl`` ->
    ``events.tp1.jsonl``, ``events.dp1.jsonl``, ``events.dp1.tp1.jsonl``). One writer per file: the
    ranks' lines never interleave and each file's event ``seq`` stays gap-free (measured with
    ``--tp 2``: both ranks appending to one file doubled every event; with ``--dp-size 2`` the two
    replicas' step numbers interleaved)."""
    if tp_rank < 0 or dp_rank < 0:
        raise ValueError(f"tp_rank={tp_rank}, dp_rank={dp_rank}: must be >= 0")
    tags = (f".dp{dp_rank}" if dp_rank else "") + (f".tp{tp_rank}" if tp_rank else "")
    return path.with_name(f"{path.stem}{tags}{path.suffix}") if tags else path


def replica_worker_id(worker_id: str, dp_rank: int, dp_size: int) -> str:
    """The worker id of data-parallel replica ``dp_rank``: ``ID-dpD`` with ``--dp-size > 1`` (each
    replica is a worker of its own to the control plane: one id for all made them replace each
    other's session), ``worker_id`` unchanged otherwise. Raises ``ValueError`` when the suffix
    takes the id past :data:`MAX_WORKER_ID_CHARS` (the control plane would refuse it)."""
    if dp_size <= 1:
        return worker_id
    replica = f"{worker_id}-dp{dp_rank}"
    if len(replica) > MAX_WORKER_ID_CHARS:
        raise ValueError(
            f"{WORKER_ID_ENV}: with --dp-size {dp_size} the worker id gets a -dpD suffix, and "
            f"{replica[:40]!r}... is {len(replica)} characters (at most {MAX_WORKER_ID_CHARS})"
        )
    return replica


def read_worker_id(environ: Mapping[str, str] | None = None) -> str | None:
    """``KVPLANE_WORKER_ID``: 1-256 characters, no whitespace or control characters; None when unset."""
    raw = _raw(environ, WORKER_ID_ENV)
    if raw is None:
        return None
    if not _WORKER_ID.match(raw):
        raise ValueError(
            f"{WORKER_ID_ENV}={raw!r} is invalid (allowed: 1-{MAX_WORKER_ID_CHARS} characters without "
            "whitespace or control characters)"
        )
    return raw


def read_layered_kv_args(environ: Mapping[str, str] | None = None) -> LayeredKVArgs:
    """``KVPLANE_LAYERED_KV_ARGS`` as :class:`~sglang_ext.args.LayeredKVArgs`; the defaults (flag
    off) when unset. A bad value names the variable and what is wrong with it."""
    from sglang_ext.args import LayeredKVArgs

    raw = _raw(environ, LAYERED_KV_ARGS_ENV)
    if raw is None:
        return LayeredKVArgs()
    try:
        return LayeredKVArgs.from_json(raw)
    except ValueError as exc:
        raise ValueError(f"{LAYERED_KV_ARGS_ENV}: {exc}") from exc


def read_host_memory(environ: Mapping[str, str] | None = None) -> HostMemoryShare | None:
    """``KVPLANE_HOST_MEMORY`` as a :class:`~sglang_ext.dataplane.host_memory_share.HostMemoryShare`;
    None when unset (a pool built outside a launch checks only its own share)."""
    from sglang_ext.dataplane.host_memory_share import HostMemoryShare

    raw = _raw(environ, HOST_MEMORY_ENV)
    if raw is None:
        return None
    try:
        return HostMemoryShare.from_json(raw)
    except ValueError as exc:
        raise ValueError(f"{HOST_MEMORY_ENV}: {exc}") from exc


# ----- writers (the launcher exports for SGLang's subprocesses) --------------------------------------


def export_layered_kv_args(args: LayeredKVArgs | None, environ: MutableMapping[str, str] | None = None) -> None:
    """Set ``KVPLANE_LAYERED_KV_ARGS`` to ``args`` (removed when None or the flag is off)."""
    env = os.environ if environ is None else environ
    if args is None or not args.enable_layered_kv:
        env.pop(LAYERED_KV_ARGS_ENV, None)
    else:
        env[LAYERED_KV_ARGS_ENV] = args.to_json()


def export_host_memory(share: HostMemoryShare | None, environ: MutableMapping[str, str] | None = None) -> None:
    """Set ``KVPLANE_HOST_MEMORY`` to ``share`` (removed when None)."""
    env = os.environ if environ is None else environ
    if share is None:
        env.pop(HOST_MEMORY_ENV, None)
    else:
        env[HOST_MEMORY_ENV] = share.to_json()


def export_log_level(sglang_level: str | None, environ: MutableMapping[str, str] | None = None) -> str:
    """Set ``KVPLANE_LOG_LEVEL`` to SGLang's ``--log-level`` unless the user set it (then validate
    the user's value); returns the level in force. SGLang levels kvplane does not have mean info."""
    env = os.environ if environ is None else environ
    user = read_log_level(env)
    if user is not None:
        return user
    level = (sglang_level or "info").lower()
    env[LOG_LEVEL_ENV] = level if level in LOG_LEVELS else "info"
    return env[LOG_LEVEL_ENV]


# ----- the snapshot ----------------------------------------------------------------------------------


def _default_layered() -> LayeredKVArgs:
    from sglang_ext.args import LayeredKVArgs

    return LayeredKVArgs()


@dataclass(frozen=True)
class KvplaneEnv:
    """Every ``KVPLANE_*`` variable of one process, read and validated at once."""

    layered_kv_args: LayeredKVArgs = field(default_factory=_default_layered)
    """``KVPLANE_LAYERED_KV_ARGS`` (flag off when unset)."""
    log_level: str | None = None
    """``KVPLANE_LOG_LEVEL``, normalised."""
    residency_events_file: Path | None = None
    """``KVPLANE_RESIDENCY_EVENTS_FILE``."""
    stats_file: Path | None = None
    """``KVPLANE_STATS_FILE``."""
    pool_stats_file: Path | None = None
    """``KVPLANE_POOL_STATS_FILE``."""
    overhead_file: Path | None = None
    """``KVPLANE_OVERHEAD_FILE``."""
    worker_id: str | None = None
    """``KVPLANE_WORKER_ID``."""
    host_memory: HostMemoryShare | None = None
    """``KVPLANE_HOST_MEMORY``."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> KvplaneEnv:
        """Read every variable of ``environ`` (default ``os.environ``); ValueError on the first
        bad one, naming it, its value and what is allowed."""
        return cls(
            layered_kv_args=read_layered_kv_args(environ),
            log_level=read_log_level(environ),
            residency_events_file=read_output_file(RESIDENCY_EVENTS_FILE_ENV, environ),
            stats_file=read_output_file(STATS_FILE_ENV, environ),
            pool_stats_file=read_output_file(POOL_STATS_FILE_ENV, environ),
            overhead_file=read_output_file(OVERHEAD_FILE_ENV, environ),
            worker_id=read_worker_id(environ),
            host_memory=read_host_memory(environ),
        )
