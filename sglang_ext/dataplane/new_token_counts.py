"""The new tokens of a step's requests, checked before the core's boundary changes anything.

:meth:`LayeredKVCore.prepare_step` takes each request's slots (its first ``seq_len`` tokens) and
the slots the forward writes, ``new_counts[i]`` of them request ``i``'s last positions. A count
list of the wrong length, or a request holding fewer slots than it writes (its new tokens would
sit before its first position: SGLang's warm-up rows with ``seq_lens`` 0, before
``layered_attention._warmup_rows``), is refused here by name -- before the boundary ends the last
forward, observes the batch or reconciles, so a refused step leaves the core as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def new_token_counts(rids: Sequence[str | None], lens: Sequence[int], n_new: int,
                     new_counts: Sequence[int] | None) -> np.ndarray:
    """``new_counts`` as int64 (default: one each -- a decode step -- or all ``n_new`` for a single
    request); ValueError naming what is wrong."""
    n = len(lens)
    if new_counts is None:
        if n_new == n:
            new_counts = [1] * n
        elif n == 1:
            new_counts = [n_new]
        else:
            raise ValueError(f"prepare_step: {n_new} new slots for {n} requests needs new_counts "
                             "(new tokens per request, the last positions of each)")
    counts = np.asarray(new_counts, dtype=np.int64)
    if counts.shape != (n,):
        raise ValueError(f"prepare_step: {counts.size} new_counts for {n} requests")
    short = np.flatnonzero(np.asarray(lens, dtype=np.int64) < counts)
    if short.size:
        i = int(short[0])
        raise ValueError(f"prepare_step: request {rids[i]!r} (row {i}) writes {int(counts[i])} new token(s) but "
                         f"holds {lens[i]} (its slots must include the new tokens')")
    return counts
