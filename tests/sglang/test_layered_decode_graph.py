"""LayeredDecodeGraph on the core, SGLang-free: what it admits to a replay, what it declines, and
how the eager forward of a declined step is recognised (``docs/cuda-graphs.md``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_results import RequestResidency
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from sglang_ext.layered_decode_graph import LayeredDecodeGraph

LAYERS, PAGES = 2, 16


def _identity_core(partial: bool) -> LayeredKVCore:
    """Requests A (slots 1-3) and B (4-5) prefilled in the identity layout; with ``partial`` the
    plan keeps B's layer 1 on host. Then A's decode step (new slot 6) alone."""
    config = SlotStoreConfig(layers=LAYERS, page_size=1, kv_heads=1, head_dim=2, logical_pages=PAGES,
                             device_pages=LAYERS * PAGES, dtype=torch.float32, device="cpu", graph_sink=True)
    core = LayeredKVCore(config)
    core.paged_reads, core.token_tables = True, False
    core.prepare_step([("A", torch.tensor([1, 2, 3]))], torch.tensor([1, 2, 3]), [3])
    core.prepare_step([("B", torch.tensor([4, 5]))], torch.tensor([4, 5]), [2])
    core.pipeline.end_step()
    core.update_residency({"A": RequestResidency(pages=(1, 2, 3), gpu_layers=(True, True)),
                           "B": RequestResidency(pages=(4, 5), gpu_layers=(True, not partial))})
    core.prepare_step([("A", torch.tensor([1, 2, 3, 6]))], torch.tensor([6]))
    return core


def _batch(rids: list[str], lens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(rids=rids, seq_lens_cpu=torch.tensor(lens), out_cache_loc=torch.tensor([6]))


def test_identity_steps_replay_only_in_the_layout_the_graphs_were_captured_in():
    """A paused or partly offloaded request anywhere makes the identity layout build general tables
    (rows of the whole pool): the graphs, captured writing by slot id within a layer, would write
    those rows into another layer's memory -- so the step runs eagerly."""
    core = _identity_core(partial=True)
    assert core.store.identity and core.tables.rows is not None
    graph = LayeredDecodeGraph(core, max_bs=2)
    assert graph.buffers.why_not(core.tables, 2) is None  # before a capture: no layout to keep
    graph.capture(2)
    assert not graph.admit(2, torch.tensor([6]), ("A",))
    assert graph.eager_reasons == {"the step's tables are not in the layout the graphs were captured in": 1}
    control = _identity_core(partial=False)  # every live request resident: in-place tables, admitted
    graph = LayeredDecodeGraph(control, max_bs=2)
    graph.capture(2)
    assert control.tables.rows is None and graph.admit(2, torch.tensor([6]), ("A",)) and graph.admitted


def test_the_eager_forward_of_a_declined_step_is_recognised_once_by_requests_and_lengths():
    graph = LayeredDecodeGraph(_identity_core(partial=True), max_bs=2)
    key = graph.step_key(_batch(["A"], [4]))
    graph.decline("the step stages pages", key)
    assert not graph.declined(_batch(["A"], [5]))  # another step: its boundary must run
    graph.decline("the step stages pages", key)
    assert graph.declined(_batch(["A"], [4]))  # SGLang's copy of the declined batch
    assert not graph.declined(_batch(["A"], [4]))  # taken: a later identical key runs its boundary
    graph.decline("the step recomputes a prefix", ())  # declined before its boundary: nothing to skip
    assert not graph.declined(_batch(["A"], [4]))
    assert graph.eager_reasons == {"the step stages pages": 2, "the step recomputes a prefix": 1}


def test_a_replay_of_a_step_that_was_not_admitted_is_refused():
    core = _identity_core(partial=False)
    graph = LayeredDecodeGraph(core, max_bs=2)
    graph.capture(2)
    with pytest.raises(RuntimeError, match="did not admit"):
        graph.replaying()
    assert graph.admit(2, torch.tensor([6]), ("A",))
    graph.replaying(2)  # admitted, at the size replayed: taken
    with pytest.raises(RuntimeError, match="did not admit"):
        graph.replaying()
    assert graph.admit(2, torch.tensor([6]), ("A",))  # a replay of another size than the step was loaded for
    with pytest.raises(RuntimeError, match="graph of 1 rows for a step kvplane loaded padded to 2"):
        graph.replaying(1)


def test_a_pool_without_a_sink_page_cannot_capture():
    config = SlotStoreConfig(layers=LAYERS, page_size=1, kv_heads=1, head_dim=2, logical_pages=PAGES,
                             device_pages=LAYERS * PAGES, dtype=torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="--kv-cuda-graphs on"):
        LayeredDecodeGraph(LayeredKVCore(config), max_bs=2)


