"""sglang_ext.settings: every KVPLANE_* variable read in one place, typed, failing loudly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang_ext import settings
from sglang_ext.args import LayeredKVArgs
from sglang_ext.dataplane.host_memory_share import HostMemoryShare
from sglang_ext.settings import KvplaneEnv

REPO = Path(__file__).resolve().parents[2]
PENDING_SWITCH: frozenset[str] = frozenset()
"""Modules allowed to read a ``KVPLANE_*`` variable themselves (none: all go through settings)."""


def test_unset_or_empty_means_defaults() -> None:
    """No variable (or only empty ones) gives the defaults: flag off, nothing written."""
    assert KvplaneEnv.from_environ({}) == KvplaneEnv()
    assert KvplaneEnv.from_environ({name: "" for name in settings.ALL_VARIABLES}) == KvplaneEnv()
    assert KvplaneEnv().layered_kv_args == LayeredKVArgs()


def test_every_variable_is_read_into_a_typed_field(tmp_path: Path) -> None:
    """Each of the eight variables lands in its field with its type (paths, normalised level)."""
    layered = LayeredKVArgs(enable_layered_kv=True, kv_scheduler="lvf")
    env = KvplaneEnv.from_environ({
        settings.LAYERED_KV_ARGS_ENV: layered.to_json(),
        settings.LOG_LEVEL_ENV: " Warning ",
        settings.RESIDENCY_EVENTS_FILE_ENV: str(tmp_path / "events.jsonl"),
        settings.STATS_FILE_ENV: str(tmp_path / "stats.jsonl"),
        settings.POOL_STATS_FILE_ENV: str(tmp_path / "pool.jsonl"),
        settings.OVERHEAD_FILE_ENV: str(tmp_path / "overhead.json"),
        settings.WORKER_ID_ENV: "sglang-node7-30000",
        settings.HOST_MEMORY_ENV: '{"ranks": 8, "available_bytes": 512000000000}',
    })
    assert env == KvplaneEnv(
        layered_kv_args=layered,
        log_level="warning",
        residency_events_file=tmp_path / "events.jsonl",
        stats_file=tmp_path / "stats.jsonl",
        pool_stats_file=tmp_path / "pool.jsonl",
        overhead_file=tmp_path / "overhead.json",
        worker_id="sglang-node7-30000",
        host_memory=HostMemoryShare(ranks=8, available_bytes=512_000_000_000),
    )
    assert len(settings.ALL_VARIABLES) == 8 == len(KvplaneEnv.__dataclass_fields__)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (settings.LOG_LEVEL_ENV, "chatty",
         "KVPLANE_LOG_LEVEL: 'chatty' is not a log level (allowed: debug, info, warning, error, critical)"),
        (settings.STATS_FILE_ENV, "{tmp}/nope/stats.jsonl",
         "KVPLANE_STATS_FILE='{tmp}/nope/stats.jsonl': directory '{tmp}/nope' does not exist "
         "(allowed: a file path in an existing directory, or unset)"),
        (settings.POOL_STATS_FILE_ENV, "{tmp}/nope/pool.jsonl", "KVPLANE_POOL_STATS_FILE='{tmp}/nope/pool.jsonl'"),
        (settings.RESIDENCY_EVENTS_FILE_ENV, "{tmp}/nope/ev.jsonl", "directory '{tmp}/nope' does not exist"),
        (settings.OVERHEAD_FILE_ENV, "{tmp}",
         "KVPLANE_OVERHEAD_FILE='{tmp}' is a directory (allowed: a file path in an existing directory)"),
        (settings.WORKER_ID_ENV, "worker 1",
         "KVPLANE_WORKER_ID='worker 1' is invalid (allowed: 1-256 characters without whitespace or control"),
        (settings.WORKER_ID_ENV, "w" * 257, "KVPLANE_WORKER_ID='wwww"),
        (settings.LAYERED_KV_ARGS_ENV, "{", "KVPLANE_LAYERED_KV_ARGS: not valid JSON"),
        (settings.LAYERED_KV_ARGS_ENV, "[1]", "KVPLANE_LAYERED_KV_ARGS: must hold a JSON object, got list"),
        (settings.LAYERED_KV_ARGS_ENV, '{"kv_scheduler": "sjf"}',
         "KVPLANE_LAYERED_KV_ARGS: --kv-scheduler='sjf' is invalid; allowed: fcfs, layerkv, lvf"),
        (settings.LAYERED_KV_ARGS_ENV, '{"kv_bogus": 1}', "KVPLANE_LAYERED_KV_ARGS: unknown kvplane option(s) ['kv_bogus']"),
        (settings.HOST_MEMORY_ENV, "{", "KVPLANE_HOST_MEMORY: not JSON"),
        (settings.HOST_MEMORY_ENV, '{"ranks": 0, "available_bytes": null}',
         "KVPLANE_HOST_MEMORY: ranks=0 is out of range [1, 65536]"),
        (settings.HOST_MEMORY_ENV, '{"ranks": 2, "available_bytes": -1}',
         "KVPLANE_HOST_MEMORY: available_bytes=-1 must be a byte count >= 0 or null"),
        (settings.HOST_MEMORY_ENV, '{"ranks": 2}', "KVPLANE_HOST_MEMORY: '{\"ranks\": 2}': want an object with exactly"),
    ],
)
def test_bad_value_names_variable_value_and_allowed(tmp_path: Path, name: str, value: str, message: str) -> None:
    """A bad value raises ValueError naming the variable, the value and what is allowed."""
    value, message = value.replace("{tmp}", str(tmp_path)), message.replace("{tmp}", str(tmp_path))
    with pytest.raises(ValueError) as info:
        KvplaneEnv.from_environ({name: value})
    assert message in str(info.value)


def test_layered_kv_args_round_trip_through_export() -> None:
    """The launcher's export is what the subprocesses read; flag off removes the variable."""
    environ: dict[str, str] = {}
    on = LayeredKVArgs(enable_layered_kv=True, kv_report_interval=3)
    settings.export_layered_kv_args(on, environ)
    assert settings.read_layered_kv_args(environ) == on == LayeredKVArgs.from_env(environ)
    settings.export_layered_kv_args(LayeredKVArgs(), environ)
    assert settings.LAYERED_KV_ARGS_ENV not in environ


