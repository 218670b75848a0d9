"""capped_attention: SGLang's torch-native extend / decode walk with a logit soft cap.

With a cap far above every score, tanh(s / cap) * cap == s to fp32 precision: the loops must then
equal SGLang's own ``_run_sdpa_forward_extend`` / ``_decode`` on the same arguments (prefixes,
grouped heads, sliding windows, several requests). With a low cap they must equal a direct
per-position computation, and differ from SGLang's uncapped result (the control that the cap
acts). The served path is ``test_soft_cap_server.py``'s.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from sglang_ext.capped_attention import capped_decode, capped_extend  # noqa: E402
from sglang_ext.compat import TorchNativeAttnBackend  # noqa: E402
from sglang_ext.layered_attention import refuse_attention_kwargs  # noqa: E402

H, HK, D = 4, 2, 8
SEQ = [9, 14, 5]
PREFIX = [0, 6, 2]


def _case(seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    slots = 64
    k_cache = torch.randn(slots, HK, D, generator=g) * scale
    v_cache = torch.randn(slots, HK, D, generator=g)
    req_to_token = torch.randperm(slots, generator=g)[: len(SEQ) * 20].view(len(SEQ), 20)
    pool_idx = torch.tensor([2, 0, 1])
    seq = torch.tensor(SEQ)
    prefix = torch.tensor(PREFIX)
    ext = seq - prefix
    q = torch.randn(int(ext.sum()), H, D, generator=g) * scale
    qd = torch.randn(len(SEQ), H, D, generator=g) * scale
    return k_cache, v_cache, req_to_token, pool_idx, seq, prefix, ext, q, qd


def _sglang():
    return object.__new__(TorchNativeAttnBackend)  # the loops read no instance state but the mask helper


@pytest.mark.parametrize("window", [None, 3])
def test_a_cap_above_every_score_equals_sglangs_loops(window) -> None:
    k_cache, v_cache, rtt, idx, seq, prefix, ext, q, qd = _case()
    kw = {"scaling": 0.3, "enable_gqa": True, "sliding_window_size": window}
    want = _sglang()._run_sdpa_forward_extend(q, torch.empty_like(q), k_cache, v_cache, rtt, idx, seq, prefix, ext,
                                              causal=True, **kw)
    got = capped_extend(q, torch.empty_like(q), k_cache, v_cache, rtt, idx, seq, prefix, ext, cap=1e7,
                        causal=True, **kw)
    assert torch.allclose(got, want, atol=1e-5)
    want_d = _sglang()._run_sdpa_forward_decode(qd, torch.empty_like(qd), k_cache, v_cache, rtt, idx, seq, **kw)
    got_d = capped_decode(qd, torch.empty_like(qd), k_cache, v_cache, rtt, idx, seq, cap=1e7, **kw)
    assert torch.allclose(got_d, want_d, atol=1e-5)


def _direct(q_row, pos, keys, values, cap, scale, window):
    """One query row at position ``pos`` of one head, the obvious way."""
    logits = []
    for j in range(pos + 1):
        if window is not None and j < pos - window:
            logits.append(-math.inf)
            continue
        s = float(q_row @ keys[j]) * scale
        logits.append(math.tanh(s / cap) * cap)
    w = torch.softmax(torch.tensor(logits), 0)
    return (w[:, None] * values[: pos + 1]).sum(0)


@pytest.mark.parametrize("window", [None, 3])
def test_a_low_cap_equals_the_direct_computation_and_not_sglangs(window) -> None:
    k_cache, v_cache, rtt, idx, seq, prefix, ext, q, qd = _case(1, scale=3.0)
    cap, scale = 0.5, 0.3
    got = capped_extend(q, torch.empty_like(q), k_cache, v_cache, rtt, idx, seq, prefix, ext, cap=cap, scaling=scale,
                        causal=True, sliding_window_size=window)
    got_d = capped_decode(qd, torch.empty_like(qd), k_cache, v_cache, rtt, idx, seq, cap=cap, scaling=scale,
                          sliding_window_size=window)
    start = 0
    for r in range(len(SEQ)):
        tokens = rtt[idx[r], : SEQ[r]]
        keys, values = k_cache[tokens], v_cache[tokens]
        for h in range(H):
            kh = h // (H // HK)
            for i in range(SEQ[r] - PREFIX[r]):
                want = _direct(q[start + i, h], PREFIX[r] + i, keys[:, kh], values[:, kh], cap, scale, window)
                assert torch.allclose(got[start + i, h], want, atol=1e-5)
            want = _direct(qd[r, h], SEQ[r] - 1, keys[:, kh], values[:, kh], cap, scale, window)
            assert torch.allclose(got_d[r, h], want, atol=1e-5)
        start += SEQ[r] - PREFIX[r]
    uncapped = _sglang()._run_sdpa_forward_extend(q, torch.empty_like(q), k_cache, v_cache, rtt, idx, seq, prefix, ext,
                                                  scaling=scale, enable_gqa=True, causal=True,
                                                  sliding_window_size=window)
    assert (uncapped - got).abs().max() > 0.1  # control: the cap changes the result


def test_encoder_kv_and_a_zero_cap_are_refused() -> None:
    k_cache, v_cache, rtt, idx, seq, prefix, ext, q, qd = _case()
    with pytest.raises(ValueError, match="cross attention"):
        capped_decode(qd, torch.empty_like(qd), k_cache, v_cache, rtt, idx, seq, torch.tensor([1, 1, 1]), cap=1.0)
    with pytest.raises(ValueError, match="cap=0"):
        capped_decode(qd, torch.empty_like(qd), k_cache, v_cache, rtt, idx, seq, cap=0)


def test_attention_arguments_the_backends_would_drop_are_refused() -> None:
    """``sinks=`` (or any argument with a value) raises naming it; None / False pass (control)."""
    layer = type("L", (), {"layer_id": 3})()
    refuse_attention_kwargs({"sinks": None, "return_lse": False}, layer)
    with pytest.raises(ValueError, match="layer 3 passed sinks to attention"):
        refuse_attention_kwargs({"sinks": torch.zeros(4)}, layer)


def test_long_queries_are_tiled_with_the_same_result(monkeypatch) -> None:
    """A long prefill is attended in query tiles (``TILE_SCORES``): the same result as in one piece."""
    from sglang_ext import capped_attention

    k_cache, v_cache, rtt, idx, seq, prefix, ext, q, qd = _case(2, scale=3.0)
    kw = {"cap": 0.5, "scaling": 0.3, "causal": True, "sliding_window_size": 3}
    whole = capped_extend(q, torch.empty_like(q), k_cache, v_cache, rtt, idx, seq, prefix, ext, **kw)
    monkeypatch.setattr(capped_attention, "TILE_SCORES", H * 14 * 2)  # 2 query rows a tile at 14 keys
    tiled = capped_extend(q, torch.empty_like(q), k_cache, v_cache, rtt, idx, seq, prefix, ext, **kw)
    assert torch.allclose(tiled, whole, atol=1e-6)


def test_model_attention_features_are_read_and_unsupported_ones_refused() -> None:
    """``attention_features``: a plain model has none (eLLM recompute stays on), a soft cap or a
    window is found (recompute off: its rows attend with plain causal SDPA), Grok-2's position
    temperature and a non-tanh cap are refused naming the feature."""
    from sglang.srt.layers.radix_attention import RadixAttention

    from sglang_ext.layered_attention import attention_features

    def model(**kw):  # noqa: ANN003, ANN202
        return torch.nn.ModuleList([RadixAttention(4, 16, 0.25, 2, layer_id=0),
                                    RadixAttention(4, 16, 0.25, 2, layer_id=1, **kw)])

    assert attention_features(model()) is False
    assert attention_features(model(logit_cap=30.0)) is True
    assert attention_features(model(sliding_window_size=64)) is True
    grok = model()
    grok[1].xai_temperature_len = 1024
    with pytest.raises(ValueError, match="xai_temperature_len"):
        attention_features(grok)
    other = model(logit_cap=30.0)
    other[1].logit_capping_method = "idx"
    with pytest.raises(ValueError, match="soft-caps attention with 'idx'"):
        attention_features(other)
