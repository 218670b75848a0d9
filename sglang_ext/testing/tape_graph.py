"""TapeGraph: CUDA-graph capture and replay, emulated on the CPU.

A CUDA graph records kernels at capture and replays them later at the same addresses with the
same arguments; no Python runs in a replay. A decode captured that way is right only if every
step's data reaches the kernels through memory that stays put (the reason for
:class:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers`). Running the captured
function again -- an eager stand-in -- checks none of that: it rebuilds every table from Python.

This records instead. Inside :meth:`TapeGraph.capture` a ``TorchDispatchMode`` runs and writes
down every aten op with the tensors it took and the tensors it made, and every Triton launch
(``TRITON_INTERPRET=1``: the interpreter's ``GridExecutor``) with its arguments;
:meth:`TapeGraph.replay` runs that tape again, op by op on the recorded tensors, each op's
result copied into the tensor it made at capture (its address, as a graph's memory pool keeps
it). What was captured is what replays: a table built fresh each step, a Python int of the
captured step, a tensor made from a list -- all replay as they were at capture, exactly where a
CUDA graph would read stale data.

Capture refuses what CUDA refuses while a stream captures, with CUDA's wording: a host read of
device data (``item()``, ``bool()``, ``tolist()``, ``nonzero``, ``.cpu()``, an op whose result
is a Python value -- :data:`~sglang_ext.testing.op_audit.SYNC_OPS`,
:data:`~sglang_ext.testing.op_audit.HOST_READS`), an op whose output size the device decides
(a bool-mask index, ``repeat_interleave`` without ``output_size``:
:func:`~sglang_ext.testing.op_audit.data_dependent`) and a tensor made from Python data
(:data:`HOST_DATA`). Not emulated (all one device here): a ``.to()`` between host and device,
streams and events, and lifetimes -- the tape keeps every tensor it recorded alive, where a
graph keeps only addresses, so a buffer rebound after capture replays here and reads freed memory
on a GPU (graph review, session 64).

As ``CudaGraph`` (``sglang_ext/tools/gpu_check_graph.py``), capture first runs the function
eagerly :data:`WARMUP_RUNS` times. Two differences from CUDA, both stated: the captured run
executes (CUDA only records), so its side effects happen once more -- the functions captured
here are idempotent until their step ends, as a graph's must be; and the tensors the captured
run made are filled with NaN after it (floating ones), so a reader that forgets to replay sees
garbage, as it would on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_ext.testing.op_audit import SYNC_OPS, data_dependent, hooked_host_reads

WARMUP_RUNS = 2
"""Eager runs before the captured one (``CudaGraph``'s, ``torch.cuda.graphs``' advice)."""
CAPTURE_ERROR = "operation not permitted when stream is capturing"
"""CUDA's message for a host sync inside a capture (``cudaErrorStreamCaptureUnsupported``)."""
ALLOCATIONS = frozenset({"aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default",
                         "aten.empty_like.default", "aten.new_empty_strided.default"})
"""Ops that only allocate: a graph holds no kernel for them (their contents are undefined)."""
HOST_DATA = frozenset({"aten.lift_fresh.default", "aten.lift_fresh_copy.default"})
"""A tensor made from Python data (``torch.tensor([...])``): on a GPU it reaches the kernels by a
pageable host-to-device copy, which a capture refuses (and which a replay would not repeat). A
0-dim one is let through: made without a device it stays a CPU scalar, which a CUDA kernel takes
as an argument, its value baked into the graph at capture (Gemma-2's embedding normalizer,
``torch.tensor(hidden_size ** 0.5)`` in every forward, captured by SGLang on a GPU)."""

COLLECTIVES = ("c10d.",)
"""Collectives a captured forward may run (a TP layer's all-reduce, the logits' all-gather:
SGLang's on a CPU are gloo's ``torch.distributed`` ops, on a GPU NCCL's or its custom all-reduce,
kernels of the graph). Each writes its recorded output tensors in place and returns its ``Work``;
a replay reruns it there, waited, at its place in the tape: every rank replays the same graph, so
the ranks' collectives pair up as in the captured run. Recorded whatever their group: a CUDA graph
would not rerun a CPU (gloo) group's collective, so a forward running one would replay here what a
GPU would not (SGLang's forwards run none; review, session 90)."""


