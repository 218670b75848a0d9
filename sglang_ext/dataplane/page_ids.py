"""Page ids from SGLang checked before the data plane records them.

NumPy and torch index a negative id from the end: a page id of -1 in a free or a request's
slots was applied to the pool's last page (its live request lost it, a dirty device copy
dropped without write-back), and an id past the pool raised only after the request was
recorded, so every later boundary raised (data-plane review, session 64). One ``min`` and one
``max`` per call, before anything changes.
"""

from __future__ import annotations

import numpy as np


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
