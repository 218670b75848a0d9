"""StreamOrder: the CUDA engine's stream and event protocol checked on the CPU, as a race detector.

On a GPU the served data plane runs its copies on two side streams (H2D, D2H) beside the compute
stream, ordered only by events (``CudaTransferEngine``, ``LayerPipeline``). A missing
``wait_event`` does not fail there: it corrupts KV *sometimes*, when the copy happens to run
late, which a GPU check comparing one step's attention may never see. This module runs the
same engine code on the CPU with simulated streams and events and checks every access to the
KV pools against the happens-before order those streams and events define (vector clocks):

- Actors: the host, the compute (default) stream and every stream the engine creates. Each
  stream op is stamped ``(actor, n)``; a stream's clock joins the events it waits on and the
  host's clock when the op is issued (work issued after a host action follows it); the host's
  clock joins a stream's or an event's when it synchronizes (``synchronize``). A ``query`` says
  "not yet" (copies finish as late as the order allows: the host learns nothing from one) or
  "done" once recorded (the host joins the event's clock, so what it reuses after a query is
  checked against what that event covers), by schedule: never, for the upload rings' release
  events only, or always. Any such answers are a possible execution: "done" joins exactly what
  the event covers.
- Accesses: every aten op touching a tracked storage (the host pool, the device pool, the map
  mirror, a decode step's parked-token buffer, the pinned upload rings' slots) is traced by a ``TorchDispatchMode``; the elements it reads and
  writes are found by running the same indexing on a tensor of storage offsets. Inside an
  engine copy the actor is the copy's stream; otherwise host-pool accesses are the host's and
  device ones the current stream's.
- Rules, per 32-byte granule: a read must follow the last write (RAW), a write the last write
  and every read since (WAW, WAR) -- "follow" meaning the earlier stamp is in the accessor's
  clock. Each violation is kept with the op and the actors.

The caching allocator's reuse is checked by protocol: a copy on a side stream may read a device
tensor allocated on another stream (an upload's device copy: indices, the step's tables; a
parked-token buffer) only once ``record_stream`` named the copy's stream.

The store's device paths run (``SlotKVStore.staged_uploads``, ``MapMirror.staged``): the map
mirror's columns go up through its ring, a steady step's host views are re-staged in the store's.

The uploads' device copies are memory too: each is written by the stream current at the upload,
and a copy on a side stream that reads its indices must be ordered after that write (an upload
made on one stream and read by a copy that waited only on another is a race on a GPU). Every
tensor allocated or tracked is kept alive (address reuse is checked by protocol, below).

The copies themselves run eagerly (the Triton kernels replaced by their torch reference; the
copy engines' batched memcpy at the pointer level, ``pointer_memcpy.py``), so the KV checks of
the driver still hold; the race check is what a late copy on a GPU would break.
Nothing here is a GPU measurement: it checks the ordering protocol, not timing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ACTORS = 8
GRANULE = 32
"""Bytes per tracked granule (one fp32 token row of the toy pools: 2 heads x 4)."""
HOST, COMPUTE = 0, 1
NEVER, RINGS, ALWAYS = "never", "rings", "always"
"""Schedules of ``query()`` (:class:`StreamOrder`)."""


class _Stream:
    """A simulated ``torch.cuda.Stream``: an actor with a vector clock."""

    def __init__(self, sim: StreamOrder, actor: int) -> None:
        self.sim, self.actor = sim, actor
        self.vc = np.zeros(ACTORS, dtype=np.int64)
        self.cuda_stream = 1000 + actor

    def issue(self) -> tuple[int, np.ndarray]:
        """One op issued to this stream now: its stamp and the clock it runs under."""
        np.maximum(self.vc, self.sim.host.vc, out=self.vc)
        self.vc[self.actor] += 1
        return int(self.vc[self.actor]), self.vc

    def wait_event(self, event: _Event) -> None:
        if event.vc is not None:  # waiting on a never-recorded event is a no-op in CUDA
            np.maximum(self.vc, event.vc, out=self.vc)

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event if event is not None else self.sim.Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.sim.host.join(self.vc)

    def query(self) -> bool:
        if self.sim.query_completes == ALWAYS:
            self.synchronize()
            return True
        return False


class _Host:
    def __init__(self) -> None:
        self.vc = np.zeros(ACTORS, dtype=np.int64)

    def join(self, vc: np.ndarray) -> None:
        np.maximum(self.vc, vc, out=self.vc)

    def issue(self) -> tuple[int, np.ndarray]:
        self.vc[HOST] += 1
        return int(self.vc[HOST]), self.vc


class _Event:
    """A simulated ``torch.cuda.Event``: the clock of its stream when recorded."""

    sim: StreamOrder | None = None
    completes = False
    """Whether ``query()`` says done once recorded (the simulation's schedule for this kind)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.vc: np.ndarray | None = None

    def record(self, stream: _Stream | None = None) -> None:
        assert self.sim is not None
        stream = stream if stream is not None else self.sim.current
        np.maximum(stream.vc, self.sim.host.vc, out=stream.vc)
        self.vc = stream.vc.copy()

    def wait(self, stream: _Stream | None = None) -> None:
        assert self.sim is not None
        (stream if stream is not None else self.sim.current).wait_event(self)

    def query(self) -> bool:
        """Complete when recorded if the simulation says queries complete (copies finish at once:
        the host joins the event's clock), else never (copies finish as late as the order allows:
        the host learns nothing from a query, only from a synchronize)."""
        assert self.sim is not None
        if self.vc is None:  # never recorded: nothing to wait for (CUDA says done)
            return True
        if self.completes:
            self.sim.host.join(self.vc)
            return True
        return False

    def synchronize(self) -> None:
        assert self.sim is not None
        if self.vc is not None:
            self.sim.host.join(self.vc)

    def elapsed_time(self, end: _Event) -> float:
        return 0.01


class _Tracer(TorchDispatchMode):
    def __init__(self, sim: StreamOrder) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        self.sim.trace(func, args, kwargs)
        return func(*args, **kwargs)


class StreamOrder:
    """Simulated CUDA streams and events plus the access checker (module docstring)."""

    def __init__(self, query_completes: str = NEVER) -> None:
        if query_completes not in (NEVER, RINGS, ALWAYS):
            raise ValueError(f"query_completes={query_completes!r}")
        self.query_completes = query_completes
        """Which recorded events' ``query()`` is True: none, the upload rings' release events
        only, or all (module docstring)."""
        self.host = _Host()
        self.Event = type("SimEvent", (_Event,), {"sim": self, "completes": query_completes == ALWAYS})
        """``torch.cuda.Event`` here."""
        self.RingEvent = type("SimRingEvent", (_Event,), {"sim": self, "completes": query_completes != NEVER})
        """A :class:`PinnedUploadRing`'s release event."""
        self.streams: list[_Stream] = []
        self.compute = self._new_stream()
        assert self.compute.actor == COMPUTE
        self.current = self.compute
        self.in_copy = 0
        """Depth of engine copies running (their accesses are their stream's)."""
        self._state: dict[int, dict[str, np.ndarray]] = {}
        """Tracked storage (data_ptr) -> per granule: last writer, its stamp, each actor's last read."""
        self._host_storages: set[int] = set()
        self._storages: dict[int, Any] = {}
        """Tracked storage (data_ptr) -> its untyped storage (:meth:`storage_bytes`)."""
        self._kept: list[torch.Tensor] = []
        """Every tracked tensor, kept alive: a freed one's address may come back as another
        tensor's (CUDA's caching allocator orders that reuse with ``record_stream``, which this
        does not model)."""
        self.violations: list[str] = []
        self._allocated: dict[int, int] = {}
        """Device tensors allocated during the run (storage -> the stream allocating them): the
        uploads' device copies, parked-token buffers."""
        self._recorded: set[tuple[int, int]] = set()
        """(storage, stream) pairs named by ``record_stream``."""
        self.copies = {"kernel": 0, "dma": 0}
        """Copy calls run, by path (a test checks which path ran)."""
        self.accesses = 0
        """Checked accesses (ops on tracked storages)."""

    def _new_stream(self, device: Any = None, priority: int = 0) -> _Stream:
        actor = len(self.streams) + 1
        if actor >= ACTORS:
            raise RuntimeError("StreamOrder: too many streams")
        stream = _Stream(self, actor)
        self.streams.append(stream)
        return stream

    # ----- tracked memory ------------------------------------------------------------

    def track(self, tensor: torch.Tensor, host: bool = False) -> None:
        """Check every access to ``tensor``'s storage from now on (fresh: no earlier access)."""
        self._kept.append(tensor)
        storage = tensor.untyped_storage()
        key, n = storage.data_ptr(), -(-storage.nbytes() // GRANULE)
        self._storages[key] = storage
        self._state[key] = {"writer": np.full(n, -1, dtype=np.int64), "stamp": np.zeros(n, dtype=np.int64),
                            "reads": np.zeros((ACTORS, n), dtype=np.int64)}
        if host:
            self._host_storages.add(key)
        else:
            self._host_storages.discard(key)

    def storage_bytes(self) -> dict[int, torch.Tensor]:
        """Every tracked storage as a 1-D uint8 tensor over all of it, by its address (what a raw
        pointer into tracked memory can be resolved against)."""
        out = {}
        for key, storage in self._storages.items():
            out[key] = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        return out

    def stream_of(self, handle: int) -> _Stream:
        """The simulated stream whose ``cuda_stream`` is ``handle`` (KeyError: none is)."""
        for stream in self.streams:
            if stream.cuda_stream == handle:
                return stream
        raise KeyError(f"no stream has the handle {handle}")

    def host_write(self, t: torch.Tensor) -> None:
        """The host writes ``t`` (through NumPy: not an aten op)."""
        key = t.untyped_storage().data_ptr()
        if key in self._state and t.numel():
            self._check(key, self._granules(t), True, HOST, *self.host.issue(), "host write")

    def device_write(self, t: torch.Tensor) -> None:
        """The current stream wrote all of ``t`` (an upload's device copy: tracked from here on)."""
        self.track(t)
        if t.numel():
            stream = self.current
            self._check(t.untyped_storage().data_ptr(), self._granules(t), True, stream.actor, *stream.issue(),
                        "upload")

    def _granules(self, t: torch.Tensor, pick: Any = None) -> np.ndarray:
        """Granules of ``t``'s storage that ``pick`` (a function of a same-shaped tensor of element
        offsets; None: all of ``t``) selects."""
        span = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1
        offsets = torch.as_strided(torch.arange(max(span, 1), dtype=torch.int64), t.shape, t.stride(),
                                   t.storage_offset())
        chosen = offsets if pick is None else pick(offsets)
        return np.unique(chosen.reshape(-1).numpy() * t.element_size() // GRANULE)

    def _actor(self, host_only: bool) -> tuple[int, int, np.ndarray]:
        """Who runs an op: an engine copy's stream; the host for an op on host memory alone; else
        the current stream (an op touching device memory, a copy between host and device too)."""
        if self.in_copy or not host_only:
            stream = self.current
            return (stream.actor, *stream.issue())
        return (HOST, *self.host.issue())

    def allocated(self, t: torch.Tensor) -> None:
        """``t`` was allocated on the current stream by the caching allocator: a copy on another
        stream may read it only after ``record_stream`` names that stream (else, once Python drops
        it, the allocator hands its memory to the next allocation while the copy may still read)."""
        self._kept.append(t)
        self._allocated[t.untyped_storage().data_ptr()] = self.current.actor

    def record_stream(self, t: torch.Tensor, stream: _Stream) -> None:
        self._recorded.add((t.untyped_storage().data_ptr(), stream.actor))

    def _check_recorded(self, func: Any, args: tuple) -> None:
        actor = self.current.actor
        for arg in args:
            for t in arg if isinstance(arg, list | tuple) else (arg,):
                if not isinstance(t, torch.Tensor):
                    continue
                key = t.untyped_storage().data_ptr()
                owner = self._allocated.get(key)
                if owner is not None and owner != actor and (key, actor) not in self._recorded:
                    self._recorded.add((key, actor))  # reported once
                    self.violations.append(f"{self.name(actor)} ({func}) reads a device tensor allocated on "
                                           f"{self.name(owner)} without record_stream({self.name(actor)})")

    def trace(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self.in_copy:
            self._check_recorded(func, args)
        accesses = list(self._accesses(func, args, kwargs))
        accesses = [(key, g, w) for key, g, w in accesses if key in self._state and g.size]
        if not accesses:
            return
        actor, stamp, vc = self._actor(all(key in self._host_storages for key, _, _ in accesses))
        for key, granules, write in sorted(accesses, key=lambda a: a[2]):  # reads first
            self._check(key, granules, write, actor, stamp, vc, func)

    def _accesses(self, func: Any, args: tuple, kwargs: dict) -> Iterator[tuple[int, np.ndarray, bool]]:
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        op = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else name

        def key(t: torch.Tensor) -> int:
            return t.untyped_storage().data_ptr()

        def tracked(t: Any) -> bool:
            return isinstance(t, torch.Tensor) and t.device.type == "cpu" and key(t) in self._state

        if op in ("index_copy_", "index_copy"):
            self_, dim, index, source = args[:4]
            if tracked(self_):
                yield key(self_), self._granules(self_, lambda o: o.index_select(dim, index)), True
            if tracked(source):
                yield key(source), self._granules(source), False
            return
        if op == "index_select":
            self_, dim, index = args[:3]
            if tracked(self_):
                yield key(self_), self._granules(self_, lambda o: o.index_select(dim, index)), False
            return
        if op == "index":
            self_, indices = args[:2]
            if tracked(self_):
                yield key(self_), self._granules(self_, lambda o: o[_index(indices)]), False
            return
        if op in ("index_put_", "index_put"):
            self_, indices, values = args[:3]
            if tracked(self_):
                yield key(self_), self._granules(self_, lambda o: o[_index(indices)]), True
            if tracked(values):
                yield key(values), self._granules(values), False
            return
        schema = func._schema
        if _is_view(schema):
            return
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            tensors = value if isinstance(value, list | tuple) else [value]
            write = arg.alias_info is not None and arg.alias_info.is_write
            for t in tensors:
                if tracked(t):
                    yield key(t), self._granules(t), write

    def _check(self, key: int, g: np.ndarray, write: bool, actor: int, stamp: int, vc: np.ndarray, func: Any) -> None:
        self.accesses += 1
        st = self._state[key]
        writer, wstamp, reads = st["writer"][g], st["stamp"][g], st["reads"][:, g]
        known = writer >= 0
        unordered = known & (writer != actor) & (vc[np.where(known, writer, 0)] < wstamp)
        if unordered.any():
            w = int(writer[unordered][0])
            self._violate("read" if not write else "write", "write", actor, w, func, int(unordered.sum()))
        if write:
            late = reads > vc[:, None]
            late[actor] = False
            if late.any():
                r = int(np.flatnonzero(late.any(axis=1))[0])
                self._violate("write", "read", actor, r, func, int(late.any(axis=0).sum()))
            st["writer"][g], st["stamp"][g] = actor, stamp
            st["reads"][:, g] = 0
        else:
            st["reads"][actor, g] = stamp

    def _violate(self, what: str, earlier: str, actor: int, other: int, func: Any, n: int) -> None:
        self.violations.append(f"{what} by {self.name(actor)} ({func}) not ordered after a {earlier} by "
                               f"{self.name(other)} ({n} granules)")

    def name(self, actor: int) -> str:
        return "host" if actor == HOST else "compute" if actor == COMPUTE else f"stream{actor}"

    # ----- install -----------------------------------------------------------------------

    @contextmanager
    def copying(self) -> Iterator[None]:
        self.in_copy += 1
        try:
            yield
        finally:
            self.in_copy -= 1

    def set_stream(self, stream: _Stream) -> None:
        self.current = stream

    def synchronize(self, device: Any = None) -> None:
        for stream in self.streams:
            self.host.join(stream.vc)

    def tracer(self) -> _Tracer:
        return _Tracer(self)


def _index(indices: list) -> tuple:
    """aten.index's index list as Python indexing (None: the whole dimension)."""
    return tuple(slice(None) if i is None else i for i in indices)


def _is_view(schema: Any) -> bool:
    """An op returning an alias of an input (a view: no memory access)."""
    return any(r.alias_info is not None for r in schema.returns) and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