def test_non_decode_steps_sglang_would_replay_are_declined_and_a_replay_ends_the_capture_flag():
    """On CUDA SGLang asks ``can_run_graph`` for IDLE, TARGET_VERIFY and DLLM_EXTEND steps too
    (``is_cuda_graph``); kvplane admits none, so answering SGLang's True let a replay raise "did
    not admit" (graph review, session 64). They are declined, counted; a decode step still runs
    kvplane's boundary and is admitted (control). After a capture, the replay clears the
    capture's ``forward`` flag (it stayed until the next metadata)."""
    from sglang_ext import graph_runner_hooks

    core = _identity_core(partial=False)
    graph = LayeredDecodeGraph(core, max_bs=2)
    graph.capture(2)
    boundaries: list[object] = []
    backend = SimpleNamespace(graph=graph, recompute_inputs=None, init_forward_metadata=boundaries.append)
    runner = SimpleNamespace(attn_backend=backend, capture_bs=[1, 2], _pad_to_bucket=lambda bs, buckets: 2)

    def batch(decode: bool) -> SimpleNamespace:
        return SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: decode), batch_size=1,
                               out_cache_loc=torch.tensor([6]), rids=["A"], seq_lens_cpu=torch.tensor([4]))

    sglang_yes = lambda runner, fb: True  # noqa: E731
    assert graph_runner_hooks.around_can_run_graph(sglang_yes, runner, batch(decode=False)) is False
    assert graph.eager_reasons == {"not a decode step": 1} and boundaries == [] and not graph.admitted
    assert graph_runner_hooks.around_can_run_graph(sglang_yes, runner, batch(decode=True)) is True
    assert len(boundaries) == 1 and graph.admitted
    graph.forward = True  # as a capture leaves it
    graph.replaying()
    assert graph.forward is False


def test_a_sampled_replay_hands_the_timer_the_events_its_graph_records():
    """The Triton backend's replay metadata (``init_forward_metadata_out_graph``) gives the layer
    timer the timing events the graph of the admitted size recorded at its capture (each layer's
    ``enter``): a sampled replayed step reports per-layer times. The device's part -- stamping
    the events as the replay runs -- is played by hand (``StampClock``; on a GPU the graph's event
    nodes do it: ``tests/dataplane/test_graph_layer_marks_gpu.py``). Control: a replay at a size
    whose capture recorded no marks reports nothing."""
    from sglang_ext.dataplane.graph_layer_marks import GraphLayerMarks
    from sglang_ext.layer_timing import LayerTimer
    from sglang_ext.layered_triton_decode import LayeredTritonDecode
    from sglang_ext.testing.stamp_clock import StampClock

    clock = StampClock()
    graph = LayeredDecodeGraph(_identity_core(partial=False), max_bs=2)
    graph.buffers.marks = GraphLayerMarks(LAYERS, clock.event, clock)
    timer = LayerTimer(LAYERS, every=1, event=clock.event)
    backend = SimpleNamespace(graph=graph, layer_timer=timer)
    for size in (2, 1):  # SGLang captures largest first; only size 2's capture runs the layers here
        LayeredTritonDecode.init_forward_metadata_out_graph(backend, SimpleNamespace(batch_size=size), True)
        clock.capturing = size == 2
        for layer in range(LAYERS):
            graph.enter(layer)  # as forward_decode does in graph mode
        clock.capturing = False

    def replayed_step(size: int) -> tuple[float, ...] | None:
        timer.begin(True)
        assert graph.admit(size, torch.tensor([6]), ("A",))
        LayeredTritonDecode.init_forward_metadata_out_graph(backend, SimpleNamespace(batch_size=size), False)
        marks = graph.buffers.marks.of(size)
        for layer in range(LAYERS) if marks is not None else ():  # the graph's event nodes
            marks[0][layer].record()
            clock.ms += 0.5
            marks[1][layer].record()
            clock.ms += layer + 1.0
        timer.end()
        return timer.take()

    assert replayed_step(2) == (1.0, 2.0)
    assert timer.last_stall_ms == (0.5, 0.5)
    assert replayed_step(1) is None  # control


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap-loop", "normal-loop"])
def test_under_the_overlap_loop_a_sampled_step_runs_eagerly(overlap: bool):
    """SGLang's overlap loop replays step k+1 -- the same graph for a steady batch -- before it
    processes step k, so a sampled replay's events would be stamped again before they are read
    (graph review, session 69): there the sampled step is declined before its boundary and runs
    eagerly, timed by its own events. Controls: an unsampled step replays, and without the
    overlap loop a sampled step replays too (its sample is read before the next replay)."""
    from sglang_ext import graph_runner_hooks
    from sglang_ext.layer_timing import LayerTimer

    graph = LayeredDecodeGraph(_identity_core(partial=False), max_bs=2)
    graph.capture(2)
    timer = LayerTimer(LAYERS, every=2, eager_samples=overlap)
    boundaries: list[object] = []
    backend = SimpleNamespace(graph=graph, recompute_inputs=None, init_forward_metadata=boundaries.append,
                              layer_timer=timer)
    runner = SimpleNamespace(attn_backend=backend, capture_bs=[1, 2], _pad_to_bucket=lambda bs, buckets: 2)
    decode = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True), batch_size=1,
                             out_cache_loc=torch.tensor([6]), rids=["A"], seq_lens_cpu=torch.tensor([4]))
    sglang_yes = lambda runner, fb: True  # noqa: E731
    timer.begin(True)  # step 0: sampled
    assert timer.wants_eager is overlap
    got = graph_runner_hooks.around_can_run_graph(sglang_yes, runner, decode)
    assert got is not overlap and len(boundaries) == (0 if overlap else 1)
    assert graph.eager_reasons == ({"a sampled step is timed eagerly (the overlap loop)": 1} if overlap else {})
    timer.end()
    timer.begin(True)  # step 1: not sampled -- replays either way
    graph.admitted = False
    assert not timer.wants_eager
    assert graph_runner_hooks.around_can_run_graph(sglang_yes, runner, decode) is True