def test_host_memory_round_trips_through_export() -> None:
    """The launcher's snapshot is what the schedulers read; None removes the variable."""
    environ: dict[str, str] = {}
    share = HostMemoryShare(ranks=4, available_bytes=None)
    settings.export_host_memory(share, environ)
    assert settings.read_host_memory(environ) == share
    settings.export_host_memory(None, environ)
    assert settings.HOST_MEMORY_ENV not in environ and settings.read_host_memory(environ) is None


def test_log_level_export_keeps_a_user_value_and_validates_it() -> None:
    """SGLang's level is exported unless the user set one; a bad user value is refused."""
    environ: dict[str, str] = {}
    assert settings.export_log_level("WARNING", environ) == "warning" == environ[settings.LOG_LEVEL_ENV]
    environ = {settings.LOG_LEVEL_ENV: "debug"}
    assert settings.export_log_level("info", environ) == "debug"
    assert settings.export_log_level("trace", {}) == "info"  # an SGLang level kvplane lacks
    with pytest.raises(ValueError, match="KVPLANE_LOG_LEVEL: 'loud' is not a log level"):
        settings.export_log_level("info", {settings.LOG_LEVEL_ENV: "loud"})


def test_no_other_module_reads_a_kvplane_variable() -> None:
    """Only settings.py reads KVPLANE_* variables (the pool being rewritten excepted)."""
    reads = re.compile(r"""(?:environ(?:\.get)?\(?|getenv\()\s*\[?\s*["']KVPLANE_""")
    offenders = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "sglang_ext").rglob("*.py")
        if path.name != "settings.py" and path.name not in PENDING_SWITCH and reads.search(path.read_text())
    )
    assert offenders == []


def test_rank_output_file_gives_each_tp_rank_its_own_file(tmp_path: Path) -> None:
    """Rank 0 keeps the path (a TP=1 server's file is unchanged); rank r > 0 writes STEM.tpR.SUFFIX
    beside it; no two ranks share a file; a negative rank is refused."""
    path = tmp_path / "events.jsonl"
    assert settings.rank_output_file(path, 0) == path
    assert settings.rank_output_file(path, 1) == tmp_path / "events.tp1.jsonl"
    assert settings.rank_output_file(tmp_path / "stats", 3) == tmp_path / "stats.tp3"
    assert len({settings.rank_output_file(path, r) for r in range(8)}) == 8
    with pytest.raises(ValueError, match="tp_rank=-1"):
        settings.rank_output_file(path, -1)


def test_each_data_parallel_replica_gets_its_own_files_and_worker_id(tmp_path: Path) -> None:
    """With ``--dp-size > 1`` replica d > 0 writes STEM.dpD[.tpR].SUFFIX (replica 0 keeps the TP
    names), so no two (replica, TP rank) pairs share a file; each replica reports as ``ID-dpD``
    (one id for all made the replicas replace each other's control-plane session)."""
    path = tmp_path / "events.jsonl"
    assert settings.rank_output_file(path, 0, 1) == tmp_path / "events.dp1.jsonl"
    assert settings.rank_output_file(path, 1, 2) == tmp_path / "events.dp2.tp1.jsonl"
    assert settings.rank_output_file(path, 1, 0) == tmp_path / "events.tp1.jsonl"
    assert len({settings.rank_output_file(path, t, d) for t in range(4) for d in range(4)}) == 16
    with pytest.raises(ValueError, match="dp_rank=-1"):
        settings.rank_output_file(path, 0, -1)
    assert settings.replica_worker_id("w", 1, 2) == "w-dp1" and settings.replica_worker_id("w", 0, 2) == "w-dp0"
    assert settings.replica_worker_id("w", 0, 1) == "w"  # no replicas: the id is unchanged
    longest = "w" * settings.MAX_WORKER_ID_CHARS  # a valid KVPLANE_WORKER_ID ...
    assert settings.replica_worker_id(longest, 0, 1) == longest
    with pytest.raises(ValueError, match="-dpD suffix"):  # ... the control plane would refuse suffixed
        settings.replica_worker_id(longest, 1, 2)
