"""Hooks on SGLang's decode graph runner for ``--kv-cuda-graphs on`` (``docs/cuda-graphs.md``).

SGLang asks ``DecodeCudaGraphRunner.can_run_graph(forward_batch)`` before any metadata of a
decode step is built, and never asks the attention backend: a backend cannot veto a replay. A
layered step whose layers need host work the graph does not carry (``GraphStepBuffers.why_not``)
must not replay, and which steps do is only known once kvplane's boundary has run. So, for a layered backend with graph state:

* AROUND ``can_run_graph``: SGLang's own answer first; if it would replay, kvplane's boundary runs
  now (the backend's ``init_forward_metadata``: plans, pauses, residency, the step's tables), and
  :meth:`~sglang_ext.layered_decode_graph.LayeredDecodeGraph.admit` loads the buffers padded to
  the captured size SGLang will replay at (``_pad_to_bucket``, SGLang's own rounding) or names
  why the step runs eagerly -- then the answer is False and the eager forward (on SGLang's copy of
  the batch) skips a second boundary. A recompute step is declined before its boundary, and so
  is any step that is not a decode (on CUDA SGLang asks for IDLE / TARGET_VERIFY steps too), and,
  under SGLang's overlap loop, a step the layer timer samples (``LayerTimer.wants_eager``: the
  next step's replay would stamp the graph's timing events before this one's are read).
* AROUND ``execute`` (the replay): after it, the step ends as an eager one does
  (``end_graph_step``: the last layer's exit).

With ``--tp-size > 1`` every rank asks this for the same batch, and the admission after the
boundary is a collective (:class:`~sglang_ext.graph_tp_agreement.GraphTpAgreement`: all ranks
replay or none does), so every rank must reach it. The declines before the boundary read what
every rank holds alike (the batch's mode; the recompute rows, from the broadcast plan, the
request's parameters and SGLang's slots). The layer timer is rank 0's alone, so under TP its
sampled step (the overlap loop's) is declined after the boundary instead, through the vote
(review, session 90).

Every other runner (no layered backend, or one without graph state) passes through untouched.
"""

from __future__ import annotations

from typing import Any

SAMPLED = "a sampled step is timed eagerly (the overlap loop)"


def _graph_backend(runner: Any) -> Any:
    backend = getattr(runner, "attn_backend", None)
    return backend if getattr(backend, "graph", None) is not None else None


def around_can_run_graph(original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's answer, then kvplane's (module docstring)."""
    ok = original(runner, forward_batch, *args, **kwargs)
    backend = _graph_backend(runner)
    if backend is None or not ok:
        return ok
    graph = backend.graph
    if not forward_batch.forward_mode.is_decode():  # on CUDA SGLang also asks for IDLE / TARGET_VERIFY /
        graph.decline("not a decode step", ())  # DLLM_EXTEND steps; kvplane admits none (a replay raises)
        return False
    if backend.recompute_inputs:  # its rows join the batch's inputs at the boundary: eager, one boundary
        graph.decline("the step recomputes a prefix", ())
        return False
    timer = getattr(backend, "layer_timer", None)
    sampled = timer is not None and timer.wants_eager  # the overlap loop would overwrite a replay's timing
    if sampled and graph.agreement is None:
        graph.decline(SAMPLED, ())
        return False
    core = graph.core
    core.defer_tables = graph.buffers.block is not None  # a replay never reads its tables' device half
    try:
        backend.init_forward_metadata(forward_batch)  # the boundary, as every step's
    finally:
        core.defer_tables = False
    padded = runner._pad_to_bucket(forward_batch.batch_size, runner.capture_bs)
    # declined: the eager forward's metadata (SGLang's copy of the batch) finds the boundary done
    # under TP only rank 0 has the timer: its sampled step is declined after the boundary, by the vote
    return graph.admit(padded, forward_batch.out_cache_loc, graph.step_key(forward_batch),
                       refuse=SAMPLED if sampled else None)


def around_execute(original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """The replay, then the end of the step."""
    out = original(runner, forward_batch, *args, **kwargs)
    backend = _graph_backend(runner)
    if backend is not None:
        backend.end_graph_step()
    return out


def register(hook_registry: Any, hook_type: Any, can_run_graph_path: str, execute_path: str) -> None:
    """Install both hooks (the layered plugin, ``--enable-layered-kv``)."""
    hook_registry.register(can_run_graph_path, around_can_run_graph, hook_type.AROUND)
    hook_registry.register(execute_path, around_execute, hook_type.AROUND)
