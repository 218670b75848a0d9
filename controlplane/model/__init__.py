"""The placement model (issue 2 §2): batch inputs, the exact step-time timeline, plans.

This is both the planner's objective and the data plane's contract.
"""

from controlplane.model.batch import (
    SHOWN_CHARS,
    Batch,
    Hardware,
    ModelSpec,
    PlanPolicy,
    Profile,
    RequestSpec,
    SchemaError,
    link_blocks_per_ms,
    shown,
)
from controlplane.model.plan import Plan
from controlplane.model.timeline import (
    fetch_sizes,
    fetch_timeline_ms,
    gpu_blocks,
    launch_count,
    memory_blocks,
    recompute_compute_ms,
    request_staging_blocks,
    step_time_ms,
    transient_blocks,
)

__all__ = [
    "link_blocks_per_ms",
    "Batch",
    "Hardware",
    "ModelSpec",
    "Plan",
    "PlanPolicy",
    "Profile",
    "RequestSpec",
    "SchemaError",
    "SHOWN_CHARS",
    "shown",
    "fetch_sizes",
    "fetch_timeline_ms",
    "gpu_blocks",
    "launch_count",
    "memory_blocks",
    "recompute_compute_ms",
    "request_staging_blocks",
    "step_time_ms",
    "transient_blocks",
]
