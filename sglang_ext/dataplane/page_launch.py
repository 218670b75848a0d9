"""PageLaunch: a paged step's fetch launch, named by its requests (see :mod:`page_fetch`)."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_ext.dataplane.step_tables import Launch


@dataclass(frozen=True)
class PageLaunch(Launch):
    """A :class:`Launch` whose ``offset`` indexes the step's int32 upload, where its request ids
    are (``n_reqs`` of them, ascending); ``segments`` is what it copies."""

    first: int
    """Position of its first request id among the step's fetch request ids."""
    n_reqs: int
    max_pages: int
    """Most pages of one of its requests."""
