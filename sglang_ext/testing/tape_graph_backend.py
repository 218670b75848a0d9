"""TapeGraphBackend: SGLang's decode graph runner on a CPU, its graphs emulated by
:class:`~sglang_ext.testing.tape_graph.TapeGraph` (tests only).

SGLang 0.5.23 captures decode graphs through a backend object per runner
(``runner_backend.BaseCudaGraphBackend``: ``capture_one`` per batch size, ``replay`` per step); the
CUDA one makes a ``torch.cuda.CUDAGraph``. This one makes a tape: capture records every aten op and
Triton launch (``TRITON_INTERPRET=1``) of the runner's forward and refuses host reads as CUDA
does; a replay reruns the tape on the captured tensors, no Python of the model or of kvplane. So
SGLang's own ``DecodeCudaGraphRunner`` -- its padding, static inputs, metadata hooks and replay
decision -- drives the layered decode on a CPU exactly as it would on a GPU, and a layer that
reads anything but its persistent buffers replays stale data, as on a GPU.

Installed by the test injector (``tests/sglang/fault_inject/sitecustomize.py``,
``KVPLANE_TEST_TAPE_GRAPHS``), which also gives SGLang's CPU platform the capability to capture
and swaps the CUDA stream plumbing around capture for no-ops. Each capture and replay appends a
line to the file the variable names, with the TP rank that made it (the tests' evidence that
steps replayed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sglang_ext import compat
from sglang_ext.testing.tape_graph import TapeGraph

BaseCudaGraphBackend = compat.resolve(compat.GRAPH_BACKEND_BASE.path)


class TapeGraphBackend(BaseCudaGraphBackend):  # type: ignore[misc,valid-type]
    """One :class:`TapeGraph` per captured shape; ``log``: the file each capture and replay is
    appended to."""

    def __init__(self, runner: Any, log: str | Path, **_: Any) -> None:
        self.log = Path(log)
        self.graphs: dict[Any, tuple[TapeGraph, Any]] = {}

    def _note(self, line: str) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0  # a TP server's ranks share the file
        with self.log.open("a", encoding="utf-8") as out:
            out.write(f"{line} rank={rank}\n")

    @contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        yield

    def capture_one(self, shape_key: Any, forward_fn: Callable[[], Any], capture_inputs: Any = None,
                    post_warmup_hook: Callable[[], None] | None = None) -> None:
        graph = TapeGraph()
        static = graph.capture(forward_fn)  # its warm-ups stand in for SGLang's two
        self.graphs[shape_key] = (graph, static)
        self._note(f"capture {shape_key.size} ops={graph.ops} kernels={graph.kernels}")

    def can_run(self, forward_batch: Any, shape_key: Any) -> bool:
        return shape_key in self.graphs

    @contextmanager
    def replay_session(self) -> Iterator[None]:
        yield

    def replay(self, shape_key: Any, static_forward_batch: Any, **_: Any) -> Any:
        graph, static = self.graphs[shape_key]
        graph.replay()
        self._note(f"replay {shape_key.size}")
        return static

    def cleanup(self) -> None:
        self.graphs.clear()
