"""The shipped demo session (exporter/data/) as `replay` serves it, on a clock the test
sets, and the moments the status tests show: found in the session itself, so that a
re-recorded session keeps those tests."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from typing import Callable, Dict, Iterator, List, NamedTuple, Tuple

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


class Moments(NamedTuple):
    """Seconds into the shipped session."""

    queued: float  # a client waits behind another user's server (the middle of its wait)
    fault: float  # the first reading where the daemon says a server is in FAULT
    fatal: float  # the first where the logs have the fatal GPU error (may be a reading later)
    priority: float  # the first where a client has set CUDA_MPS_CLIENT_PRIORITY
    end: float  # the end of the recording: every event of the session in the logs


@functools.lru_cache(maxsize=None)
def moments() -> Moments:
    queued: List[float] = []
    found: Dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, replayed(tmp) as (bundle, at):
        for scrape in bundle.scrapes:
            snap = at(scrape.t).snapshot()
            if any(p.reason == "user_switch" for log in snap.logs.values() for p in log.pending):
                queued.append(scrape.t)
            clients = {c.pid for d in snap.daemons for c in d.clients}
            for name, seen in (("fault", any(s.status == "FAULT" for d in snap.daemons for s in d.servers)),
                               ("fatal", any(log.count("mps_fatal_gpu_errors_total") for log in snap.logs.values())),
                               ("priority", any("CUDA_MPS_CLIENT_PRIORITY" in snap.processes[pid].environ
                                                for pid in clients if pid in snap.processes))):
                if seen:
                    found.setdefault(name, scrape.t)
        assert queued and len(found) == 3 and queued[0] < found["fault"], (
            "the shipped session must queue a client, have a fatal GPU error that puts its server in FAULT "
            f"and a client with a priority; found {found}")
        return Moments(queued[len(queued) // 2], found["fault"], found["fatal"], found["priority"], bundle.duration)
