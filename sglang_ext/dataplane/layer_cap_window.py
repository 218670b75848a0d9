"""``layer_cap_window``: an attention layer's soft cap and sliding window as the paged kernels take
them (FlashInfer's ``logits_soft_cap`` / ``window_left``, kvplane's Triton decode and extend)."""

from __future__ import annotations


def layer_cap_window(layer: object) -> tuple[float, int]:
    """``(logits_soft_cap, window_left)`` of SGLang's ``RadixAttention`` (``logit_cap``,
    ``sliding_window_size``): 0.0 for no cap, -1 for no window."""
    cap = float(getattr(layer, "logit_cap", 0.0) or 0.0)
    window = getattr(layer, "sliding_window_size", -1)
    return max(cap, 0.0), int(window) if window is not None and int(window) >= 0 else -1
