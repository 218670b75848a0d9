"""RequestTable: where one request's KV lives, per layer (the layer-aware block table).

For request r with ``b_r`` blocks per layer:

* ``host_blocks[j]``: host request-block j (all layers). Every request-block has one; the host
  pool is the backing store (SuperInfer eager rotation keeps it current).
* ``dev[l]``: the ``b_r`` device blocks of layer l when resident, ``None`` when in host memory.
* ``synced[l]``: leading blocks of a resident layer whose host copy is current. Offloading a
  layer writes back only blocks ``synced[l]:`` (normally just the dirty tail).
* ``staging``: ``b_r`` device blocks, one layer's worth, present iff an active request offloads
  any layer (the placement model's staging slot, ``controlplane.model.memory_blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTable:
    """Mutable per-request state, owned by :class:`LayeredKVCache`."""

    rid: str
    layers: int
    tokens: int = 0
    host_blocks: list[int] = field(default_factory=list)
    dev: list[list[int] | None] = field(default_factory=list)
    synced: list[int] = field(default_factory=list)
    staging: list[int] | None = None
    paused: bool = False
    paused_seq: int = 0
    placement_before_pause: tuple[int, ...] | None = None
    pending_start: int | None = None
    """First token appended since the last step (None when nothing is pending)."""

    def __post_init__(self) -> None:
        if not self.dev:
            self.dev = [[] for _ in range(self.layers)]
            self.synced = [0] * self.layers

    @property
    def blocks(self) -> int:
        """b_r: blocks per layer."""
        return len(self.host_blocks)

    @property
    def placement(self) -> tuple[int, ...]:
        """x[r][l]: 1 when layer l is on the device."""
        return tuple(0 if d is None else 1 for d in self.dev)

    @property
    def offloaded_layers(self) -> list[int]:
        """Layers in host memory, ascending."""
        return [layer for layer, d in enumerate(self.dev) if d is None]

    @property
    def resident_layers(self) -> list[int]:
        """Layers on the device, ascending."""
        return [layer for layer, d in enumerate(self.dev) if d is not None]

    def pages(self, layer: int) -> list[int]:
        """Device pages attention reads for ``layer``: resident blocks, else the staging slot."""
        d = self.dev[layer]
        if d is not None:
            return d
        if self.staging is None:
            raise RuntimeError(f"request {self.rid!r} layer {layer} is offloaded without staging")
        return self.staging

    def device_block_ids(self) -> list[int]:
        """Every device block this request holds (resident layers and staging)."""
        out: list[int] = []
        for d in self.dev:
            if d is not None:
                out += d
        if self.staging is not None:
            out += self.staging
        return out
