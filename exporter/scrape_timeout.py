"""The scrape's own timeout, as a context: the web server sets it from Prometheus'
`X-Prometheus-Scrape-Timeout-Seconds` header around a scrape, and the collector ends
the collections started inside by it (collector.MpsCollector.budget)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional

_scrape_timeout: ContextVar[Optional[float]] = ContextVar("mps_exporter_scrape_timeout", default=None)


@contextmanager
def scrape_timeout(header: Optional[str]) -> Iterator[None]:
    """Collections started inside end by this scrape's timeout: the value of
    Prometheus' `X-Prometheus-Scrape-Timeout-Seconds` header (None or junk: no header)."""
    try:
        seconds: Optional[float] = float(header) if header else None
    except ValueError:
        seconds = None
    if seconds is not None and not seconds > 0:
        seconds = None
    token = _scrape_timeout.set(seconds)
    try:
        yield
    finally:
        _scrape_timeout.reset(token)


def current() -> Optional[float]:
    """The timeout of the scrape this runs in (None: no header, or not in a scrape)."""
    return _scrape_timeout.get()
