from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelSpec(_message.Message):
    __slots__ = ("layers", "block_size", "block_bytes")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    layers: int
    block_size: int
    block_bytes: int
    def __init__(self, layers: _Optional[int] = ..., block_size: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class Hardware(_message.Message):
    __slots__ = ("gpu_kv_budget_blocks", "h2d_gbps")
    GPU_KV_BUDGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    H2D_GBPS_FIELD_NUMBER: _ClassVar[int]
    gpu_kv_budget_blocks: int
    h2d_gbps: float
    def __init__(self, gpu_kv_budget_blocks: _Optional[int] = ..., h2d_gbps: _Optional[float] = ...) -> None: ...

class Profile(_message.Message):
    __slots__ = ("layer_compute_ms", "recompute_ms_per_token", "fetch_launch_ms")
    LAYER_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FETCH_LAUNCH_MS_FIELD_NUMBER: _ClassVar[int]
    layer_compute_ms: _containers.RepeatedScalarFieldContainer[float]
    recompute_ms_per_token: _containers.RepeatedScalarFieldContainer[float]
    fetch_launch_ms: float
    def __init__(self, layer_compute_ms: _Optional[_Iterable[float]] = ..., recompute_ms_per_token: _Optional[_Iterable[float]] = ..., fetch_launch_ms: _Optional[float] = ...) -> None: ...

class RequestSpec(_message.Message):
    __slots__ = ("id", "context_tokens", "slo_tbt_ms", "deposit_tokens", "remaining_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLO_TBT_MS_FIELD_NUMBER: _ClassVar[int]
    DEPOSIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    context_tokens: int
    slo_tbt_ms: float
    deposit_tokens: int
    remaining_tokens: int
    def __init__(self, id: _Optional[str] = ..., context_tokens: _Optional[int] = ..., slo_tbt_ms: _Optional[float] = ..., deposit_tokens: _Optional[int] = ..., remaining_tokens: _Optional[int] = ...) -> None: ...

class PlanPolicy(_message.Message):
    __slots__ = ("alpha", "window_min", "window_max", "max_recompute_ratio", "deposit_credit")
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    WINDOW_MIN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_MAX_FIELD_NUMBER: _ClassVar[int]
    MAX_RECOMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    DEPOSIT_CREDIT_FIELD_NUMBER: _ClassVar[int]
    alpha: float
    window_min: int
    window_max: int
    max_recompute_ratio: float
    deposit_credit: bool
    def __init__(self, alpha: _Optional[float] = ..., window_min: _Optional[int] = ..., window_max: _Optional[int] = ..., max_recompute_ratio: _Optional[float] = ..., deposit_credit: _Optional[bool] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("model", "hardware", "profile", "requests", "policy")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    model: ModelSpec
    hardware: Hardware
    profile: Profile
    requests: _containers.RepeatedCompositeFieldContainer[RequestSpec]
    policy: PlanPolicy
    def __init__(self, model: _Optional[_Union[ModelSpec, _Mapping]] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., profile: _Optional[_Union[Profile, _Mapping]] = ..., requests: _Optional[_Iterable[_Union[RequestSpec, _Mapping]]] = ..., policy: _Optional[_Union[PlanPolicy, _Mapping]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("on_gpu",)
    ON_GPU_FIELD_NUMBER: _ClassVar[int]
    on_gpu: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, on_gpu: _Optional[_Iterable[int]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("feasible", "paused", "placements", "predicted_step_ms", "window_steps", "resident_blocks", "staging_blocks", "solver", "solve_ms", "expiry_step", "recompute_blocks", "recompute_layers", "transient_blocks")
    class PlacementsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Placement
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...
    class RecomputeBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RecomputeLayersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FEASIBLE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STAGING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SOLVER_FIELD_NUMBER: _ClassVar[int]
    SOLVE_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_STEP_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    feasible: bool
    paused: _containers.RepeatedScalarFieldContainer[str]
    placements: _containers.MessageMap[str, Placement]
    predicted_step_ms: float
    window_steps: int
    resident_blocks: int
    staging_blocks: int
    solver: str
    solve_ms: float
    expiry_step: int
    recompute_blocks: _containers.ScalarMap[str, int]
    recompute_layers: _containers.ScalarMap[str, int]
    transient_blocks: int
    def __init__(self, feasible: _Optional[bool] = ..., paused: _Optional[_Iterable[str]] = ..., placements: _Optional[_Mapping[str, Placement]] = ..., predicted_step_ms: _Optional[float] = ..., window_steps: _Optional[int] = ..., resident_blocks: _Optional[int] = ..., staging_blocks: _Optional[int] = ..., solver: _Optional[str] = ..., solve_ms: _Optional[float] = ..., expiry_step: _Optional[int] = ..., recompute_blocks: _Optional[_Mapping[str, int]] = ..., recompute_layers: _Optional[_Mapping[str, int]] = ..., transient_blocks: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model", "hardware", "profile", "scheduler", "tp_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: ModelSpec
    hardware: Hardware
    profile: Profile
    scheduler: str
    tp_size: int
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., profile: _Optional[_Union[Profile, _Mapping]] = ..., scheduler: _Optional[str] = ..., tp_size: _Optional[int] = ...) -> None: ...

class RequestState(_message.Message):
    __slots__ = ("id", "context_tokens", "generated_tokens", "slo_tbt_ms", "paused", "gpu_layers", "max_new_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLO_TBT_MS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    context_tokens: int
    generated_tokens: int
    slo_tbt_ms: float
    paused: bool
    gpu_layers: int
    max_new_tokens: int
    def __init__(self, id: _Optional[str] = ..., context_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., slo_tbt_ms: _Optional[float] = ..., paused: _Optional[bool] = ..., gpu_layers: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class QueuedRequest(_message.Message):
    __slots__ = ("id", "prompt_tokens", "arrival_ms", "slo_ttft_ms")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt_tokens: int
    arrival_ms: float
    slo_ttft_ms: float
    def __init__(self, id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., arrival_ms: _Optional[float] = ..., slo_ttft_ms: _Optional[float] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step", "now_ms", "running", "queued", "observed_step_ms", "layer_compute_ms", "h2d_gbps", "finished", "free_gpu_blocks", "pauses_dropped")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    LAYER_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    H2D_GBPS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FREE_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAUSES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    step: int
    now_ms: float
    running: _containers.RepeatedCompositeFieldContainer[RequestState]
    queued: _containers.RepeatedCompositeFieldContainer[QueuedRequest]
    observed_step_ms: float
    layer_compute_ms: _containers.RepeatedScalarFieldContainer[float]
    h2d_gbps: float
    finished: _containers.RepeatedScalarFieldContainer[str]
    free_gpu_blocks: int
    pauses_dropped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., now_ms: _Optional[float] = ..., running: _Optional[_Iterable[_Union[RequestState, _Mapping]]] = ..., queued: _Optional[_Iterable[_Union[QueuedRequest, _Mapping]]] = ..., observed_step_ms: _Optional[float] = ..., layer_compute_ms: _Optional[_Iterable[float]] = ..., h2d_gbps: _Optional[float] = ..., finished: _Optional[_Iterable[str]] = ..., free_gpu_blocks: _Optional[int] = ..., pauses_dropped: _Optional[_Iterable[str]] = ...) -> None: ...

class ReportBatch(_message.Message):
    __slots__ = ("reports",)
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    reports: _containers.RepeatedCompositeFieldContainer[StepReport]
    def __init__(self, reports: _Optional[_Iterable[_Union[StepReport, _Mapping]]] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "report", "reports")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    hello: WorkerInfo
    report: StepReport
    reports: ReportBatch
    def __init__(self, hello: _Optional[_Union[WorkerInfo, _Mapping]] = ..., report: _Optional[_Union[StepReport, _Mapping]] = ..., reports: _Optional[_Union[ReportBatch, _Mapping]] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("plan", "apply_at_step", "expiry_step", "pause", "resume", "admit", "min_gpu_layers", "reason", "policy_version")
    class MinGpuLayersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PLAN_FIELD_NUMBER: _ClassVar[int]
    APPLY_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_STEP_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    MIN_GPU_LAYERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    plan: Plan
    apply_at_step: int
    expiry_step: int
    pause: _containers.RepeatedScalarFieldContainer[str]
    resume: _containers.RepeatedScalarFieldContainer[str]
    admit: _containers.RepeatedScalarFieldContainer[str]
    min_gpu_layers: _containers.ScalarMap[str, int]
    reason: str
    policy_version: int
    def __init__(self, plan: _Optional[_Union[Plan, _Mapping]] = ..., apply_at_step: _Optional[int] = ..., expiry_step: _Optional[int] = ..., pause: _Optional[_Iterable[str]] = ..., resume: _Optional[_Iterable[str]] = ..., admit: _Optional[_Iterable[str]] = ..., min_gpu_layers: _Optional[_Mapping[str, int]] = ..., reason: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("session_id", "report_step", "decisions", "decisions_sent")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REPORT_STEP_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_SENT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    report_step: int
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    decisions_sent: int
    def __init__(self, session_id: _Optional[str] = ..., report_step: _Optional[int] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., decisions_sent: _Optional[int] = ...) -> None: ...

class LayerKVParams(_message.Message):
    __slots__ = ("ttft_slo_ms", "tpot_margin", "max_prefill_tokens", "output_len_lower_bound", "prefill_correction", "offload_correction", "model_params", "hidden_size", "device_tflops")
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MARGIN_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LEN_LOWER_BOUND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CORRECTION_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_CORRECTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_PARAMS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TFLOPS_FIELD_NUMBER: _ClassVar[int]
    ttft_slo_ms: float
    tpot_margin: float
    max_prefill_tokens: int
    output_len_lower_bound: int
    prefill_correction: float
    offload_correction: float
    model_params: float
    hidden_size: int
    device_tflops: float
    def __init__(self, ttft_slo_ms: _Optional[float] = ..., tpot_margin: _Optional[float] = ..., max_prefill_tokens: _Optional[int] = ..., output_len_lower_bound: _Optional[int] = ..., prefill_correction: _Optional[float] = ..., offload_correction: _Optional[float] = ..., model_params: _Optional[float] = ..., hidden_size: _Optional[int] = ..., device_tflops: _Optional[float] = ...) -> None: ...

class LVFParams(_message.Message):
    __slots__ = ("alpha", "beta_b", "beta_f", "transfer_budget_blocks")
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_B_FIELD_NUMBER: _ClassVar[int]
    BETA_F_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BUDGET_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    alpha: float
    beta_b: float
    beta_f: float
    transfer_budget_blocks: int
    def __init__(self, alpha: _Optional[float] = ..., beta_b: _Optional[float] = ..., beta_f: _Optional[float] = ..., transfer_budget_blocks: _Optional[int] = ...) -> None: ...

class Policy(_message.Message):
    __slots__ = ("version", "slo_tbt_ms", "slo_ttft_ms", "alpha", "window_min", "window_max", "mismatch_threshold", "ewma_factor", "victim_rule", "max_paused_steps", "solve_budget_fraction", "scheduler", "layerkv", "lvf", "max_recompute_ratio", "deposit_credit")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLO_TBT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    WINDOW_MIN_FIELD_NUMBER: _ClassVar[int]
    WINDOW_MAX_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    EWMA_FACTOR_FIELD_NUMBER: _ClassVar[int]
    VICTIM_RULE_FIELD_NUMBER: _ClassVar[int]
    MAX_PAUSED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SOLVE_BUDGET_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    LAYERKV_FIELD_NUMBER: _ClassVar[int]
    LVF_FIELD_NUMBER: _ClassVar[int]
    MAX_RECOMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    DEPOSIT_CREDIT_FIELD_NUMBER: _ClassVar[int]
    version: int
    slo_tbt_ms: float
    slo_ttft_ms: float
    alpha: float
    window_min: int
    window_max: int
    mismatch_threshold: float
    ewma_factor: float
    victim_rule: str
    max_paused_steps: int
    solve_budget_fraction: float
    scheduler: str
    layerkv: LayerKVParams
    lvf: LVFParams
    max_recompute_ratio: float
    deposit_credit: bool
    def __init__(self, version: _Optional[int] = ..., slo_tbt_ms: _Optional[float] = ..., slo_ttft_ms: _Optional[float] = ..., alpha: _Optional[float] = ..., window_min: _Optional[int] = ..., window_max: _Optional[int] = ..., mismatch_threshold: _Optional[float] = ..., ewma_factor: _Optional[float] = ..., victim_rule: _Optional[str] = ..., max_paused_steps: _Optional[int] = ..., solve_budget_fraction: _Optional[float] = ..., scheduler: _Optional[str] = ..., layerkv: _Optional[_Union[LayerKVParams, _Mapping]] = ..., lvf: _Optional[_Union[LVFParams, _Mapping]] = ..., max_recompute_ratio: _Optional[float] = ..., deposit_credit: _Optional[bool] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdatePolicyRequest(_message.Message):
    __slots__ = ("changes",)
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    changes: Policy
    def __init__(self, changes: _Optional[_Union[Policy, _Mapping]] = ...) -> None: ...

class UpdatePolicyResponse(_message.Message):
    __slots__ = ("policy", "old_version")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    OLD_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy: Policy
    old_version: int
    def __init__(self, policy: _Optional[_Union[Policy, _Mapping]] = ..., old_version: _Optional[int] = ...) -> None: ...

class WatchPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyEvent(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: Policy
    def __init__(self, policy: _Optional[_Union[Policy, _Mapping]] = ...) -> None: ...
