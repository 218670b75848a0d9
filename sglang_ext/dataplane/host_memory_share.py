"""``HostMemoryShare``: the host memory one launch's host KV pools share (issue 14 item 4).

Every scheduler process of a launch (``--tp-size x --pp-size x --dp-size`` of them, spread over
``--nnodes`` hosts) pins a host KV pool of its own, and they start together. Each checking its
pool alone against the host's available memory passed eight 55 GB pools on a 512 GB node (each
55 GB is under 80% of what every rank saw), and the node then ran out of memory while pinning.
And ``/proc/meminfo`` is the whole host's: in a container whose cgroup allows 64 GiB on a 2 TB
host, a 55 GB pool passed and the process was killed for memory while pinning it.

So the launcher, before any scheduler starts, records what the host has available -- the least
of ``MemAvailable`` and the headroom of every cgroup memory limit above the process (v2
``memory.max``, v1 ``memory.limit_in_bytes``; file page cache, which the kernel reclaims, is not
counted as used) -- and how many scheduler processes this launch starts on the host; the pools'
check (:func:`sglang_ext.dataplane.host_pool.host_pool_limit`) then holds all of them against
that one snapshot, whichever rank pins first. Standard library only: the launcher and
``settings.py`` read it in every SGLang process; it imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

UNLIMITED = 1 << 60
"""A cgroup v1 limit at or above this is "no limit" (the kernel writes 2**63 rounded to a page)."""
MAX_RANKS = 1 << 16


def meminfo_available(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """``MemAvailable`` of the host in bytes, None where it cannot be read."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 "max" (no limit) reads as None


def _page_cache(stat: Path) -> int:
    """A cgroup's file page cache, which the kernel reclaims to pin memory (active and inactive:
    ``total_*_file`` in v1, ``*_file`` in v2), as ``MemAvailable`` counts it available."""
    try:
        fields = dict(line.split(maxsplit=1) for line in stat.read_text().splitlines() if " " in line)
    except OSError:
        return 0
    total = 0
    for kind in ("active_file", "inactive_file"):
        value = fields.get(f"total_{kind}", fields.get(kind, "0")).strip()
        total += int(value) if value.isdigit() else 0
    return total


def _ancestors(leaf: Path, top: Path) -> list[Path]:
    """``leaf`` and its parents up to ``top`` (``top`` alone when ``leaf`` is not under it or does
    not exist, as inside a container's cgroup namespace)."""
    if not leaf.is_dir() or top not in (leaf, *leaf.parents):
        return [top]
    dirs = [leaf]
    while dirs[-1] != top:
        dirs.append(dirs[-1].parent)
    return dirs


def cgroup_headroom(proc_cgroup: str | Path = "/proc/self/cgroup",
                    root: str | Path = "/sys/fs/cgroup") -> int | None:
    """Bytes the process's cgroups still allow: the least, over every memory-limited cgroup from
    the process's own up to the root, of its limit minus its usage (less its file page cache);
    None when no cgroup limits memory or none can be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(root)
    found: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, rel = parts
        rel = rel.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":  # v2 (unified; under "unified" on hybrid hosts)
            top = root if (root / "cgroup.controllers").exists() else root / "unified"
            names = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1
            top = root / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for d in _ancestors(top / rel if rel else top, top):
            limit, usage = _read_int(d / names[0]), _read_int(d / names[1])
            if limit is None or limit >= UNLIMITED or usage is None:
                continue
            found.append(max(0, limit - max(0, usage - _page_cache(d / "memory.stat"))))
    return min(found) if found else None


def available_host_bytes(meminfo: str | Path = "/proc/meminfo", proc_cgroup: str | Path = "/proc/self/cgroup",
                         cgroup_root: str | Path = "/sys/fs/cgroup") -> int | None:
    """What the process may still take: the least of ``MemAvailable`` and its cgroups' headroom;
    None where neither can be read."""
    known = [v for v in (meminfo_available(meminfo), cgroup_headroom(proc_cgroup, cgroup_root)) if v is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class HostMemoryShare:
    """The launcher's snapshot: scheduler processes of this launch on this host, and the memory
    the host (its cgroups counted) had available before any of them started."""

    ranks: int = 1
    """Scheduler processes of the launch on this host, each with its own host KV pool:
    ``ceil(dp x tp x pp / nnodes)``."""
    available_bytes: int | None = None
    """:func:`available_host_bytes` in the launcher (None: unknown, only each rank's own check)."""

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or not 1 <= self.ranks <= MAX_RANKS:
            raise ValueError(f"ranks={self.ranks!r} is out of range [1, {MAX_RANKS}]")
        if self.available_bytes is not None and (
            isinstance(self.available_bytes, bool) or not isinstance(self.available_bytes, int)
            or self.available_bytes < 0
        ):
            raise ValueError(f"available_bytes={self.available_bytes!r} must be a byte count >= 0 or null")

    @classmethod
    def at_launch(cls, *, tp_size: int, pp_size: int, dp_size: int, nnodes: int,
                  available: int | None) -> HostMemoryShare:
        """The share of a launch with SGLang's parallel sizes (attention DP runs inside the TP
        group, so ``dp_size`` counts replicas: SGLang's ``compute_world_size``)."""
        world = max(1, int(dp_size or 1)) * max(1, int(tp_size or 1)) * max(1, int(pp_size or 1))
        return cls(ranks=-(-world // max(1, int(nnodes or 1))), available_bytes=available)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> HostMemoryShare:
        """Parse :meth:`to_json`'s output; ValueError naming what is wrong."""
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict) or set(data) != {"ranks", "available_bytes"}:
            raise ValueError(f"{raw!r}: want an object with exactly 'ranks' and 'available_bytes'")
        return cls(ranks=data["ranks"], available_bytes=data["available_bytes"])
