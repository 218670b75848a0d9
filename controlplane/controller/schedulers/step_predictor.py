"""Predicted decode step of a batch under memory pressure, from the placement model.

LayerKV's Eq. 1-2 (§3.1) bound an admission by the decoding requests' TPOT slack with the
*current* TPOT; they do not see that the admitted request's KV may not fit, so that every later
step streams offloaded layers over PCIe (issue 15, finding 6). This predictor gives the step the
batch would run once the new request joins: every request on the same distance-driven row with
the most GPU layers that fit the budget (offloaded layers spread evenly, OrbitFlow §3.3.2), timed
by the exact timeline :func:`controlplane.model.step_time_ms`. The planner's request-wise
placement is at least as fast, so the prediction is an upper bound: admission on it is
conservative.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.model import step_time_ms


def spread_row(layers: int, gpu_layers: int) -> tuple[int, ...]:
    """A row keeping ``gpu_layers`` layers on the GPU, the offloaded ones spread evenly."""
    gpu_layers = max(0, min(layers, gpu_layers))
    off = layers - gpu_layers
    row = [1] * layers
    for i in range(off):
        row[(i * layers) // off] = 0
    return tuple(row)


def predicted_step_ms(
    blocks: Sequence[int],
    budget_blocks: int,
    layer_compute_ms: Sequence[float],
    h2d_blocks_per_ms: float,
    launch_ms: float = 0.0,
) -> float:
    """Step time of a batch whose requests hold ``blocks`` blocks per layer, on ``budget_blocks``
    GPU blocks, every request keeping the most GPU layers that fit (one staging layer each when
    anything is offloaded); ``launch_ms`` per fetch launch."""
    layers = len(layer_compute_ms)
    if not blocks:
        return float(sum(layer_compute_ms))
    total = sum(blocks)
    if total * layers <= budget_blocks:
        return float(sum(layer_compute_ms))
    gpu = max(0, min(layers - 1, budget_blocks // max(1, total) - 1))
    row = spread_row(layers, gpu)
    return step_time_ms([row] * len(blocks), list(blocks), list(layer_compute_ms),
                        h2d_blocks_per_ms, launch_ms=launch_ms)
