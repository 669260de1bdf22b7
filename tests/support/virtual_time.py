"""A monotonic clock and a wait for reads that only the test moves (collector.Timing).

With the real clock, whether a read ended within a wait of 10 ms is the machine's load
to decide: on a loaded machine a fake daemon's read took longer, and a test meant to
check the collector's choices checked the machine instead (issue 42 point 8). Here a
read takes no time unless it says so (`advance`), and a wait ends when its reads are
done or when the clock has passed its timeout, whichever comes first on this clock:

    time = VirtualTime()
    collector = MpsCollector(readers, timing=time.timing(), control_wait=0.01)
    # a read that takes 20 ms: time.advance(0.02) inside it, then block until the
    # scrape that waits for it has given up (an Event the test sets afterwards)

A wait that neither sees its reads end nor the clock pass its timeout within
REAL_LIMIT seconds of real time fails the test: a hang, not a slow machine."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Optional, Sequence

from mps_exporter.collector import Timing

REAL_LIMIT = 60.0


class VirtualTime:
    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self._changed = threading.Condition()
        self.timeouts = 0  # waits that ended because the clock passed their timeout

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._changed:
            self.now += seconds
            self._changed.notify_all()

    def _notify(self, _: "Future[Any]") -> None:
        with self._changed:
            self._changed.notify_all()

    def wait(self, futures: Sequence["Future[Any]"], timeout: Optional[float]) -> None:
        end = None if timeout is None else self.now + timeout
        for future in futures:
            future.add_done_callback(self._notify)
        with self._changed:
            ended = self._changed.wait_for(
                lambda: all(f.done() for f in futures) or (end is not None and self.now >= end), REAL_LIMIT)
            if not ended:
                raise AssertionError(f"a wait for reads saw neither their end nor its timeout in {REAL_LIMIT:g} s")
            if not all(f.done() for f in futures):
                self.timeouts += 1

    def timing(self) -> Timing:
        return Timing(monotonic=self.monotonic, wait=self.wait)
