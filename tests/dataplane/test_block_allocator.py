"""BlockAllocator: low ids first, LIFO reuse (under a held run while it fits), all-or-nothing alloc,
refused frees change nothing, held staging retaken whole; a renewed staging is trusted by its
free exactly as far as its construction proves."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_held_staging_is_retaken_whole_after_allocations_and_frees():
    """Staging given back with ``hold`` stays on top: a placement allocated meanwhile is served
    from under it and ids freed meanwhile go under it, so the next step retakes all of it.
    Control: the same sequence without ``hold`` retakes only the prefix the placement left."""
    for hold, expect in ((True, 4), (False, 3)):
        a = BlockAllocator(12, "pages")
        a.alloc(3)  # [0, 1, 2]
        staging = a.alloc(4)  # [3, 4, 5, 6]
        a.free(staging, hold=hold)
        a.free(np.array([1]))  # a request's page came back meanwhile
        got = a.alloc(2)  # the boundary places an opened page (without hold: 1 and staging's 6)
        assert set(got.tolist()).isdisjoint(staging.tolist()) == hold
        assert a.retake(staging) == expect
        assert a.used_ids() == ({0, 2} | set(got.tolist()) | set(staging[:expect].tolist()))
        assert a.free_count == 12 - len(a.used_ids())


def test_an_allocation_larger_than_what_lies_under_the_held_run_takes_its_last_ids():
    a = BlockAllocator(8, "pages")
    a.alloc(6)
    staging = np.array([2, 3, 4, 5])
    a.free(staging, hold=True)  # free stack: 7 6 | 2 3 4 5
    got = a.alloc(3)  # two under it are not enough: popped from the top, the held run's last ids first
    assert got.tolist() == [5, 4, 3]
    assert a.retake(staging) == 1 and a.used_ids() == set(range(6))  # its prefix, 2, again
    assert a.alloc(2).tolist() == [6, 7] and a.alloc(1) is None


def test_renew_keeps_the_retaken_prefix_and_adds_new_ids_ascending():
    """``renew``: the prefix ``retake`` finds, then the new ids (those the placement took plus
    ``extra``) ascending, as one read-only array; too few free: nothing taken, the prefix held
    again (the next renew finds it whole)."""
    a = BlockAllocator(12, "pages")
    a.alloc(2)  # [0, 1]
    staging = a.alloc(4)  # [2, 3, 4, 5]
    a.free(staging, hold=True)
    assert a.alloc(5).tolist() == [6, 7, 8, 9, 10]  # from under the held run (the free stack's order), the run kept
    a.free(np.array([7, 8]))  # back under the run, in this order: popped 8 then 7
    kept, joined = a.renew(staging, 2)
    assert kept == 4 and joined.tolist() == [2, 3, 4, 5, 7, 8] and not joined.flags.writeable
    assert a.used_ids() == set(range(11)) and a.free_count == 1
    with pytest.raises(ValueError, match="read-only"):
        joined[0] = 9
    a.free(joined, hold=True)
    kept, none = a.renew(joined, 2)  # all six retaken, but only one more id (11) is free
    assert kept == 6 and none is None and a.free_count == 7 and a.used_ids() == {0, 1, 6, 9, 10}
    kept, again = a.renew(joined, 0)  # the run was held again whole
    assert kept == 6 and again.tolist() == joined.tolist() and a.free_count == 1


def test_a_renewed_staging_freed_with_hold_skips_only_the_checks_its_construction_proves(monkeypatch):
    """The free of the last renew's array with ``hold`` does not check range or repeats (the
    array is distinct and in range by construction, and read-only) but still refuses an id no
    longer in use, changing nothing. Controls: an equal copy of it, or the array freed without
    ``hold``, gets the repeat check; the array freed twice is refused the second time."""
    from sglang_ext.dataplane.distinct_ids import DistinctIds

    calls = []
    real = DistinctIds.distinct

    def counted(self, ids):
        calls.append(int(ids.size))
        return real(self, ids)

    monkeypatch.setattr(DistinctIds, "distinct", counted)
    a = BlockAllocator(10, "pages")
    staging = a.alloc(4)
    a.free(staging, hold=True)
    _, joined = a.renew(staging, 1)
    calls.clear()
    a.free(joined, hold=True)
    assert calls == [] and a.free_count == 10  # trusted: no repeat check
    with pytest.raises(ValueError, match="double free"):
        a.free(joined, hold=True)  # the trust ends with the free: checked, refused
    _, joined = a.renew(joined, 0)
    a.free(joined.copy(), hold=True)  # control: an equal copy is checked
    assert calls == [5]
    _, joined = a.renew(joined, 0)
    a.free(joined)  # control: without hold, checked
    assert calls == [5, 5]
    _, joined = a.renew(joined, 0)
    a.free(joined[:1])  # one of them goes back by another route
    used = a.used_ids()
    with pytest.raises(ValueError, match=f"double free of block {joined[0]}"):
        a.free(joined, hold=True)  # trusted, yet the in-use check refuses it
    assert a.used_ids() == used


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "hold", "retake", "renew", "give"]), st.integers(0, 7)),
                max_size=40))
def test_random_sequences_keep_the_free_stack_exact(ops):
    """Whatever the order of allocations, frees (held or not), retakes and renews (and the
    renewed arrays given back with ``hold``, trusted): the free stack holds every free id once
    and nothing else, ``alloc`` hands out only free ids, ``retake`` a prefix of its ids that were
    free, ``renew`` that prefix then free ids (or nothing, the prefix held again); held staging
    with only room-fitting allocations and other frees since is retaken whole; a renewed array
    some of whose ids went back by another route is refused, changing nothing."""
    a = BlockAllocator(16, "pages")
    used: set[int] = set()
    lent: np.ndarray | None = None
    held: np.ndarray | None = None
    under = 0  # ids the allocations since the hold could take from under it
    whole = False
    for op, k in ops:
        if op == "alloc":
            got = a.alloc(k)
            if got is None:
                assert k > 16 - len(used)
                continue
            assert used.isdisjoint(got.tolist()) and len(set(got.tolist())) == k
            used |= set(got.tolist())
            whole = whole and k <= under
            under -= k
        elif op in ("free", "hold") and used:
            ids = np.array(sorted(used)[: max(1, k)], dtype=np.int64)
            a.free(ids, hold=op == "hold")
            used -= set(ids.tolist())
            if op == "hold":
                held, under, whole = ids, a.free_count - ids.size, True
            else:
                under += ids.size
        elif op == "retake" and held is not None:
            free_before = set(range(16)) - used
            m = a.retake(held)
            assert set(held[:m].tolist()) <= free_before
            assert m == held.size or not whole
            used |= set(held[:m].tolist())
            held, whole = None, False
        elif op == "renew" and held is not None:
            free_before = set(range(16)) - used
            m, joined = a.renew(held, k % 3)
            assert set(held[:m].tolist()) <= free_before
            assert m == held.size or not whole
            if joined is None:  # nothing taken: the prefix is the held run now
                assert held.size - m + k % 3 > len(free_before) - m
                held, under, whole = (held[:m], a.free_count - m, True) if m else (None, 0, False)
            else:
                assert joined[:m].tolist() == held[:m].tolist() and not joined.flags.writeable
                assert set(joined[m:].tolist()) <= free_before - set(held[:m].tolist())
                assert len(set(joined.tolist())) == joined.size == held.size + k % 3
                used |= set(joined.tolist())
                lent, held, whole = joined, None, False
        elif op == "give" and lent is not None:
            if set(lent.tolist()) <= used:
                a.free(lent, hold=True)
                used -= set(lent.tolist())
                held, under, whole = lent, a.free_count - lent.size, True
            else:  # some went back by another route
                with pytest.raises(ValueError, match="double free"):
                    a.free(lent, hold=True)
            lent = None
        stack = a._free[: a._top].tolist()
        assert sorted(stack) == sorted(set(range(16)) - used) and a.free_count == 16 - len(used)
        # the run kept apart is what is left of the held ids, in order, on top
        kept = a._held
        assert kept == 0 or (held is not None and stack[len(stack) - kept:] == held[:kept].tolist())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-64, 70), min_size=1, max_size=60), st.booleans())
def test_a_free_is_refused_exactly_when_an_id_is_out_of_range_free_or_repeated(ids, reverse):
    """The free's checks (one unsigned max for the range, places stamped for repeats: no sort)
    against a set reference, on batches of any order: refused -- naming the first offending id,
    nothing changed -- exactly when an id is out of range, not in use or given twice. Negative ids
    reach ids in use if wrapped (as NumPy indexing would)."""
    a = BlockAllocator(64, "pages")
    a.alloc(40)
    arr = np.asarray(ids, dtype=np.int64)
    arr = arr[::-1] if reverse else arr  # a strided view frees as well
    seen: set[int] = set()
    bad = None
    for i in arr.tolist():
        if not 0 <= i < 64 or i >= 40 or i in seen:
            bad = i
            break
        seen.add(i)
    if bad is None:
        a.free(arr)
        assert a.used_ids() == set(range(40)) - seen and a.free_count == 24 + len(seen)
        return
    with pytest.raises(ValueError, match=f"block( id)? {bad}( |$)"):
        a.free(arr)
    assert a.used_ids() == set(range(40)) and a.free_count == 24


def test_control_a_repeat_far_apart_in_a_large_batch_is_refused():
    """Control for the stamped places: one id twice, thousands apart, in a batch of 3,000."""
    a = BlockAllocator(5000, "pages")
    ids = a.alloc(3000)
    batch = np.concatenate([ids, ids[7:8]])
    with pytest.raises(ValueError, match=f"double free of block {int(ids[7])}"):
        a.free(batch)
    assert a.free_count == 2000
    a.free(ids)  # the same ids once each go back
    assert a.free_count == 5000
