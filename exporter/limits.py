"""The MPS limits in force for a client: one rule, stated once (README "Where the numbers come from").

A client's own `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` wins per device; where it set
none, its server's limit applies; a client whose server is not known gets the
daemon's defaults instead. The thread share is the smaller of the client's own
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and the one it inherits (the server's, else
the default): MPS never lets a client exceed its server's share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass(frozen=True)
class Limits:
    thread_percentage: Optional[float] = None  # 0..100; None: not set
    pinned_bytes: Mapping[int, int] = field(default_factory=dict)  # MPS device ordinal -> bytes


def client_limits(own: Limits, server: Optional[Limits], default: Limits) -> Limits:
    """The limits in force for a client with limits `own`, running on a server with
    `server` (None: no server known for it), under a daemon with `default`."""
    inherited = server if server is not None else default
    shares = [p for p in (own.thread_percentage, inherited.thread_percentage) if p is not None]
    return Limits(min(shares) if shares else None, {**inherited.pinned_bytes, **own.pinned_bytes})
