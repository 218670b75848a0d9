"""Host KV pool sizing and allocation (issue 14 item 4): the launch check's figures and remedies,
exact-size pinning (GPU), zeros on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.dataplane.host_memory_share import HostMemoryShare, cgroup_headroom
from sglang_ext.dataplane.host_pool import (
    AVAILABLE_SHARE,
    GB,
    allocate_host_pool,
    available_host_bytes,
    host_pool_limit,
    release_registration,
)


def test_explicit_cap_refuses_a_pool_it_cannot_hold_and_names_the_remedy():
    host_pool_limit(int(1.9 * GB), 2.0, None, what="every layer")  # fits: no error
    with pytest.raises(ValueError) as err:
        host_pool_limit(int(2.5 * GB), 2.0, 10**15, what="every layer of 100 pages")
    assert str(err.value) == (
        "--kv-host-pool-gb=2.0: the host KV pool must hold every layer of 100 pages = 2.500 GB; "
        "raise it or lower --max-total-tokens"
    )


def test_default_is_checked_against_available_memory():
    host_pool_limit(int(7 * GB), None, int(10 * GB), what="x")  # 7 <= 0.8 * 10
    with pytest.raises(ValueError, match=r"more than 80% of the host's available memory \(10.000 GB, cgroup memory"):
        host_pool_limit(int(8.5 * GB), None, int(10 * GB), what="x")
    host_pool_limit(int(8.5 * GB), 9.0, int(10 * GB), what="x")  # an explicit cap overrides the check
    host_pool_limit(int(1e15), None, None, what="x")  # unknown availability: SGLang's own limits apply
    assert AVAILABLE_SHARE == 0.8


def test_on_cpu_the_device_pool_counts_against_available_memory_too():
    """--device cpu: the device KV pool is host memory as well. A launch without
    --max-total-tokens had SGLang size 30 M tokens on a 23 GB host: 15.4 GB of host pool passed
    the check alone, and the scheduler was killed for memory once the device pool (as large)
    was allocated too. Control: the same host pool alone passes; an explicit cap overrides."""
    host_pool_limit(int(5 * GB), None, int(10 * GB), what="x")  # alone: 5 <= 8
    with pytest.raises(ValueError) as err:
        host_pool_limit(int(5 * GB), None, int(10 * GB), what="x", device_in_host_bytes=int(5 * GB))
    message = str(err.value)
    assert "device KV pool, which on CPU is host memory too (5.000 GB), need 10.000 GB" in message
    assert "--kv-gpu-budget-tokens" in message and "--max-total-tokens" in message
    host_pool_limit(int(5 * GB), None, int(10 * GB), what="x", device_in_host_bytes=int(2 * GB))
    host_pool_limit(int(5 * GB), 6.0, int(10 * GB), what="x", device_in_host_bytes=int(5 * GB))


def test_available_memory_is_read_from_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    no_cgroup = dict(proc_cgroup=tmp_path / "none", cgroup_root=tmp_path)
    f.write_text("MemTotal:       24000000 kB\nMemAvailable:   12000000 kB\n")
    assert available_host_bytes(f, **no_cgroup) == 12_000_000 * 1024
    f.write_text("MemTotal: 1 kB\n")
    assert available_host_bytes(f, **no_cgroup) is None
    assert available_host_bytes(tmp_path / "missing", **no_cgroup) is None
    real = available_host_bytes()
    assert real is None or real > 0


def _cgroup(root, rel, files):
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)


def test_a_cgroup_v2_memory_limit_caps_what_the_host_has_available(tmp_path):
    """A container allowed 64 GiB on a host with 1.5 TB available: the pool may take 80% of the
    cgroup's headroom (its limit less what it uses, file page cache -- active or not -- not counted), the
    tightest of the cgroup and its parents. Controls: "max" is no limit; without cgroups the
    host's MemAvailable stands."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 1500000000 kB\n")
    root = tmp_path / "cg"
    _cgroup(root, "", {"cgroup.controllers": "cpu memory\n"})
    _cgroup(root, "kubepods", {"memory.max": "max\n", "memory.current": str(900 << 30)})
    _cgroup(root, "kubepods/pod1", {"memory.max": str(64 << 30), "memory.current": str(10 << 30),
                                    "memory.stat": f"anon 1\nactive_file {1 << 30}\ninactive_file {3 << 30}\n"})
    _cgroup(root, "kubepods/pod1/c1", {"memory.max": "max\n", "memory.current": str(10 << 30)})
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/c1\n")
    assert cgroup_headroom(proc, root) == (64 << 30) - (6 << 30)  # 10 GiB used, 4 of it page cache (1 active)
    assert available_host_bytes(meminfo, proc, root) == 58 << 30
    with pytest.raises(ValueError, match=r"\(62.277 GB, cgroup memory limits counted\)"):
        host_pool_limit(55 * 10**9, None, available_host_bytes(meminfo, proc, root), what="x")
    (root / "kubepods/pod1/memory.max").write_text("max\n")  # control: no limit anywhere
    assert cgroup_headroom(proc, root) is None
    assert available_host_bytes(meminfo, proc, root) == 1_500_000_000 * 1024
    host_pool_limit(55 * 10**9, None, available_host_bytes(meminfo, proc, root), what="x")


