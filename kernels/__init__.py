"""Triton kernels (with torch reference implementations) for the layered KV data plane.

- :mod:`kernels.block_copy`: batched gather/scatter of KV segments between pools.
- :mod:`kernels.page_index`: per-layer page tables -> token-level KV slots.
- :mod:`kernels.paged_decode`: decode attention reading K/V through one layer's page table.
"""

from kernels.block_copy import copy_segments, copy_segments_ref, copy_segments_triton
from kernels.page_index import (
    pages_to_token_locs,
    pages_to_token_locs_ref,
    pages_to_token_locs_triton,
)
from kernels.paged_decode import (
    kv_lens_from_last_page_len,
    paged_decode,
    paged_decode_ref,
    paged_decode_triton,
)

__all__ = [
    "copy_segments",
    "copy_segments_ref",
    "copy_segments_triton",
    "kv_lens_from_last_page_len",
    "paged_decode",
    "paged_decode_ref",
    "paged_decode_triton",
    "pages_to_token_locs",
    "pages_to_token_locs_ref",
    "pages_to_token_locs_triton",
]
