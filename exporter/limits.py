"""The MPS limits in force for a client: one rule, stated once (README "Where the numbers come from").

A client's own `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` wins per device; where it set
none, its server's limit applies **as it was when the client connected**; a client
whose server is not known gets the daemon's defaults instead. The thread share is
the smaller of the client's own `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and the one it
inherits (the server's, else the default): MPS never lets a client exceed its
server's share.

MPS fixes a client's limits when it connects: on an H100 a client connected under
the server's 8G grew to 3.5 GiB after `set_device_pinned_mem_limit <server> 0 3G`,
and was refused only past 8G, while a client connecting after the change was held
to 3G (tests/gpu/reports/h100-edges.md). So the server's limits at the client's
connection (the MPS logs know them) win over the server's limits now, which are
all there is where the logs do not reach back to the connection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional


@dataclass(frozen=True)
class Limits:
    thread_percentage: Optional[float] = None  # 0..100; None: not set
    pinned_bytes: Mapping[int, int] = field(default_factory=dict)  # MPS device ordinal -> bytes


def client_limits(own: Limits, server: Optional[Limits], default: Limits,
                  at_connect: Optional[Limits] = None) -> Limits:
    """The limits in force for a client with limits `own`, running on a server with
    `server` now (None: no server known for it), under a daemon with `default`;
    `at_connect`: the server's limits when the client connected, where known."""
    inherited = at_connect if at_connect is not None else server if server is not None else default
    shares = [p for p in (own.thread_percentage, inherited.thread_percentage) if p is not None]
    return Limits(min(shares) if shares else None, {**inherited.pinned_bytes, **own.pinned_bytes})
