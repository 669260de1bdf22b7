"""The shipped demo session (exporter/data/) as `replay` serves it, on a clock the test
sets, and the moments the status tests show: found in the session itself, so that a
re-recorded session keeps those tests."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from typing import Callable, Iterator, List, Tuple

from mps_exporter.bundle import Bundle, load
from mps_exporter.collector import MpsCollector
from mps_exporter.config import Config
from mps_exporter.replay import Player, replay_config, shipped_bundle
from mps_exporter.wiring import build_collector, build_readers


@contextlib.contextmanager
def replayed(tmp: str) -> Iterator[Tuple[Bundle, Callable[[float], MpsCollector]]]:
    """The shipped session as `replay` serves it, on a clock the test sets: `at(t)` feeds
    the log files up to t seconds in and returns the collector, whose sources then answer
    what they recorded last before t."""
    bundle = load(shipped_bundle())
    position = [0.0]
    player = Player(bundle, tmp, monotonic=lambda: position[0])
    cfg = replay_config(Config(), bundle, player.log_dirs)
    readers = {**build_readers(cfg, recorded=False), **player.readers()}
    collector = build_collector(cfg, readers, clock=player.clock)

    def at(t: float) -> MpsCollector:
        position[0] = t
        player.feed()
        for reader in readers.values():
            reader.catch_up()
        return collector

    try:
        yield bundle, at
    finally:
        for reader in readers.values():
            reader.close()


@functools.lru_cache(maxsize=None)
def moments() -> Tuple[float, float, float]:
    """(a moment with a client queued behind another user's server, the first reading where
    the daemon says a server is in FAULT, the first where the logs have its fatal GPU error).
    The last two can differ: the server's log lines may arrive a reading after the status."""
    queued: List[float] = []
    fault = fatal = None
    with tempfile.TemporaryDirectory() as tmp, replayed(tmp) as (bundle, at):
        for scrape in bundle.scrapes:
            snap = at(scrape.t).snapshot()
            if any(p.reason == "user_switch" for log in snap.logs.values() for p in log.pending):
                queued.append(scrape.t)
            if fault is None and any(s.status == "FAULT" for d in snap.daemons for s in d.servers):
                fault = scrape.t
            if fatal is None and any(log.fatal_gpu_errors for log in snap.logs.values()):
                fatal = scrape.t
            if fault is not None and fatal is not None:
                break
    assert queued and fault is not None and fatal is not None and queued[0] < fault, \
        "the shipped session must queue a client, then have a fatal GPU error that puts its server in FAULT"
    return queued[len(queued) // 2], fault, fatal  # the middle of the wait: some seconds so far
