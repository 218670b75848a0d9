"""The test-only injector's rank of this process (patches that act on one TP rank only)."""

from __future__ import annotations


def this_rank() -> int:
    """This process's ``torch.distributed`` rank (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
