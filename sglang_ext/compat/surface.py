"""Every piece of SGLang 0.5.23 that kvplane touches, as data (no SGLang import here).

One :class:`Target` per SGLang module, class, function or method: its dotted path, the leading
parameter names kvplane's hooks bind positionally (``params``), the ones it passes or reads by
keyword (``keyword``), the attributes it reads or overrides on it (``attrs``) and the keys it
replaces in it (``keys``, for registries that are dicts). ``used_by`` names the kvplane modules
that depend on it. :func:`sglang_ext.compat.checker.check_surface` resolves each one in the
installed SGLang with ``inspect`` (``tests/sglang/test_compat.py``), so an upgrade that moves or
renames any of them fails one named test instead of a scheduler at run time.

Attributes are read directly in kvplane's code (``scheduler.waiting_queue``, ``req.rid``): a
``getattr`` through a constant would cost every step. They are declared here so that the check
covers them: an attribute counts as present when the class (or its MRO) defines it, declares it
as a dataclass / msgspec field or annotation, or assigns ``self.<name> = ...`` in its source.
"""

from __future__ import annotations

from sglang_ext.compat.surface_capacity import *  # noqa: F403 -- part of the surface (TARGETS, __all__)
from sglang_ext.compat.surface_engine import *  # noqa: F403 -- part of the surface (TARGETS, __all__)
from sglang_ext.compat.surface_graphs import *  # noqa: F403 -- part of the surface (TARGETS, __all__)
from sglang_ext.compat.surface_lifecycle import *  # noqa: F403 -- part of the surface (TARGETS, __all__)
from sglang_ext.compat.surface_models import (  # noqa: F401 -- part of the surface (TARGETS, __all__)
    ATTENTION_ARCH,
    DEFAULT_DEVICE,
    MODEL_CONFIG_SUPPORT,
    RADIX_ATTENTION,
    USES_SSM_STATE,
)
from sglang_ext.compat.surface_recompute import (  # noqa: F401 -- part of the surface (TARGETS, __all__)
    EAGER_EXECUTE_DECODE,
    FORWARD_BATCH_RESIDUAL,
    LLAMA_DECODER_LAYER,
    LLAMA_MODEL,
    LOGITS_PROCESSOR,
    RESIDUAL_CONTRIBUTION,
    RESIDUAL_PLAIN_ADD,
    RESIDUAL_STREAM,
    TRANSFORMERS_BASE,
)
from sglang_ext.compat.surface_testing import *  # noqa: F403 -- part of the surface (TARGETS, __all__)
from sglang_ext.compat.target import Target

_SRT = "sglang.srt"

# ----- plugin loading and hook points (plugin.py) ------------------------------------------------

HOOK_REGISTRY = Target(f"{_SRT}.plugins.hook_registry.HookRegistry", attrs=("register", "apply_hooks", "_patched"),
                       used_by=("plugin", "hook_install"))
HOOK_REGISTRY_REGISTER = Target(f"{_SRT}.plugins.hook_registry.HookRegistry.register",
                                params=("target", "hook", "hook_type"), used_by=("plugin", "scheduler_hooks"))
HOOK_TYPE = Target(f"{_SRT}.plugins.hook_registry.HookType", attrs=("AFTER", "AROUND"),
                   used_by=("plugin", "scheduler_hooks"))
SERVER_ARGS = Target(
    f"{_SRT}.server_args.ServerArgs",
    attrs=("device", "port", "pp_size", "log_level", "radix_cache_backend", "disable_radix_cache",
           "disable_overlap_schedule", "enable_metrics", "kv_cache_dtype", "tp_size", "page_size",
           "max_total_tokens", "nnodes", "enable_lora", "lora_paths", "enable_return_routed_experts", "enable_return_indexer_topk", "ep_size"),
    used_by=("plugin", "scheduler_hooks", "worker_metrics", "host_pool_floor", "recompute_forward"),
)
SERVER_ARGS_ADD_CLI_ARGS = Target(f"{_SRT}.server_args.ServerArgs.add_cli_args", params=("parser",),
                                  used_by=("plugin",))
SERVER_ARGS_FROM_CLI_ARGS = Target(f"{_SRT}.server_args.ServerArgs.from_cli_args", params=("args",),
                                   used_by=("plugin",))
RUNTIME_CONTEXT_PUBLISH = Target(f"{_SRT}.runtime_context.publish", params=("server_args",),
                                 keyword=("role",), used_by=("plugin",))
