"""What a scheduler tells the control plane when it opens its session (``WorkerInfo``).

The initial profile is the controller's starting point (OrbitFlow §3.4: refined online by EWMA
from the observed step times and the sampled per-layer times):

* with ``--kv-profile FILE`` (a ``kvplane profile`` file,
  :class:`~sglang_ext.dataplane.profile_schema.DeviceProfile`): each layer's compute is the
  file's one-layer decode time for a step of :data:`PROFILE_BATCH_TOKENS` sequence(s), and the
  host-to-device bandwidth is its ``h2d_gbps``. Its ``d2h_gbps`` is validated but not sent: the
  controller's step-time model has one link, the H2D loads a step waits for.
* without: :data:`DEFAULT_LAYER_COMPUTE_MS` per layer and :data:`DEFAULT_H2D_GBPS`, and the
  controller learns the real figures from the first steps.

Recompute (issue 16, ``docs/recompute.md``): the profile's ``recompute_ms_per_token`` is the
file's figure (``kvplane profile`` times one layer's prefill of a prefix), sent for every layer
only when the worker can serve recompute (the layered pool with a decode backend that runs
recompute rows). Without the figure, or without the ability, it is absent and the control plane
never plans recompute for this worker (the controller scales it with the compute it learns).

The file's ``fetch_launch_ms`` (what a hidden fetch still costs per launch, fitted by
``kvplane gpu-check``) is sent as the profile's; without a file it is 0. The controller refits it
from the worker's samples (``ProfileTracker``'s docstring).

The same ``WorkerInfo`` reaches the embedded controller (``open_session``) and a remote one
(the gRPC hello), so both start from the file. Pure Python (no torch, no SGLang).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from controlplane.api import WorkerInfo
from controlplane.model import Hardware, ModelSpec, Profile
from sglang_ext.args import LayeredKVArgs

DEFAULT_H2D_GBPS = 16.0
"""Host-to-device bandwidth assumed without ``--kv-profile`` until the controller learns it."""
DEFAULT_LAYER_COMPUTE_MS = 1.0
"""Initial per-layer decode compute without ``--kv-profile`` (refined by the controller's EWMA)."""
PROFILE_BATCH_TOKENS = 1
"""Batch size (sequences decoded in the step) at which the profile file's layer time is read."""


@dataclass(frozen=True)
class InitialProfile:
    """The controller's starting profile for one worker."""

    layer_compute_ms: tuple[float, ...]
    """Per-layer decode compute, ms."""
    h2d_gbps: float
    """Host-to-device bandwidth, GB/s (1e9 bytes per second)."""
    d2h_gbps: float | None
    """Device-to-host bandwidth from the file (not sent: see the module docstring); None without one."""
    source: str
    """``default`` or the profile file's path."""
    recompute_ms_per_token: float | None = None
    """ms one recomputed prefix token adds to a layer, from the file; None when it has none."""
    fetch_launch_ms: float = 0.0
    """Host cost of one fetch launch, from the file; 0 without one."""


def initial_profile(layers: int, profile_file: str | Path | None) -> InitialProfile:
    """The starting profile for a model of ``layers`` layers; ValueError when the file's layer
    count is not the model's."""
    if profile_file is None:
        return InitialProfile((DEFAULT_LAYER_COMPUTE_MS,) * layers, DEFAULT_H2D_GBPS, None, "default")
    from sglang_ext.dataplane.profile_schema import DeviceProfile

    measured = DeviceProfile.load(profile_file)
    if measured.layers != layers:
        raise ValueError(
            f"--kv-profile={str(profile_file)!r}: the profile has {measured.layers} layers, the served "
            f"model {layers} (measure it with `kvplane profile --layers {layers}`)"
        )
    per_layer = measured.layer_compute_ms(PROFILE_BATCH_TOKENS)
    return InitialProfile((per_layer,) * layers, measured.h2d_gbps, measured.d2h_gbps, str(profile_file),
                          measured.recompute_ms_per_token, measured.fetch_launch_ms)


def build_worker_info(
    *,
    worker_id: str,
    layers: int,
    block_size: int,
    block_bytes: int,
    gpu_kv_budget_blocks: int,
    args: LayeredKVArgs,
    tp_size: int = 1,
    can_recompute: bool = False,
) -> WorkerInfo:
    """The session's ``WorkerInfo``: the model's KV shape, the GPU budget, the initial profile
    (``args.kv_profile`` or the defaults; its recompute cost when ``can_recompute``) and the
    scheduler choice."""
    profile = initial_profile(layers, args.kv_profile)
    rms = profile.recompute_ms_per_token if can_recompute else None
    return WorkerInfo(
        worker_id=worker_id,
        model=ModelSpec(layers=layers, block_size=block_size, block_bytes=block_bytes),
        hardware=Hardware(gpu_kv_budget_blocks=gpu_kv_budget_blocks, h2d_gbps=profile.h2d_gbps),
        profile=Profile(profile.layer_compute_ms, None if rms is None else (rms,) * layers, profile.fetch_launch_ms),
        scheduler=args.kv_scheduler,
        tp_size=tp_size,
    )
