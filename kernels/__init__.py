"""Triton kernels (with torch reference implementations) for the layered KV data plane.

- :mod:`kernels.block_copy`: batched gather/scatter of KV segments between pools.
- :mod:`kernels.page_index`: per-layer page tables -> token-level KV slots.
"""

from kernels.block_copy import copy_segments, copy_segments_ref, copy_segments_triton
from kernels.page_index import (
    pages_to_token_locs,
    pages_to_token_locs_ref,
    pages_to_token_locs_triton,
)

__all__ = [
    "copy_segments",
    "copy_segments_ref",
    "copy_segments_triton",
    "pages_to_token_locs",
    "pages_to_token_locs_ref",
    "pages_to_token_locs_triton",
]
