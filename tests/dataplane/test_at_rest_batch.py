"""at_rest_batch: an overflow step reads each distinct slot once, and every request's tokens
through the table come back in order -- the same K/V the per-request concatenation gave, from a
read no larger than the batch's distinct slots (a shared prefix read once, not once a request)."""

from __future__ import annotations

import torch

from sglang_ext.dataplane.at_rest_batch import at_rest_batch


def _gathered(kv: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    """Each request's K as the attention reads it: the at-rest read of ``slots``, then its row."""
    read = kv[slots]
    return [read[table[i, :n]] for i, n in enumerate(lens)]


def test_a_shared_prefix_is_read_once_and_every_request_sees_its_tokens() -> None:
    kv = torch.randn(64, 2, 4)
    prefix = torch.arange(8, 24)  # 16 slots shared by three requests (the radix cache's pages)
    per_req = [torch.cat([prefix, torch.tensor([40, 41])]), torch.cat([prefix, torch.tensor([50])]),
               torch.tensor([60, 61, 62])]
    lens = [18, 17, 3]
    slots, table = at_rest_batch(per_req, lens, "cpu")
    assert slots.tolist() == sorted(set(torch.cat(per_req).tolist()))  # 16 + 2 + 1 + 3 distinct
    assert slots.numel() == 22 < sum(lens) == 38
    for got, want in zip(_gathered(kv, slots, table, lens), per_req, strict=True):
        assert torch.equal(got, kv[want])
    assert table.shape == (3, 18) and int(table[2, 3:].abs().sum()) == 0  # padding past a length
    # negative control: the table read as positions in the concatenation (the old read) is wrong
    # for every request after the first, so the check above can fail
    concat = kv[torch.cat(per_req)]
    assert not torch.equal(concat[table[1, :17]], kv[per_req[1]])


def test_an_empty_batch_and_requests_without_tokens() -> None:
    slots, table = at_rest_batch([], [], "cpu")
    assert slots.numel() == 0 and table.shape == (0, 1)
    slots, table = at_rest_batch([torch.zeros(0, dtype=torch.int64)], [0], "cpu")
    assert slots.numel() == 0 and table.shape == (1, 1)
    slots, table = at_rest_batch([torch.tensor([5, 6]), torch.zeros(0, dtype=torch.int64)], [2, 0], "cpu")
    assert slots.tolist() == [5, 6] and table.tolist() == [[0, 1], [0, 0]]
