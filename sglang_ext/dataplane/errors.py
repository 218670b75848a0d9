"""Data-plane errors. Every message names the quantity, its value and the limit."""

from __future__ import annotations


class DataPlaneError(RuntimeError):
    """Base class of layered-KV data-plane errors. The cache state is unchanged when raised."""


class DevicePoolFull(DataPlaneError):
    """Not enough free device blocks, even after reclaiming paused requests' layers."""

    def __init__(self, what: str, needed_blocks: int, free_blocks: int, reclaimable_blocks: int) -> None:
        super().__init__(
            f"device KV pool full: {what} needs {needed_blocks} more blocks, "
            f"{free_blocks} free and {reclaimable_blocks} reclaimable from paused requests; "
            "nothing was changed"
        )
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks
        self.reclaimable_blocks = reclaimable_blocks


class HostPoolFull(DataPlaneError):
    """Not enough free host blocks (raise --kv-host-pool-gb / host_pool_gb)."""

    def __init__(self, what: str, needed_blocks: int, free_blocks: int) -> None:
        super().__init__(
            f"host KV pool full: {what} needs {needed_blocks} host blocks, {free_blocks} free "
            "(raise host_pool_gb); nothing was changed"
        )
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


class UnknownRequest(DataPlaneError, KeyError):
    """The request id is not allocated in this cache."""

    def __init__(self, rid: str) -> None:
        super().__init__(f"unknown request {rid!r}")
        self.rid = rid

    def __str__(self) -> str:
        return str(self.args[0])


class RequestStateError(DataPlaneError):
    """The operation is not allowed in the request's (or the cache's) current state."""
