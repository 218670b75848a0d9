"""A pause splits a row's penalty state off the batch and a resume merges it back: SGLang's own
penalizers (frequency, presence, repetition, ``min_new_tokens``) and orchestrator, driven the
way ``ScheduleBatch.filter_batch`` / ``merge_batch`` drive them, on a stand-in batch (requests
and a device). The state after pause, more decoding, and resume must equal a batch that decoded
the same tokens without a pause; a shared orchestrator (a plain shallow copy, before
``split_sampling_info``) must not."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
from sglang.srt.sampling.penaltylib import (  # noqa: E402
    BatchedFrequencyPenalizer,
    BatchedMinNewTokensPenalizer,
    BatchedPenalizerOrchestrator,
    BatchedPresencePenalizer,
    BatchedRepetitionPenalizer,
)

from sglang_ext.pause import split_sampling_info  # noqa: E402

VOCAB = 16
EOS = 0
PENALIZERS = {BatchedFrequencyPenalizer, BatchedMinNewTokensPenalizer, BatchedPresencePenalizer,
              BatchedRepetitionPenalizer}


class _Batch:
    """``ScheduleBatch``'s part the penalizers see: ``reqs``, ``device``; ``filter`` / ``merge``
    in SGLang's order (requests first on filter, the orchestrators first on merge)."""

    def __init__(self, reqs: list) -> None:
        self.reqs = reqs
        self.device = "cpu"
        self.sampling_info = SimpleNamespace(
            penalizer_orchestrator=BatchedPenalizerOrchestrator(VOCAB, self, PENALIZERS))

    def filter(self, keep: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep]
        self.sampling_info.penalizer_orchestrator.filter(torch.tensor(keep, dtype=torch.int64))

    def merge(self, other: _Batch) -> None:
        self.sampling_info.penalizer_orchestrator.merge(other.sampling_info.penalizer_orchestrator)
        self.reqs = self.reqs + other.reqs

    def decode(self, tokens: list[int]) -> None:
        self.sampling_info.penalizer_orchestrator.cumulate_output_tokens(torch.tensor(tokens, dtype=torch.int64))

    def logits(self) -> torch.Tensor:
        out = torch.linspace(-1.0, 1.0, VOCAB).repeat(len(self.reqs), 1)
        self.sampling_info.penalizer_orchestrator.apply(out)
        return out


def _req(freq: float, presence: float, repetition: float, min_new: int) -> SimpleNamespace:
    params = SimpleNamespace(frequency_penalty=freq, presence_penalty=presence, repetition_penalty=repetition,
                             min_new_tokens=min_new, stop_token_ids=set())
    return SimpleNamespace(sampling_params=params, eos_token_ids={EOS},
                           tokenizer=SimpleNamespace(additional_stop_token_ids=None, eos_token_id=EOS))


def _reqs() -> list[SimpleNamespace]:
    return [_req(0.5, 0.0, 1.0, 0), _req(0.3, 0.7, 1.3, 4), _req(0.0, 0.0, 1.0, 0)]


def _split_shared(info, taken):  # noqa: ANN001, ANN202 - the split before split_sampling_info
    return copy.copy(info)


def _paused_run(split) -> torch.Tensor:  # noqa: ANN001
    """Three requests decode two tokens; the middle one is paused (split off as PauseManager
    does), the others decode two more, it is resumed (merged back last): the batch's logits."""
    batch = _Batch(_reqs())
    batch.decode([3, 5, 7])
    batch.decode([3, 6, 7])
    taken = copy.copy(batch)
    taken.sampling_info = split(batch.sampling_info, taken)
    taken.filter([1])
    batch.filter([0, 2])
    batch.decode([3, 9])
    batch.decode([4, 9])
    batch.merge(taken)
    return batch.logits()


def _unpaused_reference() -> torch.Tensor:
    """The same tokens without a pause: rows 0 and 2 decode four, row 1 two (its batch leaves
    then), in the resumed batch's order (0, 2, 1)."""
    reqs = _reqs()
    both = _Batch([reqs[0], reqs[2]])
    for tokens in ([3, 7], [3, 7], [3, 9], [4, 9]):
        both.decode(tokens)
    alone = _Batch([reqs[1]])
    alone.decode([5])
    alone.decode([6])
    both.merge(alone)
    return both.logits()


def test_penalty_state_survives_pause_and_resume():
    """Frequency and presence counts, the repetition factors and ``min_new_tokens``' output
    length of the paused row are its own after the resume (EOS still masked: 2 of 4 tokens out),
    and the running rows' are untouched by the split."""
    got, want = _paused_run(split_sampling_info), _unpaused_reference()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[2, EOS] == float("-inf") and got[0, EOS] > float("-inf")  # min_new_tokens for row 1 only
    plain = _Batch([_req(0.0, 0.0, 1.0, 0)] * 3).logits()
    assert not torch.equal(got[0], plain[0]) and not torch.equal(got[2], plain[2])  # penalties do apply


def test_a_shared_orchestrator_does_not_survive():
    """Negative control: the paused row and the running batch sharing one orchestrator (filtered
    twice, for two batches) break the state outright: SGLang's penalizer indexes rows the second
    filter no longer has (what killed the server before the split), inside SGLang's code."""
    with pytest.raises(IndexError, match="out of bounds") as err:
        _paused_run(_split_shared)
    assert any("sglang/srt/sampling/penaltylib" in entry.path.as_posix() for entry in err.traceback), err.traceback


def test_a_batch_without_penalties_splits_and_merges_into_one_with_them():
    """A row paused from a batch with no penalties, resumed into a batch that has them since,
    joins with its own (empty) state, prepared from its own request at the merge."""
    plain = _req(0.0, 0.0, 1.0, 0)
    batch = _Batch([plain, _req(0.0, 0.0, 1.0, 0)])
    assert not batch.sampling_info.penalizer_orchestrator.is_required
    batch.decode([3, 4])
    taken = copy.copy(batch)
    taken.sampling_info = split_sampling_info(batch.sampling_info, taken)
    taken.filter([0])
    batch.filter([1])
    penalised = _Batch([_req(0.5, 0.0, 1.0, 0)])
    penalised.decode([5])
    penalised.merge(taken)
    logits = penalised.logits()
    base = torch.linspace(-1.0, 1.0, VOCAB)
    torch.testing.assert_close(logits[1], base, rtol=0, atol=0)  # the resumed row: no penalty
    assert logits[0, 5] == pytest.approx(float(base[5]) - 0.5)
