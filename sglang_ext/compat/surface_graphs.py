"""The SGLang decode graph runner objects ``--kv-cuda-graphs on`` relies on (``docs/cuda-graphs.md``).

Part of :mod:`sglang_ext.compat.surface` (imported there, so in its ``TARGETS``): the runner's two
methods kvplane wraps (:mod:`sglang_ext.graph_runner_hooks`), what those wrappers read on it, and
the attention-backend graph hooks the layered paged decodes implement
(:mod:`sglang_ext.layered_graph_decode`, with FlashInfer's per-replay plan in
:mod:`sglang_ext.layered_flashinfer_decode`).
"""

from __future__ import annotations

from sglang_ext.compat.target import Target

_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
_BACKEND = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"

__all__ = ["GRAPH_BACKEND_BASE", "DECODE_GRAPH_RUNNER", "DECODE_GRAPH_CAN_RUN", "DECODE_GRAPH_EXECUTE", "BACKEND_GRAPH_HOOKS",
           "BACKEND_GRAPH_STATE", "BACKEND_GRAPH_OUT", "BACKEND_GRAPH_IN", "TP_GROUP"]

GRAPH_BACKEND_BASE = Target("sglang.srt.model_executor.runner_backend.base_cuda_graph_backend.BaseCudaGraphBackend",
                            attrs=("capture_session", "capture_one", "can_run", "replay_session", "replay", "cleanup"),
                            used_by=("testing.tape_graph_backend",))
"""How a runner makes and replays its graphs; the tests' CPU emulation subclasses it."""
DECODE_GRAPH_RUNNER = Target(_RUNNER, attrs=("attn_backend", "capture_bs", "_pad_to_bucket"),
                             used_by=("graph_runner_hooks",))
"""``_pad_to_bucket(raw_bs, capture_bs)``: the captured size SGLang replays a batch at."""
DECODE_GRAPH_CAN_RUN = Target(f"{_RUNNER}.can_run_graph", params=("self", "forward_batch"),
                              used_by=("graph_runner_hooks", "plugin"))
"""Asked before any metadata of a decode step: kvplane's boundary and admission run inside it."""
DECODE_GRAPH_EXECUTE = Target(f"{_RUNNER}.execute", params=("self", "forward_batch"),
                              used_by=("graph_runner_hooks", "plugin"))
"""The replay; the step ends after it."""
BACKEND_GRAPH_HOOKS = Target(_BACKEND, attrs=("init_cuda_graph_state", "get_cuda_graph_seq_len_fill_value",
                                              "init_forward_metadata_out_graph", "init_forward_metadata_in_graph"),
                             used_by=("layered_graph_decode", "layered_attention"))
BACKEND_GRAPH_STATE = Target(f"{_BACKEND}.init_cuda_graph_state", params=("self", "max_bs", "max_num_tokens"),
                             used_by=("layered_graph_decode", "layered_flashinfer_decode"))
BACKEND_GRAPH_OUT = Target(f"{_BACKEND}.init_forward_metadata_out_graph", params=("self", "forward_batch"),
                           keyword=("in_capture",), used_by=("layered_graph_decode", "layered_flashinfer_decode"))
"""Runs outside the graph at each capture (``in_capture=True``) and before each replay."""
BACKEND_GRAPH_IN = Target(f"{_BACKEND}.init_forward_metadata_in_graph", params=("self", "forward_batch"),
                          used_by=("layered_graph_decode",))
"""Recorded into the graph: the layered decode records nothing there."""
TP_GROUP = Target("sglang.srt.distributed.parallel_state.get_tp_group", params=(), used_by=("graph_tp_agreement",))
"""The process's TP ``GroupCoordinator`` (``world_size``, ``cpu_group``): with ``--tp-size > 1`` its
ranks agree on every replay (:class:`~sglang_ext.graph_tp_agreement.GraphTpAgreement`)."""