def _tensors(out: Any) -> list[torch.Tensor] | None:
    """``out``'s tensors (a tensor, or a tuple/list of them), None for anything else."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
        return list(out)
    return None


def _mutates(func: Any) -> bool:
    """The op writes one of its arguments (in-place or ``out=``): replaying it writes there again."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: TapeGraph) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tape = self.tape
        if tape.paused:  # inside a recorded kernel launch: the kernel's own business
            return func(*args, **kwargs)
        name = str(func)
        if name in SYNC_OPS or data_dependent(name, args, kwargs):
            raise RuntimeError(f"{CAPTURE_ERROR}: {name} reads device data on the host (TapeGraph)")
        if name in HOST_DATA and not (args and isinstance(args[0], torch.Tensor) and args[0].dim() == 0):
            raise RuntimeError(f"{CAPTURE_ERROR}: {name} copies host data into the graph (TapeGraph)")
        out = func(*args, **kwargs)
        mutating = _mutates(func)
        if name.startswith(COLLECTIVES):  # a TP all-reduce or all-gather: a kernel of the graph (NCCL's), here gloo's, run again
            tape.tape.append(("collective", func, args, kwargs))
            return out
        made = _tensors(out)
        if made is None:
            if not (mutating and out is None):  # an in-place op returning nothing (``_foreach_mul_``) is a kernel
                raise RuntimeError(f"{CAPTURE_ERROR}: {name} returned a host value {type(out).__name__} (TapeGraph)")
            made = []
        if func.is_view or name in ALLOCATIONS:
            if name in ALLOCATIONS:
                tape.made.update(t.untyped_storage().data_ptr() for t in made)
            return out
        tape.tape.append(("op", func, args, kwargs, None if mutating else made))
        if not mutating:
            tape.made.update(t.untyped_storage().data_ptr() for t in made)
        return out


class TapeGraph:
    """``capture(fn)`` / ``replay()`` as ``CudaGraph`` (module docstring); ``device`` is accepted
    for that signature (the tape runs where the tensors are)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.capturing = False
        """The recorded run is under way (``torch.cuda.is_current_stream_capturing``'s stand-in:
        not during the warm-ups)."""
        self.tape: list[tuple[Any, ...]] = []
        """The recorded entries: ``("op", func, args, kwargs, made | None)`` and
        ``("kernel", executor, args, kwargs)``."""
        self.made: set[int] = set()
        """Storages the captured run allocated (their floating outputs are poisoned after it)."""
        self.paused = False
        self.replays = 0

    @property
    def ops(self) -> int:
        return sum(1 for e in self.tape if e[0] == "op")

    @property
    def kernels(self) -> int:
        return sum(1 for e in self.tape if e[0] == "kernel")

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Warm-ups, then ``fn`` once recorded; its result (the graph's static outputs)."""
        if self.tape:
            raise RuntimeError("TapeGraph.capture: already captured (one graph, one capture)")
        for _ in range(WARMUP_RUNS):
            fn()
        executor = _grid_executor()
        launch = None if executor is None else executor.__call__
        if executor is not None:
            executor.__call__ = self._recording_launch(launch)
        self.capturing = True
        try:
            with hooked_host_reads(self._refuse), _Recorder(self):
                out = fn()
        finally:
            self.capturing = False
            if executor is not None:
                executor.__call__ = launch
        for t in _tensors(out) or []:
            if t.is_floating_point() and t.untyped_storage().data_ptr() in self.made:
                t.fill_(float("nan"))
        return out

    def replay(self) -> None:
        """The tape again: each op on its recorded tensors, its result into the tensors it made."""
        if not self.tape:
            raise RuntimeError("TapeGraph.replay: nothing captured")
        self.replays += 1
        for entry in self.tape:
            if entry[0] == "kernel":
                _, executor, args, kwargs = entry
                executor(*args, **kwargs)
                continue
            if entry[0] == "collective":  # in place on its recorded tensors, waited (a graph orders it)
                _, func, args, kwargs = entry
                out = func(*args, **kwargs)
                (out[-1] if isinstance(out, tuple) else out).wait()  # (outputs, Work), or a bare Work
                continue
            _, func, args, kwargs, made = entry
            out = func(*args, **kwargs)
            if made is not None:
                for dst, src in zip(made, _tensors(out) or [], strict=True):
                    if dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)

    def _refuse(self, name: str) -> None:
        if not self.paused:
            raise RuntimeError(f"{CAPTURE_ERROR}: Tensor.{name} reads device data on the host (TapeGraph)")

    def _recording_launch(self, launch: Callable[..., Any]) -> Callable[..., Any]:
        graph = self

        def recorded(executor: Any, *args: Any, **kwargs: Any) -> Any:
            if graph.paused:
                return launch(executor, *args, **kwargs)
            graph.tape.append(("kernel", executor, args, kwargs))
            graph.paused = True
            try:
                return launch(executor, *args, **kwargs)
            finally:
                graph.paused = False

        return recorded


def _grid_executor() -> Any:
    """Triton's interpreter launcher class, or None where Triton is not installed."""
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        return None
    return GridExecutor