def test_a_cgroup_v1_memory_limit_counts_too(tmp_path):
    """cgroup v1 (and hybrid hosts, whose v2 hierarchy under ``unified`` has no memory files):
    ``memory.limit_in_bytes`` less ``memory.usage_in_bytes`` (page cache not counted); a limit of
    2**63 rounded down to a page is no limit. Inside a container's namespace the path may not
    exist under the mount: the mount's own files are read."""
    root = tmp_path / "cg"
    _cgroup(root, "unified", {"cgroup.procs": ""})
    _cgroup(root, "memory", {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "1"})
    _cgroup(root, "memory/job", {"memory.limit_in_bytes": str(32 << 30), "memory.usage_in_bytes": str(8 << 30),
                                 "memory.stat": f"inactive_file 1\ntotal_inactive_file {1 << 30}\n"
                                                f"active_file 1\ntotal_active_file {1 << 30}\n"})
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/job\n1:cpu:/\n0::/\n")
    assert cgroup_headroom(proc, root) == (32 << 30) - (6 << 30)
    proc.write_text("4:memory:/elsewhere\n0::/\n")  # not under the mount: the mount's own (no limit)
    assert cgroup_headroom(proc, root) is None
    (root / "memory/memory.limit_in_bytes").write_text(str(16 << 30))
    assert cgroup_headroom(proc, root) == (16 << 30) - 1
    assert cgroup_headroom(tmp_path / "missing", root) is None


def test_the_pools_of_every_scheduler_on_the_host_are_checked_together():
    """Eight ranks (--tp-size 8) each pinning 55 GB passed one at a time against a 512 GB host
    (55 <= 0.8 x 480 each) and ran the node out of memory: all eight are held against what the
    host had at launch. Controls: one rank passes; a 1 TB host passes; an explicit cap overrides;
    no snapshot leaves each rank's own check."""
    need, host = 55 * 10**9, 480 * 10**9
    eight = HostMemoryShare.at_launch(tp_size=8, pp_size=1, dp_size=1, nnodes=1, available=host)
    host_pool_limit(need, None, host, what="x")  # one at a time: passes
    with pytest.raises(ValueError) as err:
        host_pool_limit(need, None, host, what="every layer of 9 pages", share=eight)
    assert str(err.value) == (
        "the 8 scheduler processes this launch starts on this host (--tp-size x --pp-size x --dp-size / "
        "--nnodes) each pin a host KV pool of every layer of 9 pages = 55.000 GB: 440.000 GB in all, more than "
        "80% of the host's available memory when the server was launched (480.000 GB, cgroup memory limits "
        "counted); lower --max-total-tokens (or set --kv-host-pool-gb to override the check)")
    host_pool_limit(need, None, host, what="x", share=HostMemoryShare(ranks=1, available_bytes=host))
    host_pool_limit(need, None, host, what="x", share=HostMemoryShare(ranks=8, available_bytes=1000 * 10**9))
    host_pool_limit(need, 60.0, host, what="x", share=eight)
    host_pool_limit(need, None, host, what="x", share=HostMemoryShare(ranks=8, available_bytes=None))
    with pytest.raises(ValueError, match="device KV pool, host memory on CPU, 5.000 GB: 80.000 GB in all"):
        host_pool_limit(5 * 10**9, None, None, what="x", device_in_host_bytes=5 * 10**9,
                        share=HostMemoryShare(ranks=8, available_bytes=90 * 10**9))


@pytest.mark.parametrize(("sizes", "ranks"), [
    (dict(tp_size=8, pp_size=1, dp_size=1, nnodes=1), 8),
    (dict(tp_size=8, pp_size=2, dp_size=1, nnodes=2), 8),
    (dict(tp_size=2, pp_size=1, dp_size=2, nnodes=1), 4),
    (dict(tp_size=3, pp_size=1, dp_size=1, nnodes=2), 2),
    (dict(tp_size=1, pp_size=None, dp_size=None, nnodes=None), 1),
])
def test_the_ranks_on_a_host_are_the_launchs_processes_over_its_nodes(sizes, ranks):
    share = HostMemoryShare.at_launch(**sizes, available=7)
    assert share == HostMemoryShare(ranks=ranks, available_bytes=7)
    assert HostMemoryShare.from_json(share.to_json()) == share


def test_cpu_pool_is_zeroed_and_unpinned():
    pool = allocate_host_pool((3, 4, 2), torch.float32, pin=False)
    assert pool.shape == (3, 4, 2) and not pool.is_pinned() and torch.count_nonzero(pool) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_is_pinned_at_exactly_its_size():
    """An odd size (not a power of two) is pinned as is and is a valid DMA source."""
    shape = (3 * 1024 * 1024 + 7,)
    pool = allocate_host_pool(shape, torch.float16, pin=True)
    assert pool.is_pinned() and pool.numel() == shape[0]
    pool[:16] = 1.0
    dev = pool[:16].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert bool((dev == 1.0).all())


class Cudart:
    """Records the driver calls of :func:`release_registration` (CUDA does not run here)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802 - cudart's name
        self.calls.append(("unregister", pointer))
        return 0


def test_a_registered_pool_is_released_after_the_devices_work():
    """The device's copies finish before the pages are unregistered; a wait that fails (CUDA torn
    down at exit) still unregisters them. Control: the order is checked, so unregistering first
    fails it."""
    calls: list = []
    release_registration(Cudart(calls), 0x1000, 3, synchronize=lambda device: calls.append(("sync", device)))
    assert calls == [("sync", 3), ("unregister", 0x1000)]

    def torn_down(device: int) -> None:
        calls.append(("sync", device))
        raise RuntimeError("CUDA driver shutting down")

    calls.clear()
    release_registration(Cudart(calls), 0x2000, 0, synchronize=torn_down)
    assert calls == [("sync", 0), ("unregister", 0x2000)]
