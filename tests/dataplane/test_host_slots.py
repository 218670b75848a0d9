"""HostSlots: a decode step's boundary takes the slots its allocation hook read, and reads the
device only for a step nothing was published for (on a GPU under SGLang's overlap loop, a second
read inside the forward would wait for the previous step to finish)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.host_slots import HostSlots
from sglang_ext.testing.op_audit import hooked_host_reads
from tests.dataplane.core_driver import CoreDriver, make_core


def test_the_published_list_is_taken_once_by_its_own_step_only() -> None:
    """The key is the step (requests and lengths), not the tensor: SGLang hands the forward a
    copy of the allocation's slots (a capture-stable buffer), which must still match."""
    slots = HostSlots()
    rids, lens = ["a", "b", "c"], [7, 12, 5]
    listed = [4, 9, 13]
    slots.publish(rids, lens, listed)
    forward_copy = torch.tensor(listed)  # not the tensor the hook read
    reads: list[str] = []
    with hooked_host_reads(reads.append):
        assert slots.read(rids, np.asarray(lens), forward_copy) is listed
    assert reads == [] and (slots.handoffs, slots.readbacks) == (1, 0)
    # taken once: the same step's boundary again reads its tensor
    with hooked_host_reads(reads.append):
        assert slots.read(rids, lens, forward_copy) == listed
    assert reads == ["tolist"] and (slots.handoffs, slots.readbacks) == (1, 1)
    # negative controls: any other step reads its own tensor, never the published list
    others = [(["a", "b"], [7, 12], torch.tensor([4, 9])),  # another batch
              (rids, [8, 12, 5], torch.tensor([5, 9, 13])),  # the next step of a
              (["a", "c", "b"], [7, 5, 12], torch.tensor([4, 13, 9])),  # the same requests reordered
              (rids, lens, torch.tensor([4, 9]))]  # a tensor of another size
    for other_rids, other_lens, tensor in others:
        slots.publish(rids, lens, listed)
        got = slots.read(other_rids, other_lens, tensor)
        assert got == tensor.tolist() and got is not listed
    assert (slots.handoffs, slots.readbacks) == (1, 1 + len(others))


def test_a_publication_of_mismatched_lengths_is_refused() -> None:
    with pytest.raises(ValueError, match="2 slots published for 3 requests and 3 lengths"):
        HostSlots().publish(["a", "b", "c"], [1, 2, 3], [1, 2])


@pytest.mark.parametrize("budget", [None, 60], ids=["identity", "paged"])
def test_steady_decode_boundaries_read_no_slots_back_when_published(budget: int | None) -> None:
    """The core's steady decode boundary (identity layout read through page tables, and the
    paged layout with layers on the host) takes each step's published slots: no ``tolist`` of
    the step's tensor inside ``prepare_decode_step``, every boundary a handoff, and the KV still
    right (the driver's shadow checks). Negative control: unpublished, every boundary reads back."""
    for publish in (True, False):
        core = make_core(budget, pages=33, page_size=4)
        d = CoreDriver(core, seed=3, fast_decode=True, paged_reads=True)
        d.publish_slots = publish
        rids = [f"r{i}" for i in range(3)]
        for rid in rids:
            d.add(rid)
            assert d.step([(rid, 5)])
        if budget is not None:
            for rid in rids:
                d.want(rid, [True, False, True])
        reads: list[str] = []
        prepare = core.prepare_decode_step

        def audited(*args, _prepare=prepare, _reads=reads):  # noqa: ANN002, ANN202
            with hooked_host_reads(_reads.append):
                return _prepare(*args)

        core.prepare_decode_step = audited  # type: ignore[method-assign]
        for _ in range(6):  # lens 6..11: pages open at 9
            assert d.step([(rid, 1) for rid in rids])
        d.check_at_rest()
        slots = core.continuity.slots
        assert d.fast_steps == 6
        stats = core.stats()
        assert (stats.slot_handoffs_total, stats.slot_readbacks_total) == (slots.handoffs, slots.readbacks)
        if publish:
            assert (slots.handoffs, slots.readbacks) == (6, 0) and "tolist" not in reads, reads
        else:
            assert (slots.handoffs, slots.readbacks) == (0, 6) and reads.count("tolist") >= 6
