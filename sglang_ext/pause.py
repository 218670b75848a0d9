"""``PauseManager``: keep-KV pause and resume of requests in SGLang's running batch.

SGLang's own ``Scheduler.pause_generation`` (mode ``retract``) and decode retraction
(``ScheduleBatch.retract_decode`` -> ``release_kv_cache``) free the KV and recompute it on resume.
kvplane's pause (OrbitFlow §3.4) keeps the KV instead:

* **pause** (at a step boundary, before ``get_next_batch_to_run``): the request's row is split off
  ``running_batch`` -- ``filter_batch(keep_indices=...)`` on the batch and on a shallow copy that
  keeps only the paused row -- and parked here. Its ``req_to_token`` row, ``req_pool_idx``, KV
  slots and tree locks are untouched: nothing is released, so neither retraction (which only sees
  ``running_batch``) nor the allocator can free them.
* **resume**: the parked one-request batch gets a fresh ``SamplingBatchInfo`` (built from the
  request's own sampling params, exactly as SGLang builds it for a prefill batch) and is merged
  back with ``running_batch.merge_batch`` (or becomes the running batch when that is empty). Its
  ``input_ids`` (the last sampled token) and ``seq_lens`` (tokens with KV) travel with it, so the
  next ``prepare_for_decode`` continues exactly where it stopped: greedy outputs are
  token-identical to an unpaused run.

Penalties (frequency, presence, repetition, ``min_new_tokens``) split with the row: the parked
batch gets its own copy of the batch's penalizer orchestrator (:func:`split_sampling_info`), so
each side filters its own rows of the penalizers' state (token counts, output lengths), and at
resume that state -- not a fresh one -- is merged back with SGLang's own ``merge``. Not paused
(the request is left running, reason logged): batches using custom logit processors or
speculative decoding -- their per-batch state cannot be split faithfully here. Nor, under SGLang's overlap loop, a request with a frequency, presence or repetition penalty
(:func:`penalized`: its token counts would drift), nor
a request whose last token (``max_new_tokens``) comes in the next step, or under SGLang's overlap
loop in the step in flight at the boundary (``in_flight_steps``): it frees its KV as soon as it
finishes, and parking it would only write its KV back to host memory for one more token later.
Grammar-constrained requests are paused: in SGLang 0.5.23 a request's grammar lives on the
request (``req.grammar``), each forward derives its grammars and vocab mask from the batch's
requests, and ``filter_batch`` / ``merge_batch`` recompute ``has_grammar``
(``test_pause_server.py``: regex-constrained requests paused, resumed, vanilla's output). A pause that would take the last running request
that keeps the batch going is skipped as ``would_idle`` (the step boundary's ``keep_one_of``: its
rule would resume it at once rather than idle), and the boundary drops it. Skipped pauses are
counted by reason (:data:`PAUSE_SKIP_REASONS`, ``kvplane:pauses_skipped_total``). A pause a batch
feature refuses (custom logit processors, speculative decoding, encoder-decoder), a penalised one
under the overlap loop and a ``would_idle`` one are dropped and named in the next step report
(:meth:`PauseManager.take_dropped`, ``StepReport.pauses_dropped``): the control plane counts the
request running at once and holds it (``controlplane/controller/request_tracker.py``; a worker
that names none is covered by the pause's lapse a step after it was due).
The control plane's other pauses (a finishing request, one not yet in the running batch) stay
deferred, retried at each boundary, and are dropped when the request is gone.

Runs on the scheduler thread; every TP rank applies the same calls in the same order.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from sglang_ext.hooks import ResidencyEventKind, ResidencyHooks

log = structlog.get_logger(__name__)


PAUSE_SKIP_REASONS: tuple[str, ...] = (
    "finishing", "custom_logit_processor", "speculative_decoding", "encoder_decoder", "would_idle",
    "penalties_in_flight",
)
"""Why a pause the plan asked for was not applied (:attr:`PauseManager.skipped`)."""
WARNED_MAX = 4096
"""Request ids remembered as already warned about (then forgotten all at once)."""


@dataclass
class ParkedRequest:
    """One paused request and the one-row batch that carries its decode state."""

    req: Any
    """SGLang ``Req``."""
    batch: Any
    """One-request ``ScheduleBatch`` split off the running batch."""
    since_step: int
    """Scheduler step at which it was paused."""


def unpausable_reason(batch: Any) -> str | None:
    """Why rows of ``batch`` cannot be split off and merged back faithfully (None = they can)."""
    info = getattr(batch, "sampling_info", None)
    if getattr(info, "has_custom_logit_processor", False):
        return "custom_logit_processor"
    if getattr(batch, "spec_info", None) is not None:
        return "speculative_decoding"
    if getattr(batch, "model_config", None) is not None and batch.model_config.is_encoder_decoder:
        return "encoder_decoder"
    return None


def penalized(req: Any) -> bool:
    """Whether ``req``'s sampling counts its output tokens (frequency, presence or repetition
    penalty). Under SGLang's overlap loop a step's ``prepare_for_decode`` counts the token of the
    step before the one in flight: a row parked there misses one token's count and counts
    another twice at its resume, so it is not paused (``penalties_in_flight``; control-plane
    review, session 63). ``min_new_tokens`` counts only lengths, which the split keeps."""
    p = getattr(req, "sampling_params", None)
    return bool(getattr(p, "frequency_penalty", 0.0) or getattr(p, "presence_penalty", 0.0)
                or getattr(p, "repetition_penalty", 1.0) != 1.0)


def split_sampling_info(info: Any, taken: Any) -> Any:
    """A shallow copy of ``info`` for ``taken`` (a shallow copy of the running batch, about to be
    filtered down to the paused row) with its own penalizer orchestrator: a copy bound to
    ``taken`` holding copies of the penalizers, each bound to it. The two orchestrators then
    filter their own rows (``ScheduleBatch.filter_batch`` filters ``reqs`` first, so each
    re-evaluates which penalizers it still needs from its own requests). SGLang's penalizers
    *replace* their tensors when filtered (``_filter`` indexes them; ``_cumulate_output_tokens``
    writes only into the replaced ones), so after the two filters the copies share nothing.
    Sharing one orchestrator instead (a plain shallow copy) filters it twice, for two different
    batches: session 22's server died on the first split batch, and ``test_pause_penalties.py``'s
    negative control raises. When the paused row is the batch's only one, SGLang filters neither
    side (a filter keeping every row, or none, returns early): the copies keep sharing tensors, but
    the emptied running batch is replaced, never run or merged into, so only the parked side
    uses them."""
    out = copy.copy(info)
    orchestrator = getattr(info, "penalizer_orchestrator", None)
    if orchestrator is None:
        return out
    clone = copy.copy(orchestrator)
    clone.batch = taken  # its requests: the paused row's once filtered
    clone.penalizers = {}
    for kind, penalizer in orchestrator.penalizers.items():
        mine = copy.copy(penalizer)
        mine._orchestrator_ref = weakref.ref(clone)
        clone.penalizers[kind] = mine
    out.penalizer_orchestrator = clone
    return out


class PauseManager:
    """Parks paused requests with their KV; merges them back on resume."""

    def __init__(
        self,
        hooks: ResidencyHooks | None = None,
        pages_of: Callable[[Any], Sequence[int]] | None = None,
        in_flight_steps: int = 0,
    ) -> None:
        self._parked: dict[str, ParkedRequest] = {}
        self._adapters: dict[Any, int] = {}
        """Parked requests per LoRA adapter (``req.lora_id``; None: the base model), kept with
        ``_parked`` (:attr:`lora_ids`)."""
        self.in_flight_steps = in_flight_steps
        """Steps launched but not yet processed at a boundary (1 under SGLang's overlap loop): each
        commits one more output token of the requests it carries before a pause takes effect."""
        self._hooks = hooks
        self._pages_of = pages_of
        self.skipped: dict[str, int] = {}
        """Pause attempts not applied, by reason (:data:`PAUSE_SKIP_REASONS`; running totals)."""
        self.last_skipped: dict[str, int] = {}
        """The same, of the last :meth:`pause` call only (the boundary's record)."""
        self.last_dropped: list[str] = []
        """Requests whose pause the last :meth:`pause` call skipped for good (``would_idle``,
        ``penalties_in_flight``): the boundary drops their deferred pause, which could otherwise
        wait a whole generation."""
        self._unreported: dict[str, None] = {}
        """Requests whose pause was dropped since the step reporter last took them
        (:meth:`take_dropped`: the control plane counts them running at once)."""
        self._warned: set[str] = set()
        """Requests whose skipped pause was logged (a batch feature: once per request)."""

    # ---- queries -------------------------------------------------------------------------
    @property
    def paused_ids(self) -> tuple[str, ...]:
        """Paused request ids, in pause order."""
        return tuple(self._parked)

    def parked(self) -> list[ParkedRequest]:
        return list(self._parked.values())

    @property
    def lora_ids(self) -> Any:
        """The LoRA adapters of the parked requests (a live keys view; SGLang's admission counts
        them, ``parked_lifecycle.around_can_schedule_lora_req``). A request that finished while
        parked is forgotten at the same step's end (:meth:`drop_finished`), before the next
        admission."""
        return self._adapters.keys()

    def _count_adapter(self, req: Any, change: int) -> None:
        lora = getattr(req, "lora_id", None)
        left = self._adapters.get(lora, 0) + change
        if left > 0:
            self._adapters[lora] = left
        else:
            self._adapters.pop(lora, None)

    def __contains__(self, rid: object) -> bool:
        return rid in self._parked

    def __len__(self) -> int:
        return len(self._parked)

    # ---- pause ---------------------------------------------------------------------------
    def pause(
        self, running_batch: Any, rids: Iterable[str], step: int, keep_one_of: Collection[int] | None = None,
    ) -> list[str]:
        """Split ``rids`` off ``running_batch`` (in place) and park them; returns those paused.
        Only requests decoding in the batch count: a pause of one prefilling, finishing, aborted
        or unknown is neither applied nor counted (it stays deferred by the boundary).

        ``keep_one_of``: the ``id()`` of the running requests that keep the batch going (the step
        boundary's rule: an empty one resumes every parked request rather than idle). A pause
        that would take the last of them is skipped as ``would_idle`` (:attr:`last_dropped`)
        -- it would be undone at once, after a write-back for nothing. None: no such rule."""
        self.last_skipped, self.last_dropped = {}, []
        wanted = [rid for rid in dict.fromkeys(rids) if rid not in self._parked]
        if not wanted or running_batch is None or running_batch.is_empty():
            return []
        decoding = {req.rid: req for req in running_batch.reqs if not req.finished() and req.to_finish is None}
        found = [rid for rid in wanted if rid in decoding]
        if not found:
            return []
        reason = unpausable_reason(running_batch)
        if reason is not None:
            self._skip(reason, len(found))
            # dropped, not deferred: the control plane counts a pause not shown a step after its
            # due step as not applied (request_tracker.APPLY_SLACK_STEPS) and plans the request
            # running; a deferred one applied later, once the batch could split, paused it
            # unplanned (control-plane review, session 78)
            self._drop(found)
            new = [rid for rid in found if rid not in self._warned]
            if new:  # once per request: a deferred pause is retried at every boundary
                if len(self._warned) > WARNED_MAX:  # bounded: a request warned again is harmless
                    self._warned.clear()
                self._warned.update(new)
                log.warning("pause_skipped", rids=new, reason=reason)
            return []
        done: list[str] = []
        keep = None if keep_one_of is None else set(keep_one_of)
        for rid in found:
            req = decoding[rid]
            if self._finishing(req):
                self._skip("finishing", 1)
                continue
            if self.in_flight_steps and penalized(req):
                self._skip("penalties_in_flight", 1)
                self._drop((rid,))
                continue
            if keep is not None and id(req) in keep:
                if len(keep) == 1:
                    self._skip("would_idle", 1)
                    self._drop((rid,))
                    continue
                keep.discard(id(req))
            idx = running_batch.reqs.index(req)
            taken = copy.copy(running_batch)
            taken.sampling_info = split_sampling_info(running_batch.sampling_info, taken)
            taken.filter_batch(keep_indices=[idx])
            running_batch.filter_batch(
                keep_indices=[i for i in range(len(running_batch.reqs)) if i != idx]
            )
            running_batch.batch_is_full = False
            self._parked[rid] = ParkedRequest(req=req, batch=taken, since_step=step)
            self._count_adapter(req, 1)
            done.append(rid)
            self._emit(ResidencyEventKind.PAUSED, req)
        if done:
            log.info("requests_paused", rids=done, step=step, running=len(running_batch.reqs))
        return done

    def _drop(self, rids: Sequence[str]) -> None:
        self.last_dropped.extend(rids)
        unreported = self._unreported
        unreported.update(dict.fromkeys(rids))
        while len(unreported) > WARNED_MAX:  # bounded: only TP rank 0 reports (takes them)
            del unreported[next(iter(unreported))]

    @property
    def has_unreported_drops(self) -> bool:
        return bool(self._unreported)

    def take_dropped(self) -> tuple[str, ...]:
        """The requests whose pause was dropped since the last call (``StepReport.pauses_dropped``),
        each once."""
        out = tuple(self._unreported)
        self._unreported.clear()
        return out

    def _skip(self, reason: str, count: int) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count
        self.last_skipped[reason] = self.last_skipped.get(reason, 0) + count

    def ends_soon(self, req: Any) -> bool:
        """Ending by the step after the boundary: aborted (``to_finish``), or its last token comes
        in a step in flight or the next one. It keeps no batch going beyond that step."""
        return req.to_finish is not None or self._finishing(req)

    def _finishing(self, req: Any) -> bool:
        """The request's last output token comes in a step in flight or in the next one."""
        max_new = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
        if max_new is None:
            return False
        return len(req.output_ids) + self.in_flight_steps + 1 >= int(max_new)

    # ---- resume --------------------------------------------------------------------------
    def resume(self, running_batch: Any, rids: Iterable[str]) -> tuple[Any, list[str]]:
        """Merge the parked ``rids`` back; returns the (possibly new) running batch and those resumed."""
        done: list[str] = []
        for rid in dict.fromkeys(rids):
            parked = self._parked.pop(rid, None)
            if parked is None:
                continue
            self._count_adapter(parked.req, -1)
            batch = parked.batch
            from sglang_ext.compat import SamplingBatchInfo

            # fresh sampling tensors, as SGLang builds them for a prefill batch, but the
            # penalizers' state the request accumulated before its pause (a fresh orchestrator
            # would restart its token counts and output length)
            penalties = batch.sampling_info.penalizer_orchestrator
            batch.sampling_info = SamplingBatchInfo.from_schedule_batch(
                batch, batch.model_config.vocab_size
            )
            if penalties is not None:
                batch.sampling_info.penalizer_orchestrator = penalties
            if running_batch is None or running_batch.is_empty():
                running_batch = batch
            else:
                running_batch.merge_batch(batch)
            running_batch.batch_is_full = False
            done.append(rid)
            self._emit(ResidencyEventKind.RESUMED, parked.req)
        if done:
            log.info("requests_resumed", rids=done, running=len(running_batch.reqs))
        return running_batch, done

    def drop_finished(self, rids: Iterable[str]) -> list[str]:
        """Forget the parked ``rids`` whose request finished while parked; returns them.

        Only SGLang's overlap loop finishes a parked request: step k+1's boundary parks it while
        step k, which it is part of, is still in flight, and processing step k's result can end
        it (its last token, a stop string). SGLang then releases its KV as for any finished
        request; merging it back would keep a finished request tracked -- and reported paused --
        forever."""
        dropped = []
        for rid in rids:
            parked = self._parked.get(rid)
            if parked is not None and parked.req.finished():
                del self._parked[rid]
                self._count_adapter(parked.req, -1)
                dropped.append(rid)
        if dropped:
            log.info("paused_requests_finished", rids=dropped)
        return dropped

    def resume_matching(
        self, running_batch: Any, predicate: Callable[[Any], bool]
    ) -> tuple[Any, list[str]]:
        """Resume every parked request whose ``Req`` satisfies ``predicate`` (e.g. an abort)."""
        rids = [rid for rid, p in self._parked.items() if predicate(p.req)]
        return self.resume(running_batch, rids)

    def resume_all(self, running_batch: Any) -> tuple[Any, list[str]]:
        return self.resume(running_batch, list(self._parked))

    # ---- internals -----------------------------------------------------------------------
    def _emit(self, kind: ResidencyEventKind, req: Any) -> None:
        if self._hooks is None or not self._hooks.has_subscribers:
            return
        blocks: list[int] = []
        if self._pages_of is not None:
            try:
                blocks = list(self._pages_of(req))
            except Exception:  # events are telemetry: never break a step for them
                log.warning("pause_event_pages_failed", rid=req.rid, exc_info=True)
        self._hooks.emit(kind, blocks, rid=req.rid)
