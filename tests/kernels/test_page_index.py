"""Page table -> token slot expansion: Triton kernel vs torch reference."""

import pytest
import torch

from kernels.page_index import (
    pages_to_token_locs,
    pages_to_token_locs_ref,
    pages_to_token_locs_triton,
)

BLOCK_SIZES = (1, 4, 16)
LENS = ((5,), (0, 3, 17), (300, 1, 64))
SEED = 7


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("lens", LENS)
def test_triton_matches_reference(triton_device: str, bs: int, lens: tuple[int, ...]) -> None:
    """Every token slot equals pages[t // bs] * bs + t % bs of its request, in batch order."""
    g = torch.Generator().manual_seed(SEED)
    pages_per = [-(-n // bs) for n in lens]
    indptr = torch.tensor([0] + list(torch.tensor(pages_per).cumsum(0).tolist()), dtype=torch.int32)
    indices = torch.randperm(1000, generator=g)[: int(indptr[-1])].to(torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    expected = pages_to_token_locs_ref(indptr, indices, kv_lens, bs)
    got = pages_to_token_locs_triton(
        indptr.to(triton_device), indices.to(triton_device), kv_lens.to(triton_device), bs
    )
    assert got.cpu().tolist() == expected.tolist()
    if lens == (5,):
        assert expected.tolist() == [int(indices[t // bs]) * bs + t % bs for t in range(5)]


def test_reference_rejects_short_page_list() -> None:
    """A page list too short for the token count is an error, not a silent overrun."""
    with pytest.raises(ValueError, match="cannot hold"):
        pages_to_token_locs(
            torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([5]), 4, impl="torch"
        )
