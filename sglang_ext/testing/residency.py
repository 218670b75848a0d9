"""Check a residency event stream for block-lifecycle consistency (used by e2e tests)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sglang_ext.hooks import ResidencyEvent, ResidencyEventKind

_K = ResidencyEventKind


@dataclass(frozen=True)
class BlockLifecycleReport:
    """Outcome of :func:`check_block_lifecycle`."""

    allocations: int
    """Blocks handed out (``allocated`` + ``extended``), counting re-use of an id."""
    frees: int
    """Blocks returned (``freed``)."""
    live_blocks: frozenset[int]
    """Blocks allocated and not yet freed at the end of the stream."""
    errors: tuple[str, ...]
    """Violations: double allocation, free of a block not live, out-of-order seq."""


def check_block_lifecycle(events: Iterable[ResidencyEvent]) -> BlockLifecycleReport:
    """Replay ``events``: each block must be allocated, then freed exactly once, then may be re-used."""
    live: set[int] = set()
    errors: list[str] = []
    allocations = frees = 0
    expected_seq = 0
    for event in events:
        if event.seq != expected_seq:
            errors.append(f"seq {event.seq} where {expected_seq} was expected")
        expected_seq = event.seq + 1
        if event.kind in (_K.ALLOCATED, _K.EXTENDED):
            for block in event.blocks:
                if block in live:
                    errors.append(f"seq {event.seq}: block {block} allocated twice ({event.rid})")
                live.add(block)
                allocations += 1
        elif event.kind is _K.FREED:
            for block in event.blocks:
                if block not in live:
                    errors.append(f"seq {event.seq}: block {block} freed but not live")
                live.discard(block)
                frees += 1
    return BlockLifecycleReport(allocations, frees, frozenset(live), tuple(errors))
