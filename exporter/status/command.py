"""`mps-exporter status`: one collection of this node (or of a capture bundle) as a report.

The collection is the exporter's own: the same sources, collector and log pipelines
as `serve`, and the view is read off the same rendered families (view.py). Like
the exporter it only reads: the control daemon gets the same read-only commands,
and the log pipelines run without the state file (a running exporter's is left alone).

- live: the sources from the flags, waited for as long as a scrape waits (5 s); the MPS
  logs read from their beginning, as `dump` does;
- `--bundle FILE [--at SECONDS]`: the replay machinery at that moment of the recording
  (its log chunks up to then, each source's last reading before then);
- `--watch [SECONDS]`: the same collection again every SECONDS, in place (watch.py);
  on a bundle the recording plays on in real time from `--at`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import tempfile
import time
from typing import Callable, Iterator, Optional, TextIO

from ..bundle import BundleError, load
from ..config import Config
from ..exitstatus import ExitWatcher
from ..replay import Player, replay_config
from ..sources.base import Backends
from ..wiring import build_collector, build_readers, with_daemon_set
from . import text, view
from .watch import watch


@contextlib.contextmanager
def _live(cfg: Config, backends: Optional[Backends]) -> Iterator[Callable[[], view.NodeStatus]]:
    backends = with_daemon_set(cfg, backends or Backends())
    readers = build_readers(dataclasses.replace(cfg, state_file=None), backends)
    # Watching, the collections see clients leave: ask the kernel how they ended, as serve does.
    watcher = ExitWatcher() if cfg.exit_status and cfg.status.watch is not None else None
    if watcher is not None:
        watcher.start()
    collector = build_collector(cfg, readers, statuses=watcher)
    origin = f"host {socket.gethostname()}"

    def collect() -> view.NodeStatus:
        for reader in readers.values():
            reader.catch_up()  # the logs: from the files' beginning, then what they grew by
        # As long as a scrape would wait: a hung source shows as failed, the rest still prints.
        # Every daemon watched now, the discovered ones included, is listed.
        return view.build(collector.snapshot(collector.budget(None)), origin,
                          [d.name for d in backends.daemon_set.current()])

    try:
        yield collect
    finally:
        if watcher is not None:
            watcher.close()
        for reader in readers.values():
            reader.close()


@contextlib.contextmanager
def _recorded(cfg: Config) -> Iterator[Callable[[], view.NodeStatus]]:
    opts = cfg.status
    bundle = load(opts.bundle or "")
    watching = opts.watch is not None
    start = opts.at if opts.at is not None else (0.0 if watching else bundle.duration)
    start = min(start, bundle.duration)  # past the end the last moment stays, its clock too
    name = os.path.basename(bundle.path)
    with tempfile.TemporaryDirectory(prefix="mps-exporter-status-") as root:
        # One moment, or (watching) the recording playing on from there in real time.
        player = Player(bundle, root, monotonic=time.monotonic if watching else lambda: 0.0, start_at=start)
        play_cfg = replay_config(cfg, bundle, player.log_dirs)
        # As replay serves it: the recorded sources answer from the bundle, the logs follow the fed files.
        readers = player.readers_with(build_readers(play_cfg, recorded=False))
        collector = build_collector(play_cfg, readers, clock=player.clock)

        def collect() -> view.NodeStatus:
            player.feed()
            for reader in readers.values():
                reader.catch_up()
            snap = collector.snapshot()
            _, t = player.position()
            return view.build(snap, f"bundle {name} at {min(t, bundle.duration):.1f} s of {bundle.duration:.1f} s",
                              [d.name for d in play_cfg.daemons])

        try:
            yield collect
        finally:
            for reader in readers.values():
                reader.close()


def to_json(st: view.NodeStatus) -> str:
    return json.dumps(dataclasses.asdict(st), indent=2, sort_keys=True) + "\n"


def status(cfg: Config, out: TextIO = sys.stdout, backends: Optional[Backends] = None) -> int:
    """The `status` command: 0; 1 when a source failed (the report says what it could not
    tell: unknown); 2 with one line for a bundle that cannot be read.
    `backends`: the library boundaries of the live sources (tests pass fakes)."""
    opts = cfg.status
    # The report shows failing sources itself; log lines would only repeat them (and,
    # while curses owns the terminal, tear the screen).
    before = logging.root.manager.disable
    if opts.watch is not None:
        logging.disable(logging.CRITICAL)
    elif cfg.log_level != "debug":
        logging.disable(logging.WARNING)
    try:
        with (_recorded(cfg) if opts.bundle is not None else _live(cfg, backends)) as collect:
            if opts.watch is not None:
                return watch(collect, opts.watch)
            st = collect()
            out.write(to_json(st) if opts.output == "json" else text.plain(text.report(st)))
            return 1 if view.failed_sources(st) else 0
    except BundleError as e:
        sys.stderr.write(f"mps-exporter: error: {e}\n")
        return 2
    finally:
        logging.disable(before)
