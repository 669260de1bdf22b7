"""Which alerts the demo (`mps-exporter replay`, the shipped session in a loop on the
present clock) should fire, and when: the recorded session's own events, read from the
series a Prometheus scraping it every INTERVAL would store (replay_series.py).

Shared by tests/alerts/test_replay_quiet.py (promtool over the stepped series) and
bench/live_replay_alerts.py (a live run behind real Prometheus and Alertmanager).
"""

from __future__ import annotations

import functools
import re
from typing import Dict, List, Optional, Set, Tuple

from alerts.definitions import ALERTS
from tests.support.replay_series import scrapes

MINUTES = 15
INTERVAL = 15  # seconds: deploy/compose/prometheus/prometheus.yml's scrape and evaluation interval

# What the recorded H100 session did (tests/gpu/reports: a fatal GPU error, clients refused
# at the client limit, a server that exited with clients), each an event counter, and the
# alert that says so. Every other alert must stay quiet: the demo is a healthy node.
EVENTS = {
    "MpsFatalGpuError": "mps_fatal_gpu_errors_total",
    "MpsClientsRefused": "mps_client_rejections_total",
    "MpsServerExitedWithClients": "mps_server_exits_with_clients_total",
}
BY_NAME = {a.alertname: a for a in ALERTS}

Series = Dict[str, List[Optional[float]]]


def rule_seconds(duration: str) -> int:
    """A rule's duration (`10m`, `0m`, `15s`) in seconds."""
    value, unit = int(duration[:-1]), duration[-1]
    return value * {"s": 1, "m": 60, "h": 3600}[unit]


@functools.lru_cache(maxsize=None)
def replayed(seconds: int) -> Tuple[Tuple[float, ...], Series]:
    """(scrape times, series) of `seconds` of the demo scraped every INTERVAL from its start (0).
    Cached per `seconds`: pass it positionally, as the functions below do."""
    times, series = scrapes(seconds, INTERVAL)
    return tuple(times), series


def recorded_moments(counter: str, seconds: int = MINUTES * 60) -> List[float]:
    """The scrape times at which a series of `counter` grew: the session's events."""
    times, series = replayed(seconds)
    moments: Set[float] = set()
    for key, values in series.items():
        if key.startswith(counter + "{"):
            moments.update(times[i] for i in range(1, len(values)) if values[i] is not None
                           and values[i - 1] is not None and values[i] > values[i - 1])  # type: ignore[operator]
    return sorted(moments)


def expected_firing(t: float, seconds: int = MINUTES * 60) -> List[str]:
    """The event alerts whose window, ending at t, holds one of the session's events."""
    out = []
    for name, counter in EVENTS.items():
        window = re.search(r"\[(\w+)\]", BY_NAME[name].expr)
        assert window, name
        if any(t - rule_seconds(window.group(1)) < m <= t for m in recorded_moments(counter, seconds)):
            out.append(name)
    return out