SGLANG_ENVS = Target(f"{_SRT}.environ.envs", attrs=("SGLANG_RUST_SERVER", "SGLANG_ENABLE_METADATA_GLUE_GRAPH",
                                                    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"), used_by=("plugin",))
"""SGLang's environment flags: ``SGLANG_RUST_SERVER`` swaps the API server, tokenizer and
detokenizer for Rust threads, where kvplane's tokenizer hooks do not run (refused at launch);
``SGLANG_ENABLE_METADATA_GLUE_GRAPH`` replays a captured per-replay metadata preparation instead of
calling the backend's (refused with ``--kv-cuda-graphs on``)."""
ROTARY_EMBEDDING_BASE = Target(f"{_SRT}.layers.rotary_embedding.base", attrs=("_is_cpu",),
                               used_by=("plugin",))
TOKENIZER_STREAM_ONE_RESPONSE = Target(
    f"{_SRT}.managers.tokenizer_manager.TokenizerManager._stream_one_response",
    params=("self", "obj", "state", "request"),
    used_by=("plugin", "pacing"),
)
TOKENIZER_GENERATE_REQUEST = Target(
    f"{_SRT}.managers.tokenizer_manager.TokenizerManager.generate_request",
    params=("self", "obj", "request"),
    used_by=("plugin", "request_slo"),
)
"""Every request kind's entry in the main process (``/generate``, the OpenAI endpoints, the Engine
API): kvplane's per-request options are validated here, before SGLang normalises the request."""
GENERATE_CONTRACT_ERROR = Target(f"{_SRT}.entrypoints.api_contract.generate_contract_error", params=("body",),
                                 used_by=("plugin", "request_slo"))
"""``/generate``'s schema check of the raw JSON body, answered with HTTP 400 before a stream starts."""
TOKENIZER_ABORT_REQUEST = Target(f"{_SRT}.managers.tokenizer_manager.TokenizerManager.abort_request",
                                 params=("self", "rid"), used_by=("pacing",))
GENERATE_REQ_INPUT = Target(f"{_SRT}.managers.io_struct.GenerateReqInput",
                            attrs=("stream", "rid", "sampling_params"), used_by=("pacing", "request_slo"))

# ----- KV cache: radix tree, allocation, allocators (plugin.py, radix_cache.py) -------------------

REGISTER_RADIX_CACHE_BACKEND = Target(f"{_SRT}.mem_cache.registry.register_radix_cache_backend",
                                      params=("name", "factory"), used_by=("plugin",))
GET_RADIX_CACHE_FACTORY = Target(f"{_SRT}.mem_cache.registry.get_radix_cache_factory", params=("name",),
                                 used_by=("plugin",))
TREE_CACHE_BUILD_CONTEXT = Target(
    f"{_SRT}.mem_cache.registry.TreeCacheBuildContext",
    attrs=("params", "is_hybrid_swa", "is_hybrid_ssm", "enable_hierarchical_cache", "tp_rank", "server_args"),
    used_by=("plugin",),
)
ALLOC_FOR_EXTEND = Target(f"{_SRT}.mem_cache.allocation.alloc_for_extend", params=("batch",),
                          used_by=("plugin", "radix_cache"))
ALLOC_FOR_DECODE = Target(f"{_SRT}.mem_cache.allocation.alloc_for_decode", params=("batch", "token_per_req"),
                          used_by=("plugin", "alloc_hooks", "radix_cache"))
RADIX_CACHE = Target(
    f"{_SRT}.mem_cache.radix_cache.RadixCache",
    attrs=("token_to_kv_pool_allocator", "page_size", "root_node", "on_release", "checkpoint",
           "_insert_helper", "free_kv_row", "_delete_leaf", "reset"),
    used_by=("radix_cache", "plugin"),
)
RADIX_CACHE_INIT = Target(f"{_SRT}.mem_cache.radix_cache.RadixCache.__init__", params=("self", "params"),
                          used_by=("radix_cache",))
RADIX_CACHE_CHECKPOINT = Target(f"{_SRT}.mem_cache.radix_cache.RadixCache.checkpoint", params=("self", "req"),
                                keyword=("up_to",), used_by=("radix_cache",))
RADIX_CACHE_INSERT_HELPER = Target(
    f"{_SRT}.mem_cache.radix_cache.RadixCache._insert_helper",
    params=("self", "node", "key", "value", "priority", "inserted_len"),
    used_by=("radix_cache",),
)
RADIX_CACHE_FREE_KV_ROW = Target(f"{_SRT}.mem_cache.radix_cache.RadixCache.free_kv_row",
                                 params=("self", "kv", "ranges"), used_by=("radix_cache",))
RADIX_CACHE_DELETE_LEAF = Target(f"{_SRT}.mem_cache.radix_cache.RadixCache._delete_leaf",
                                 params=("self", "node"), used_by=("radix_cache",))
TREE_NODE = Target(f"{_SRT}.mem_cache.radix_cache.TreeNode", attrs=("value", "children"),
                   used_by=("radix_cache",))
TOKEN_ALLOCATOR = Target(
    f"{_SRT}.mem_cache.allocator.token.TokenToKVPoolAllocator",
    attrs=("free", "free_group_end", "free_group", "clear", "get_kvcache", "available_size", "size"),
    used_by=("radix_cache", "scheduler_hooks", "plugin"),
)
PAGED_ALLOCATOR = Target(f"{_SRT}.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator",
                         attrs=("_release_page_ids", "clear", "get_kvcache"), used_by=("radix_cache",))
REQ_TO_TOKEN_POOL = Target(f"{_SRT}.mem_cache.memory_pool.ReqToTokenPool", attrs=("req_to_token",),
                           used_by=("scheduler_hooks", "layered_attention"))

# ----- layered KV pool and attention (layered_pool.py, layered_attention.py, plugin.py) -----------

KV_POOL_CLASS_RESOLVER = Target(
    f"{_SRT}.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class",
    params=("self",),
    keyword=("kind", "default"),
    used_by=("capacity_hooks", "plugin"),
)
MHA_TOKEN_TO_KV_POOL = Target(
    f"{_SRT}.mem_cache.memory_pool.MHATokenToKVPool",
    attrs=("size", "page_size", "layer_num", "head_num", "head_dim", "v_head_dim", "dtype", "store_dtype",
           "device", "start_layer", "use_hnd", "kv_cache_layout", "_create_buffers", "_clear_buffers",
           "get_kv_size_bytes", "set_kv_buffer", "move_kv_cache", "get_key_buffer", "get_value_buffer",
           "get_kv_buffer", "_get_key_buffer", "_get_value_buffer", "get_cpu_copy", "load_cpu_copy",
           "get_contiguous_buf_infos", "get_device_pool_infos"),
    used_by=("layered_pool",),
)
MHA_TOKEN_TO_KV_POOL_INIT = Target(
    f"{_SRT}.mem_cache.memory_pool.MHATokenToKVPool.__init__",
    params=("self", "size", "page_size", "dtype", "head_num", "head_dim", "layer_num", "device",
            "enable_memory_saver"),
    keyword=("v_head_dim", "start_layer", "end_layer", "enable_kv_cache_copy", "kv_cache_layout",
             "quant_method", "post_capture_active"),
    used_by=("layered_pool",),
)
MHA_TOKEN_TO_KV_POOL_SET_KV_BUFFER = Target(
    f"{_SRT}.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer",
    params=("self", "layer", "loc_info", "cache_k", "cache_v"),
    used_by=("layered_pool", "layered_attention"),
)
MHA_TOKEN_TO_KV_POOL_MOVE_KV_CACHE = Target(
    f"{_SRT}.mem_cache.memory_pool.MHATokenToKVPool.move_kv_cache",
    params=("self", "tgt_loc", "src_loc"),
    used_by=("layered_pool",),
)
UNWRAP_WRITE_LOC = Target(f"{_SRT}.mem_cache.memory_pool.unwrap_write_loc", params=("loc_info",),
                          used_by=("layered_pool",))
ATTENTION_REGISTRY = Target(f"{_SRT}.layers.attention.attention_registry", attrs=("ATTENTION_BACKENDS",),
                            used_by=("plugin",))
ATTENTION_BACKEND_FACTORIES = Target(f"{_SRT}.layers.attention.attention_registry.ATTENTION_BACKENDS",
                            keys=("torch_native", "flashinfer"), used_by=("plugin",))
FLASHINFER_TENSOR_CORES = Target(f"{_SRT}.layers.attention.flashinfer_backend.should_use_tensor_core",
                                 params=("kv_cache_dtype", "num_attention_heads", "num_kv_heads"),
                                 used_by=("layered_flashinfer_decode",))
"""SGLang's FlashInfer decode kernel choice (and its ``SGLANG_FLASHINFER_USE_TENSOR_CORE`` override)."""
TORCH_NATIVE_ATTN_BACKEND = Target(
    f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend",
    attrs=("device", "token_to_kv_pool", "req_to_token_pool", "init_forward_metadata", "forward_extend",
           "forward_decode", "_run_sdpa_forward_extend", "_run_sdpa_forward_decode"),
    used_by=("layered_attention",),
)
TORCH_NATIVE_ATTN_BACKEND_INIT = Target(
    f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend.__init__",
    params=("self", "model_runner"),
    used_by=("layered_attention",),
)
TORCH_NATIVE_ATTN_BACKEND_INIT_FORWARD_METADATA = Target(
    f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend.init_forward_metadata",
    params=("self", "forward_batch"),
    used_by=("layered_attention",),
)
TORCH_NATIVE_SDPA_FORWARD_EXTEND = Target(
    f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
    params=("self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices"),
    used_by=("layered_attention",),
)
TORCH_NATIVE_SDPA_FORWARD_DECODE = Target(
    f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode",
    params=("self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices"),
    used_by=("layered_attention",),
)
SDPA_REQ_POOL_INDICES_ARG = TORCH_NATIVE_SDPA_FORWARD_DECODE.args.index("req_pool_indices")
"""Position of ``req_pool_indices`` among the ``_run_sdpa_forward_*`` arguments (after ``self``):
the layered attention passes its compact row ids there."""
TORCH_NATIVE_FORWARD_EXTEND = Target(
    f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
    params=("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
    used_by=("layered_attention",),
)
TORCH_NATIVE_FORWARD_DECODE = Target(
    f"{_SRT}.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode",
    params=("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
    used_by=("layered_attention",),
)
FORWARD_BATCH = Target(
    f"{_SRT}.model_executor.forward_batch_info.ForwardBatch",
    attrs=("forward_mode", "req_pool_indices", "seq_lens", "seq_lens_cpu", "rids", "out_cache_loc",
           "input_ids", "positions", "extend_seq_lens_cpu", "extend_seq_lens", "extend_start_loc"),
    used_by=("layered_attention", "recompute_forward", "layered_paged_decode"),
)
FORWARD_MODE = Target(f"{_SRT}.model_executor.forward_batch_info.ForwardMode", attrs=("is_decode", "is_extend"),
                      used_by=("scheduler_hooks", "layered_attention"))
MODEL_RUNNER = Target(f"{_SRT}.model_executor.model_runner.ModelRunner",
                      attrs=("attn_backend", "token_to_kv_pool", "req_to_token_pool", "forward_stream", "model_config",
                             "lora_manager", "server_args", "model", "dtype"),
                      used_by=("scheduler_hooks", "layered_attention", "layered_flashinfer_decode"))

# ----- the scheduler (scheduler_hooks.py, admission.py, pause.py, tp_sync.py) ----------------------

SCHEDULER = Target(
    f"{_SRT}.managers.scheduler.Scheduler",
    attrs=("server_args", "model_config", "page_size", "enable_overlap", "tp_size", "tp_group",
           "tp_cpu_group", "tp_worker", "tree_cache", "token_to_kv_pool_allocator", "req_to_token_pool",
           "waiting_queue", "running_batch", "last_batch", "chunked_req", "metrics_collector"),
    used_by=("scheduler_hooks", "admission", "tp_sync", "worker_metrics"),
)
SCHEDULER_INIT = Target(f"{_SRT}.managers.scheduler.Scheduler.__init__", params=("self",),
                        used_by=("scheduler_hooks",))
SCHEDULER_GET_NEXT_BATCH_TO_RUN = Target(
    f"{_SRT}.managers.scheduler.Scheduler.get_next_batch_to_run",
    params=("self", "running_batch", "last_batch"),
    used_by=("scheduler_hooks", "admission", "pause"),
)
SCHEDULER_APPLY_WAR_BARRIER = Target(
    f"{_SRT}.managers.scheduler.Scheduler._apply_war_barrier", params=("self",), used_by=("scheduler_hooks",),
)
"""Not called: under ``--kv-overlap-schedule on`` the step boundary's KV copies are ordered behind
the in-flight forward by this barrier (the schedule stream waits on the forward stream after every
launch; CUDA only in 0.5.23, so kvplane refuses the flag on ROCm). ``docs/overlap-schedule.md``."""
SCHEDULER_RUN_BATCH = Target(f"{_SRT}.managers.scheduler.Scheduler.run_batch", params=("self", "batch"),
                             used_by=("scheduler_hooks",))
SCHEDULER_PROCESS_BATCH_RESULT = Target(f"{_SRT}.managers.scheduler.Scheduler.process_batch_result",
                                        params=("self", "batch", "result"), used_by=("scheduler_hooks",))
NEXT_BATCH_PLAN = Target(f"{_SRT}.managers.schedule_batch.NextBatchPlan", attrs=("running_batch", "batch_to_run"),
                         used_by=("scheduler_hooks",))
ABORT_REQ = Target(f"{_SRT}.managers.io_struct.AbortReq", attrs=("rid", "abort_all"), used_by=("scheduler_hooks",))
SCHEDULE_BATCH = Target(
    f"{_SRT}.managers.schedule_batch.ScheduleBatch",
    attrs=("reqs", "forward_mode", "sampling_info", "batch_is_full", "has_grammar", "spec_info", "model_config",
           "extend_lens", "tree_cache", "device", "is_empty", "filter_batch", "merge_batch"),
    used_by=("scheduler_hooks", "pause", "admission", "plugin", "radix_cache"),
)
SCHEDULE_BATCH_FILTER_BATCH = Target(f"{_SRT}.managers.schedule_batch.ScheduleBatch.filter_batch",
                                     params=("self",), keyword=("keep_indices",), used_by=("pause",))
SCHEDULE_BATCH_MERGE_BATCH = Target(f"{_SRT}.managers.schedule_batch.ScheduleBatch.merge_batch",
                                    params=("self", "other"), used_by=("pause",))
REQ = Target(
    f"{_SRT}.managers.schedule_batch.Req",
    attrs=("rid", "kv", "origin_input_ids", "output_ids", "sampling_params", "to_finish", "finished",
           "time_stats"),
    used_by=("scheduler_hooks", "pause", "admission", "radix_cache", "worker_metrics"),
)
REQ_KV_INFO = Target(f"{_SRT}.managers.schedule_batch.ReqKvInfo", attrs=("req_pool_idx", "kv_allocated_len"),
                     used_by=("scheduler_hooks", "radix_cache"))
SAMPLING_PARAMS = Target(f"{_SRT}.sampling.sampling_params.SamplingParams",
                         attrs=("max_new_tokens", "custom_params"),
                         used_by=("scheduler_hooks", "admission", "worker_metrics"))
SAMPLING_BATCH_INFO = Target(f"{_SRT}.sampling.sampling_batch_info.SamplingBatchInfo",
                             attrs=("penalizer_orchestrator", "has_custom_logit_processor"), used_by=("pause",))
SAMPLING_BATCH_INFO_FROM_SCHEDULE_BATCH = Target(
    f"{_SRT}.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch",
    params=("batch", "vocab_size"),
    used_by=("pause",),
)
PENALIZER_ORCHESTRATOR = Target(f"{_SRT}.sampling.penaltylib.orchestrator.BatchedPenalizerOrchestrator",
                                attrs=("is_required", "penalizers", "batch", "filter", "merge"), used_by=("pause",))
"""``pause.split_sampling_info`` copies it for a paused row: ``batch`` (a settable property,
weak), ``penalizers`` (kind -> penalizer); ``filter`` / ``merge`` run on each side."""
BATCHED_PENALIZER = Target(f"{_SRT}.sampling.penaltylib.orchestrator._BatchedPenalizer",
                           attrs=("_orchestrator_ref", "_filter", "_merge"), used_by=("pause",))
"""A penalizer copied for a paused row is re-bound to its copy's orchestrator through the private
``_orchestrator_ref`` (a weakref); the split relies on ``_filter`` replacing the state tensors
rather than writing into them (true of all four in 0.5.23)."""
MODEL_CONFIG = Target(f"{_SRT}.configs.model_config.ModelConfig",
                      attrs=("num_hidden_layers", "vocab_size", "is_encoder_decoder", "head_dim", "dtype",
                             "get_num_kv_heads"),
                      used_by=("scheduler_hooks", "pause", "host_pool_floor"))
MODEL_CONFIG_FROM_SERVER_ARGS = Target(f"{_SRT}.configs.model_config.ModelConfig.from_server_args",
                                       params=("server_args",), used_by=("plugin", "host_pool_floor"))
"""Called once in the launcher: the model's features (``model_support``) and, with
``--kv-host-pool-gb``, its KV shape."""
MODEL_CONFIG_GET_NUM_KV_HEADS = Target(f"{_SRT}.configs.model_config.ModelConfig.get_num_kv_heads",
                                       params=("self", "tensor_parallel_size"), used_by=("host_pool_floor",))
TP_MODEL_WORKER = Target(f"{_SRT}.managers.tp_worker.TpModelWorker", attrs=("model_runner",),
                         used_by=("scheduler_hooks",))
GROUP_COORDINATOR = Target(f"{_SRT}.distributed.parallel_state.GroupCoordinator",
                           attrs=("rank", "ranks", "world_size", "cpu_group"), used_by=("tp_sync", "graph_tp_agreement"))
BROADCAST_PYOBJ = Target(f"{_SRT}.utils.common.broadcast_pyobj", params=("data", "rank"),
                         keyword=("dist_group", "src"), used_by=("tp_sync",))

ENABLE_FUSED_SET_KV_BUFFER = Target(f"{_SRT}.models.utils.enable_fused_set_kv_buffer", params=("forward_batch",),
                                    used_by=("plugin",))
"""Models such as Qwen3-MoE and gpt-oss fuse the KV write into rotary on CUDA with a bf16 pool,
through ``get_key_buffer`` (flat buffers the layered pool does not have): hooked to say no then."""
GET_ATTN_BACKEND = Target(f"{_SRT}.model_executor.forward_context.get_attn_backend", used_by=("plugin",))
"""The forward's attention backend (what ``enable_fused_set_kv_buffer`` reaches the pool through)."""

# ----- metrics (worker_metrics.py): SGLang's --enable-metrics, its labels, request timestamps ------

SCHEDULER_METRICS_COLLECTOR = Target(f"{_SRT}.observability.metrics_collector.SchedulerMetricsCollector",
                                     attrs=("labels",), used_by=("worker_metrics",))
"""``scheduler.metrics_collector`` (None without ``--enable-metrics``): its ``labels`` (``model_name``,
``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ...) label kvplane's series too."""
SCHEDULER_REQ_TIME_STATS = Target(
    f"{_SRT}.observability.req_time_stats.SchedulerReqTimeStats",
    attrs=("scheduler_recv_time", "prefill_finished_time", "completion_time"),
    used_by=("worker_metrics",),
)
"""``req.time_stats``: ``time.perf_counter()`` stamps (0.0 = not reached) for per-request TTFT/TBT."""

# ----- per-request placement info (request_placement.py, placement_response.py, openai_placement.py)

SCHEDULER_ADD_REQUEST_TO_QUEUE = Target(f"{_SRT}.managers.scheduler.Scheduler._add_request_to_queue",
                                        params=("self", "req"), used_by=("scheduler_hooks", "request_placement"))
"""Every generate request enters the waiting queue here once (retracted ones again): where a
request that asked for its placement info is noticed."""
RADIX_CACHE_ON_RELEASE = Target(f"{_SRT}.mem_cache.radix_cache.RadixCache.on_release", params=("self", "req"),
                                keyword=("checkpointed",), used_by=("scheduler_hooks", "request_placement"))
"""Called once per finished or aborted request that held KV, before its output is streamed and
before the layered pool drops it: where the placement record is taken (instance attribute wrapped)."""
REQ_CUSTOMIZED_INFO = Target(f"{_SRT}.managers.schedule_batch.Req", attrs=("customized_info", "sampling_params"),
                             used_by=("request_placement",))
"""``req.customized_info``: SGLang's generic per-request output channel (``{key: per-token values}``,
sliced by the output streamer, delivered to ``TokenizerManager.update_request_meta_info``)."""
GENERATION_STREAM_ACCUMULATOR = Target(
    f"{_SRT}.managers.scheduler_components.output_streamer._GenerationStreamAccumulator",
    attrs=("accept", "customized_info"),
    used_by=("request_placement",),
)
"""Slices each request's ``customized_info`` values per output (``values[sent:len(output)]``)."""
TOKENIZER_UPDATE_REQUEST_META_INFO = Target(
    f"{_SRT}.managers.tokenizer_manager.TokenizerManager.update_request_meta_info",
    params=("self", "meta_info", "state", "customized_info", "index", "finish_reason"),
    used_by=("plugin", "placement_response"),
)
"""Turns ``customized_info`` into ``meta_info`` (SGLang: "subclasses may use finish_reason for
terminal data"); kvplane's key becomes ``meta_info["kvplane"]``, one dict."""
TOKENIZER_REQ_STATE = Target(f"{_SRT}.managers.tokenizer_manager.ReqState", attrs=("obj",),
                             used_by=("placement_response",))
OPENAI_COMPLETION_BUILD_RESPONSE = Target(
    f"{_SRT}.entrypoints.openai.serving_completions.OpenAIServingCompletion._build_completion_response",
    params=("self", "request", "ret", "created"),
    used_by=("plugin", "openai_placement"),
)
OPENAI_COMPLETION_STREAM = Target(
    f"{_SRT}.entrypoints.openai.serving_completions.OpenAIServingCompletion._generate_completion_stream",
    params=("self", "adapted_request", "request", "raw_request"),
    used_by=("plugin", "openai_placement"),
)
OPENAI_CHAT_BUILD_RESPONSE = Target(
    f"{_SRT}.entrypoints.openai.serving_chat.OpenAIServingChat._build_chat_response",
    params=("self", "request", "ret", "created"),
    used_by=("plugin", "openai_placement"),
)
OPENAI_CHAT_STREAM = Target(
    f"{_SRT}.entrypoints.openai.serving_chat.OpenAIServingChat._generate_chat_stream",
    params=("self", "adapted_request", "request", "raw_request"),
    used_by=("plugin", "openai_placement"),
)
OPENAI_SGLEXT = Target(f"{_SRT}.entrypoints.openai.protocol.SglExt", attrs=("routed_experts", "cached_tokens_details"),
                       used_by=("openai_placement",))
"""SGLang's extension object of OpenAI responses (``"sglext"``); kvplane's subclass adds ``kvplane``."""
OPENAI_COMPLETION_RESPONSE = Target(f"{_SRT}.entrypoints.openai.protocol.CompletionResponse",
                                    attrs=("id", "model", "sglext"), used_by=("openai_placement",))
OPENAI_COMPLETION_STREAM_RESPONSE = Target(f"{_SRT}.entrypoints.openai.protocol.CompletionStreamResponse",
                                           attrs=("id", "model", "choices", "sglext"), used_by=("openai_placement",))
OPENAI_CHAT_RESPONSE = Target(f"{_SRT}.entrypoints.openai.protocol.ChatCompletionResponse",
                              attrs=("id", "model", "sglext"), used_by=("openai_placement",))
OPENAI_CHAT_STREAM_RESPONSE = Target(f"{_SRT}.entrypoints.openai.protocol.ChatCompletionStreamResponse",
                                     attrs=("id", "model", "choices", "sglext"), used_by=("openai_placement",))
OPENAI_COMPLETION_REQUEST = Target(f"{_SRT}.entrypoints.openai.protocol.CompletionRequest",
                                   attrs=("custom_params", "model", "n"), used_by=("openai_placement",))
OPENAI_CHAT_REQUEST = Target(f"{_SRT}.entrypoints.openai.protocol.ChatCompletionRequest",
                             attrs=("custom_params", "model", "n"), used_by=("openai_placement",))

OPENAI_RESPONSES_CREATE = Target(
    f"{_SRT}.entrypoints.openai.serving_responses.OpenAIServingResponses.create_responses",
    params=("self", "request", "raw_request"),
    used_by=("placement_hooks", "responses_placement"),
)
"""``/v1/responses``' handler: kvplane reads the body's ``custom_params`` (its ``ResponsesRequest`` has
no such field) and adds ``sglext.kvplane`` to what it returns."""
OPENAI_RESPONSES_GENERATE = Target(
    f"{_SRT}.entrypoints.openai.serving_responses.OpenAIServingResponses._generate_with_builtin_tools",
    params=("self", "request_id", "request_prompt", "adapted_request", "sampling_params", "context"),
    keyword=("raw_request",),
    used_by=("placement_hooks", "responses_placement"),
)
"""Every generation turn of a Responses request (the engine's ``sampling_params`` dict and the
``GenerateReqInput``): where kvplane's keys join ``sampling_params["custom_params"]``."""
OPENAI_RESPONSES_SERVING = Target(f"{_SRT}.entrypoints.openai.serving_responses.OpenAIServingResponses",
                                  attrs=("create_error_response",), used_by=("responses_placement",))
OPENAI_RESPONSES_ERROR = Target(
    f"{_SRT}.entrypoints.openai.serving_responses.OpenAIServingResponses.create_error_response",
    params=("self", "message"), keyword=("param",), used_by=("responses_placement",),
)
OPENAI_RESPONSES_RESPONSE = Target(f"{_SRT}.entrypoints.openai.protocol.ResponsesResponse",
                                   attrs=("id", "status", "output", "usage"), used_by=("responses_placement",))
"""The Responses object (also the ``response`` of a stream's lifecycle events); kvplane's subclass
adds SGLang's ``sglext`` with ``kvplane``."""
GENERATE_REQ_INPUT_SAMPLING = Target(f"{_SRT}.managers.io_struct.GenerateReqInput", attrs=("sampling_params",),
                                     used_by=("responses_placement",))

# ----- live policy endpoint (policy_endpoint_config.py, pacing_slo_publisher.py, pacing_slo_update.py)

SERVER_ARGS_DP_SIZE = Target(f"{_SRT}.server_args.ServerArgs", attrs=("dp_size",), used_by=("plugin", "scheduler_hooks"))
"""``--dp-size``: one embedded control plane per data-parallel rank, so one policy port cannot serve
them all (``--kv-policy-listen`` is refused with ``--dp-size > 1``)."""
PARALLEL_CONTEXT = Target(f"{_SRT}.runtime_context.get_parallel", params=(), used_by=("scheduler_hooks", "plugin"))
"""The process's parallel context; kvplane reads its ``dp_rank`` (the data-parallel replica, None
without SGLang's DP controller; a field of ``runtime_context.SpawnRanks``, resolved dynamically, so
``test_compat`` checks it is one of ``_parallel_fields()``): with ``--dp-size > 1`` each replica's
scheduler gets a worker id and output files of its own (:func:`sglang_ext.compat.replica_rank`)."""
SERVER_ARGS_TOKENIZER_WORKER_NUM = Target(f"{_SRT}.server_args.ServerArgs", attrs=("tokenizer_worker_num",),
                                          used_by=("pacing_slo_publisher",))
"""``--tokenizer-worker-num``: with more than one, SGLang's router forwards only per-request
outputs, so a live SLO change is not sent to the pacers."""
SCHEDULER_IPC = Target(f"{_SRT}.managers.scheduler.Scheduler", attrs=("ipc_channels",),
                       used_by=("pacing_slo_publisher",))
SCHEDULER_IPC_CHANNELS = Target(f"{_SRT}.managers.scheduler_components.ipc_channels.SchedulerIpcChannels",
                                attrs=("send_to_tokenizer",), used_by=("pacing_slo_publisher",))
"""``scheduler.ipc_channels.send_to_tokenizer``: rank 0's socket straight to the main process (SGLang
answers control requests on it); a live SLO change travels there."""
SENDER_WRAPPER_SEND_OUTPUT = Target(
    f"{_SRT}.managers.scheduler_components.output_sender.SenderWrapper.send_output",
    params=("self", "output"), used_by=("pacing_slo_publisher",),
)
WRAP_AS_PICKLE = Target(f"{_SRT}.managers.io_struct.wrap_as_pickle", params=("obj",),
                        used_by=("pacing_slo_publisher",))
"""A non-SGLang object on SGLang's IPC: itself under pickle IPC (the default), a ``PickleWrapper`` under
msgpack IPC (``SGLANG_USE_PICKLE_IPC=0``), which ``msgpack_decode`` unwraps on the other side."""
TOKENIZER_INIT_REQUEST_DISPATCHER = Target(
    f"{_SRT}.managers.tokenizer_manager.TokenizerManager.init_request_dispatcher", params=("self",),
    used_by=("plugin",),
)
"""Builds ``self._result_dispatcher`` (type -> handler for what the scheduler sends that is not a
batch output); kvplane adds :class:`~sglang_ext.pacing_slo_update.PacingSloUpdate` after it."""
TOKENIZER_MANAGER = Target(f"{_SRT}.managers.tokenizer_manager.TokenizerManager", attrs=("_result_dispatcher",),
                           used_by=("plugin",))
TYPE_BASED_DISPATCHER = Target("sglang.utils.TypeBasedDispatcher", params=("mapping",),
                               attrs=("__iadd__", "__call__"), used_by=("plugin",))
"""``dispatcher += TypeBasedDispatcher([(type, handler)])`` adds a type (existing ones are kept)."""

# ----- the KV write kernel (store_cache_writer.py) --------------------------------------------

KV_STORE_CACHE = Target("sglang.kernels.ops.kvcache.kvcache.store_cache",
                        params=("k", "v", "k_cache", "v_cache", "indices"),
                        keyword=("row_bytes", "v_row_bytes", "reserved_skip_index"), used_by=("store_cache_writer",))
"""SGLang's one-launch KV write (``MHATokenToKVPool.set_kv_buffer`` on CUDA); kvplane passes
``reserved_skip_index=-1`` (SGLang's default 0 skips row 0, real KV in the layered pool)."""
KV_CAN_USE_STORE_CACHE = Target("sglang.kernels.ops.kvcache.kvcache.can_use_store_cache",
                                params=("k_row_bytes", "v_row_bytes"), used_by=("store_cache_writer",))
"""Builds (JIT) and answers whether ``store_cache`` serves a row width."""

TARGETS: tuple[Target, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Target))
"""Every target above, in definition order."""

__all__ = [
    "SDPA_REQ_POOL_INDICES_ARG",
    "TARGETS",
    "Target",
    *(name for name, value in dict(globals()).items() if isinstance(value, Target)),
]
