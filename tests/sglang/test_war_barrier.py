"""SGLang's WAR barrier stays whole-forward for the layered backends (docs/overlap-schedule.md).

Under the overlap loop, the boundary's residency copies run on SGLang's schedule stream while the
previous forward may still run; ``Scheduler._apply_war_barrier`` orders them behind it. It waits
on the whole forward unless the backend declares that its shared reads end early (then only on
an event recorded after the metadata). kvplane's layers read and write the pools until the last
layer, so the layered backends must keep the base class's conservative declaration.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang

_DECLARATIONS = ("shared_read_ends", "resolve_prefill_shared_read_ends", "_snapshot_prefill_shared_reads")


def _layered_backends() -> list[type]:
    from sglang_ext.layered_attention import LayeredTorchNativeAttnBackend
    from sglang_ext.layered_flashinfer_decode import LayeredFlashInferDecode
    from sglang_ext.layered_triton_decode import LayeredTritonDecode

    return [LayeredTorchNativeAttnBackend, LayeredFlashInferDecode, LayeredTritonDecode]


def _early(cls: type) -> list[str]:
    """The shared-read declarations ``cls`` does not take from SGLang's base backend."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    return [name for name in _DECLARATIONS if getattr(cls, name) is not getattr(AttentionBackend, name)]


def test_layered_backends_keep_the_whole_forward_war_barrier():
    """Every layered backend (and what it subclasses) declares its shared reads as the base does:
    an eager prefill's read end is UNKNOWN, so the barrier waits on the whole forward."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend, SharedReadEnds
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    for cls in _layered_backends():
        assert _early(cls) == [], cls
    assert AttentionBackend.shared_read_ends(None, ForwardMode.EXTEND) is SharedReadEnds.UNKNOWN


def test_a_backend_declaring_an_early_read_end_is_caught():
    """Negative control: a layered backend that declared its prefill reads done before replay
    would be reported."""
    from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds

    base = _layered_backends()[0]
    early = type("Early", (base,), {"shared_read_ends": lambda self, fm: SharedReadEnds.PRE_REPLAY})
    assert _early(early) == ["shared_read_ends"]
