"""Which path serves an extend step under the paged layered backends, and why it is decided
before the step's tables are built (``sglang_ext/layered_paged_decode.py``: ``kernel_extend``).

A kernel extend builds no token tables; the torch-native extend reads them. When SGLang pads a
batch's lengths (``ForwardBatch._pad_inputs_to_size``: ``extend_seq_lens`` padded,
``extend_start_loc`` not) the kernel cannot serve the step, so the torch path must, and its
token tables must have been built: the decision comes first.
"""

from __future__ import annotations

import pytest
import torch

from tests.dataplane.core_driver import CoreDriver, make_core

pytest.importorskip("sglang")  # sglang_ext.layered_paged_decode imports SGLang's backend at module level
from sglang_ext.layered_paged_decode import kernel_extend  # noqa: E402


@pytest.mark.parametrize(
    ("kernel", "new", "starts", "lens", "paged"),
    [
        (True, [4, 3], 2, 2, True),  # an unpadded extend on Triton: the kernel
        (True, [4, 3, 0], 2, 3, False),  # lengths padded, starts not: the torch path
        (True, [4, 3], 3, 3, False),  # lengths for a batch of another size
        (False, [4, 3], 2, 2, False),  # no Triton here
        (True, None, 0, 0, False),  # a decode step
    ],
)
def test_kernel_extend_only_for_unpadded_extends_where_triton_runs(kernel, new, starts, lens, paged):
    assert kernel_extend(kernel, new, starts, lens) is paged


def _offloading_extend(token_tables: bool):
    """A paged-layout core (one layer of the request offloaded) prepared for a 4-token extend,
    with or without token tables."""
    core = make_core(33 + 40)
    d = CoreDriver(core)
    d.add("a")
    d.step([("a", 3)])
    d.want("a", [True, False, True])
    core.token_tables = token_tables
    new = d._grow("a", 4)
    core.prepare_step([("a", torch.tensor(d.slots["a"]))], torch.tensor(new), [4])
    assert not core.overflow and core.tables is not None
    return core


def test_the_torch_path_needs_the_token_tables_the_decision_keeps():
    """With token tables (what ``kernel_extend`` False leaves on) the torch path's per-layer token
    rows exist at every layer; negative control: a step built for the kernel (no token tables)
    cannot serve the torch path -- the crash the early decision avoids."""
    core = _offloading_extend(token_tables=True)
    for layer in range(3):
        assert core.token_rows(layer).numel() > 0
    skipped = _offloading_extend(token_tables=False)
    with pytest.raises(RuntimeError, match="token tables were not built"):
        skipped.token_rows(0)
