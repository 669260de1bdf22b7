"""Rename rotation interleaved with the follower at the level of single system calls.

A scripted world (a writer that keeps its descriptor until told to reopen, and
logrotate's rename rotation done one rename or create at a time, as strace shows it)
advances at random points inside the follower's own calls (stat, open, fstat, pread,
scandir), so every order of "name renamed / new file created / line written / follower
looks" comes up. Whatever the order, every line is read once. Seeded: a failure names
its seed."""

from __future__ import annotations

import os
import random
import re
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest

from mps_exporter.logs import birth as birth_module
from mps_exporter.logs import follower as follower_module
from mps_exporter.logs.follower import FileFollower

ROTATED = re.compile(r"control\.log\.(\d+)$")


class World:
    def __init__(self, directory: str, rng: random.Random, mtime_tick_ns: int, split: bool = False) -> None:
        self.split = split  # write each line in two write() calls, steps apart (stdio flushing a full buffer)
        self.pending = b""  # the rest of a split line, not written yet
        self.directory, self.rng, self.tick = directory, rng, mtime_tick_ns
        self.path = os.path.join(directory, "control.log")
        self.clock = 10**18  # mtimes and birth times set by hand: the follower orders rotated files by them
        self.births: Dict[int, int] = {}  # inode -> birth time (statx's stx_btime), by this clock
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.births[os.fstat(self.fd).st_ino] = self.clock
        self._touch(self.fd)
        self.written = 0
        self.rotation: Optional[Iterator[None]] = None
        self.reopen = False  # the writer's signal to reopen its log
        self.writing = True
        self.steps = 0

    def _touch(self, fd: int) -> None:
        now = self.clock - self.clock % self.tick  # a coarse file system clock: equal mtimes happen
        os.utime(fd, ns=(now, now))

    def _logrotate(self) -> Iterator[None]:
        """`rotate N` + `create`: .N -> .N+1 from the oldest, the log -> .1, a new log."""
        numbers = [int(m.group(1)) for m in map(ROTATED.match, os.listdir(self.directory)) if m]
        for n in sorted(numbers, reverse=True):
            os.rename(f"{self.path}.{n}", f"{self.path}.{n + 1}")
            yield
        os.rename(self.path, self.path + ".1")
        yield
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.births[os.fstat(fd).st_ino] = self.clock
        self._touch(fd)
        os.close(fd)
        self.reopen = True

    def step(self) -> None:
        self.steps += 1
        self.clock += self.rng.choice([1, 100, 1000, 10000]) * 1000
        r = self.rng.random()
        if self.rotation is not None and r < 0.5:
            if next(self.rotation, StopIteration) is StopIteration:
                self.rotation = None
        elif self.reopen and self.rotation is None and r < 0.7:
            self._write(self.pending)  # fclose flushes the line into the old file
            self.pending = b""
            os.close(self.fd)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            self.reopen = False
        elif self.rotation is None and r > 0.93 and self.writing:
            self.rotation = self._logrotate()
        elif self.writing and self.pending:
            self._write(self.pending)
            self.pending = b""
        elif self.writing:
            line = f"NEW UI {self.written}\n".encode()
            cut = self.rng.randint(1, len(line) - 1) if self.split else len(line)
            self._write(line[:cut])
            self.pending = line[cut:]
            self.written += 1

    def _write(self, data: bytes) -> None:
        if data:
            os.write(self.fd, data)
            self._touch(self.fd)

    def settle(self) -> None:
        self.writing = False
        self._write(self.pending)
        self.pending = b""
        while self.rotation is not None or self.reopen:
            self.step()


class StepsInsideCalls:
    """`os` for the follower module: before each look at the files, the world may move."""

    def __init__(self, world: World, chance: float) -> None:
        self.world, self.chance = world, chance

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name not in ("stat", "lstat", "open", "fstat", "pread", "scandir"):
            return real

        def moved_first(*args: Any, **kwargs: Any) -> Any:
            while self.world.rng.random() < self.chance:
                self.world.step()
            return real(*args, **kwargs)
        return moved_first


def follow(tmp_path, monkeypatch, seed: int, chance: float, mtime_tick_ns: int, split: bool = False) -> Counter:
    rng = random.Random(seed)
    world = World(str(tmp_path), rng, mtime_tick_ns, split)
    inject_births(world, monkeypatch)
    f = FileFollower(world.path)
    seen: List[int] = []

    def poll_all() -> None:
        while True:
            lines, _ = f.poll()
            for line in lines:
                assert re.fullmatch(r"NEW UI \d+", line), f"seed {seed}: a cut line {line!r}"
                seen.append(int(line.rsplit(" ", 1)[1]))
            if not lines and not f.more:
                return

    interleave(world, rng, chance, monkeypatch, poll_all)
    counts = Counter(seen)
    assert set(counts) == set(range(world.written)), f"seed {seed}: lines lost"
    return counts


def inject_births(world: World, monkeypatch: Any) -> None:
    """The follower's birth times are the world's (a file system clock would tie them)."""
    def of_path(path: str) -> Optional[int]:
        try:
            return world.births.get(os.lstat(path).st_ino)
        except OSError:
            return None

    monkeypatch.setattr(birth_module, "path_birth_ns", of_path)
    monkeypatch.setattr(birth_module, "fd_birth_ns", lambda fd: world.births.get(os.fstat(fd).st_ino))


def interleave(world: World, rng: random.Random, chance: float, monkeypatch: Any, poll_all: Callable[[], None]) -> None:
    """The follower (read out by `poll_all`) opens the file first; then the world runs
    1,500 steps, in bursts between the polls and inside the follower's own system calls,
    and settles; a last poll reads what is left."""
    poll_all()
    monkeypatch.setattr(follower_module, "os", StepsInsideCalls(world, chance))
    try:
        while world.steps < 1500:
            for _ in range(rng.randint(0, 60)):
                world.step()
            poll_all()
        world.settle()
    finally:
        monkeypatch.setattr(follower_module, "os", os)
        os.close(world.fd)
    poll_all()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chance, mtime_tick_ns", [(0.3, 4_000_000), (0.6, 1), (0.3, 1_000_000_000)],
                         ids=["4ms-mtimes", "fine-mtimes", "1s-mtimes"])
def test_every_line_read_once_whatever_the_order(tmp_path, monkeypatch, seed, chance, mtime_tick_ns):
    counts = follow(tmp_path, monkeypatch, seed, chance, mtime_tick_ns)
    assert max(counts.values()) == 1, f"seed {seed}: lines read twice"


@pytest.mark.parametrize("seed", range(8))
def test_a_writer_that_splits_its_lines_never_has_them_cut(tmp_path, monkeypatch, seed):
    """Each line in two write() calls, steps apart, the second always into the file of the
    first (a writer finishes its line before it reopens): whatever the order, every line
    is handed out once and whole."""
    counts = follow(tmp_path, monkeypatch, seed, 0.3, 4_000_000, split=True)
    assert max(counts.values()) == 1, f"seed {seed}: lines read twice"
