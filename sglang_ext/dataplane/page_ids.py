"""Page ids from SGLang checked before the data plane records them.

NumPy and torch index a negative id from the end: a page id of -1 in a free or a request's
slots was applied to the pool's last page (its live request lost it, a dirty device copy
dropped without write-back), and an id past the pool raised only after the request was
recorded, so every later boundary raised (data-plane review, session 64). A request's slots:
one ``min`` and one ``max`` before anything changes (:func:`check_page_ids`). Freed ids: two
binary searches in the sorted batch of frees being applied (:func:`in_pool`; raising would fail
SGLang's free, so they are logged and left out).
"""

from __future__ import annotations

import numpy as np
import structlog

log = structlog.get_logger(__name__)


def check_page_ids(pages: np.ndarray, logical_pages: int, what: str) -> None:
    """``ValueError`` naming ``what`` and the first bad ids unless every id in ``pages`` (int) is
    in ``[0, logical_pages)``."""
    if not pages.size:
        return
    low, high = int(pages.min()), int(pages.max())
    if low >= 0 and high < logical_pages:
        return
    bad = pages[(pages < 0) | (pages >= logical_pages)]
    raise ValueError(f"{what}: page ids {bad[:8].tolist()} outside the pool's {logical_pages} pages "
                     "(slot // page_size)")


def in_pool(pages: np.ndarray, logical_pages: int, what: str) -> np.ndarray:
    """The ids of ``pages`` (distinct, ascending) in ``[0, logical_pages)``; any other is logged,
    naming ``what``, and left out."""
    lo, hi = np.searchsorted(pages, (0, logical_pages))
    if lo == 0 and hi == pages.size:
        return pages
    bad = np.concatenate((pages[:lo], pages[hi:]))
    log.error("kvplane_bad_page_ids_ignored", what=what, pages=bad[:8].tolist(), pool_pages=logical_pages)
    return pages[lo:hi]
