"""The paged serving backends (FlashInfer, Triton) build token tables on the steps whose layers
read them: torch-native extends, and the decode steps of a model with layers the paged kernels
do not compute (cross-attention: Mllama, Whisper), which fall back to the torch-native read.
Before, every decode step turned them off, and such a layer's decode raised ("token tables were
not built for this step") once a layer-page was offloaded."""

from __future__ import annotations

import pytest
import torch

from tests.dataplane.core_driver import make_core

pytest.importorskip("sglang")  # sglang_ext.layered_paged_decode subclasses SGLang's backend
from sglang_ext.layered_paged_decode import token_tables_needed  # noqa: E402

pytestmark = pytest.mark.sglang


def test_token_tables_are_built_where_a_layer_reads_them():
    assert token_tables_needed(decode=True, kernel_extend=False, blocker="cross-attention layers")
    assert token_tables_needed(decode=False, kernel_extend=False, blocker=None)  # torch-native extend
    assert not token_tables_needed(decode=True, kernel_extend=False, blocker=None)  # control: page tables only
    assert not token_tables_needed(decode=False, kernel_extend=True, blocker=None)


def test_a_fallback_layers_decode_reads_its_token_rows_on_the_core():
    """The core, paged layout, a decode step after an extend: with the flag the backend now sets,
    the torch-native read (``token_rows``) of the decode step works; negative control: with the
    flag off (the old decision) it raises, as the cross-attention layer's decode did."""
    for flag in (True, False):
        core = make_core(device_pages=40)
        core.paged_reads = True
        prompt = torch.arange(2, 8, dtype=torch.int64)
        core.token_tables = token_tables_needed(decode=False, kernel_extend=False, blocker="cross-attention layers")
        core.prepare_step([("A", prompt)], prompt.clone(), [6])
        core.token_tables = flag and token_tables_needed(decode=True, kernel_extend=False,
                                                         blocker="cross-attention layers")
        grown = torch.arange(2, 9, dtype=torch.int64)
        core.prepare_step([("A", grown)], grown[-1:].clone(), [1])
        if flag:
            assert tuple(core.token_rows(1).shape)[0] == 1
        else:
            with pytest.raises(RuntimeError, match="token tables were not built"):
                core.token_rows(1)
