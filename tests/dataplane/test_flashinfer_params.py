"""FlashInfer plan parameters and index-buffer sizing (CPU: the arithmetic; the GPU tests run them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_ext.dataplane.flashinfer_attention import AttentionParams, grown


def test_params_of_a_plain_layer():
    p = AttentionParams.of_layer(SimpleNamespace(scaling=0.125, logit_cap=0.0, sliding_window_size=-1), 8)
    assert p == AttentionParams(num_qo_heads=8, sm_scale=0.125)


def test_params_carry_soft_cap_and_window():
    """Gemma-2 style: a soft-capped, sliding-window layer plans differently from a global one."""
    local = AttentionParams.of_layer(SimpleNamespace(scaling=0.1, logit_cap=50.0, sliding_window_size=4095), 8)
    assert (local.logits_soft_cap, local.window_left) == (50.0, 4095)
    glob = AttentionParams.of_layer(SimpleNamespace(scaling=0.1, logit_cap=50.0, sliding_window_size=-1), 8)
    assert glob != local and len({glob, local}) == 2  # negative control: distinct plan keys
    bare = AttentionParams.of_layer(SimpleNamespace(), 4)  # attributes missing: defaults, off
    assert (bare.sm_scale, bare.logits_soft_cap, bare.window_left) == (None, 0.0, -1)


@pytest.mark.parametrize(("capacity", "needed", "want"),
                         [(64, 10, 64), (64, 64, 64), (64, 65, 128), (1, 1000, 1024), (8, 1025, 2048)])
def test_index_buffers_grow_to_the_next_power_of_two(capacity, needed, want):
    assert grown(capacity, needed) == want
