"""BlockAllocator: low ids first, LIFO reuse, all-or-nothing alloc, refused frees change nothing."""

import numpy as np
import pytest

from sglang_ext.dataplane.block_allocator import BlockAllocator


def test_order_and_counts():
    a = BlockAllocator(6, "pages")
    assert a.alloc(3).tolist() == [0, 1, 2]
    a.free(np.array([2, 0]))
    assert a.alloc(2).tolist() == [0, 2]  # the most recently freed first
    assert (a.free_count, a.used_count, a.used_ids()) == (3, 3, {0, 1, 2})
    assert a.alloc(4) is None and a.free_count == 3  # all or nothing
    assert a.alloc(3).tolist() == [3, 4, 5] and a.alloc(0).size == 0
    a.free([1, 3])  # a list works too
    assert a.used_ids() == {0, 2, 4, 5}


@pytest.mark.parametrize(("ids", "message"), [
    ([1, 9], "out of range"), ([-1], "out of range"), ([1, 1], "double free of block 1"),
    ([3], "double free of block 3"), ([0, 3], "double free of block 3"),
])
def test_refused_frees_change_nothing(ids, message):
    a = BlockAllocator(6, "pages")
    a.alloc(3)
    with pytest.raises(ValueError, match=message):
        a.free(np.array(ids))
    assert a.used_ids() == {0, 1, 2} and a.free_count == 3
    a.free([0, 1, 2])  # control: a valid free of the same ids goes through
    assert a.free_count == 6


def test_retake_takes_the_prefix_still_where_free_put_it():
    """A step's staging pages, given back, are taken again by the next step: all of them when
    nothing was allocated since; the leading ones when allocations popped the last ones (those
    are in use elsewhere now); none when anything else was freed on top, or for an empty list."""
    a = BlockAllocator(10, "pages")
    staging = a.alloc(4)  # [0, 1, 2, 3]
    a.free(staging)
    assert a.retake(staging) == 4 and a.used_ids() == {0, 1, 2, 3} and a.free_count == 6
    a.free(staging)
    assert a.alloc(2).tolist() == [3, 2]  # a placement pops the last two
    assert a.retake(staging) == 2 and a.used_ids() == {0, 1, 2, 3}  # 0, 1 again; 2, 3 are the placement's
    a.free(np.array([0, 1]))
    a.free(np.array([3]))  # something else came back on top
    assert a.retake(np.array([0, 1])) == 0 and a.free_count == 9  # nothing taken
    assert a.retake(np.zeros(0, dtype=np.int64)) == 0
    a.free(np.array([2]))
    assert a.retake(np.array([5, 2])) == 0  # 2 is on top but 5 is not just below it: nothing taken
    assert a.used_ids() == set()
