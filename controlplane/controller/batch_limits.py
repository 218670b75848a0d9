"""The worker's batch limits as the controller applies them (OrbitFlow §5.1 "Workloads").

OrbitFlow fixes the batch size (4) and limits the total sequence length per batch (32K tokens);
admission and resumption are bounded by these limits, not by whether a request's whole KV fits
the GPU (the layers that do not fit are offloaded at prefill, §3.3). A *paused* request is out of
the batch (§3.4: the scheduler "temporarily drops" it), so it holds neither a slot nor tokens.

The limits are the worker's: the simulator passes its profile's; SGLang enforces its own
(``--max-running-requests``, the pool) and the embedded controller runs without limits
(:data:`UNLIMITED`), so a decision never asks for more than the worker can hold.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLimits:
    """Largest running batch the controller may build by admission or resumption."""

    max_requests: int | None = None
    """Requests decoding at once (running, not paused); None = no limit."""
    max_tokens: int | None = None
    """Summed context tokens of the running requests; None = no limit."""

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"batch_limits.{name}: {v!r} is out of range (allowed None or >= 1)")

    def admits(self, requests: int, tokens: int, add_tokens: int) -> bool:
        """Whether one more request of ``add_tokens`` fits a batch of ``requests`` holding
        ``tokens``. A lone request is always admitted (the worker chunks what it cannot hold)."""
        if self.max_requests is not None and requests + 1 > self.max_requests:
            return False
        if self.max_tokens is not None and requests > 0 and tokens + add_tokens > self.max_tokens:
            return False
        return True


UNLIMITED = BatchLimits()
"""No limit: the worker enforces its own (SGLang)."""
