"""IdentityDecodeStep: the identity layout's steady decode step when the decode backends read page
tables (``LayeredKVCore.paged_reads``: FlashInfer, Triton -- the CUDA defaults).

:meth:`LayeredKVCore.prepare_decode_step` journals a steady step's bookkeeping in the identity
layout (:class:`~sglang_ext.dataplane.decode_journal.DecodeJournal`) and the layers write in place
by slot id. Backends that read in place need nothing more; the paged-read backends need the step's
page tables, which a general step builds by reading every request's slots and looking up the
``[L, P]`` map at ``L x`` the batch's pages. Here they come from each request's page list as of its
last boundary (the core's :class:`~sglang_ext.dataplane.decode_continuity.DecodeContinuity`; the
batch may have changed since) grown by the pages the new tokens open:
:class:`~sglang_ext.dataplane.identity_decode_tables.IdentityDecodeTables` (one row and the CSR,
one upload, one device op). It is the core's logic, split out by role, as
:class:`~sglang_ext.dataplane.paged_decode_step.PagedDecodeStep` is the paged layout's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang_ext.dataplane.identity_decode_tables import IdentityDecodeTables

if TYPE_CHECKING:
    from sglang_ext.dataplane.layered_kv_core import LayeredKVCore


class IdentityDecodeStep:
    """The identity layout's paged-read steady step of a :class:`LayeredKVCore` (module docstring)."""

    def __init__(self, core: LayeredKVCore) -> None:
        self.core = core
        self.steps = 0
        """Steps prepared here (their tables from the last step's page lists)."""
        self._layer_base: torch.Tensor | None = None
        """``[L, 1]`` int32 ``l * P`` on the device (the tables' per-layer base)."""

    def begin(self, lists: list[np.ndarray], seq_lens: Sequence[int] | np.ndarray) -> None:
        """The step's tables from ``lists`` (the requests' page lists,
        :meth:`DecodeContinuity.continued`; the journal recorded the step)."""
        core = self.core
        lens = [int(n) for n in seq_lens]
        core.store.staging_pages = 0
        core.tables = self.tables(lists, np.asarray(lens, dtype=np.int64))
        core.pipeline.begin_step(core.tables)  # idle: nothing to launch, nothing to wait for
        # the served adapter skips every per-layer call of this step, the last layer's exit (which
        # ends the step) included: forget the compute stream now, or the copies of a plan installed
        # before the next step (on SGLang's schedule stream, under the overlap loop) would order
        # themselves after this forward's stream alone
        core.store.engine.end_compute()
        self.steps += 1

    def tables(self, lists: Sequence[np.ndarray], seq_lens: np.ndarray) -> IdentityDecodeTables:
        """The tables of a step whose every live layer-page is resident (identity layout): a
        steady decode step's (:meth:`begin`) or a general step's -- a prefill's, an extend's
        (``LayeredKVCore._begin_in_place``) -- from its page lists."""
        if self._layer_base is None:
            core = self.core
            layers, lp = core.layers, core.store.config.logical_pages
            self._layer_base = (torch.arange(layers, dtype=torch.int32) * lp).view(layers, 1).to(core.store.device)
        return IdentityDecodeTables(self.core.store, lists, seq_lens, self._layer_base)
