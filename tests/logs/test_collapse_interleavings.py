"""Copy-and-collapse rotation interleaved with the follower at the level of single
system calls, as test_rotation_interleavings.py does for renames: logrotate's `copy`
(the log read in pieces until EOF while the writer appends), older copies renamed,
then the copied whole blocks removed from the log's front in one step (the collapse is
atomic). Whatever the order, every line is read once. Seeded: a failure names its seed."""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Iterator, List

import pytest

from mps_exporter.logs.follower import FileFollower
from tests.logs.test_rotation_interleavings import ROTATED, World, inject_births, interleave


class CollapseWorld(World):
    def _logrotate(self) -> Iterator[None]:
        numbers = [int(m.group(1)) for m in map(ROTATED.match, os.listdir(self.directory)) if m]
        for n in sorted(numbers, reverse=True):
            os.rename(f"{self.path}.{n}", f"{self.path}.{n + 1}")
            yield
        src = os.open(self.path, os.O_RDONLY)
        dst = os.open(self.path + ".1", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.births[os.fstat(dst).st_ino] = self.clock
        try:
            while True:  # logrotate copies until read() returns 0: appends meanwhile are copied too
                chunk = os.read(src, self.rng.choice([50, 400, 5000]))
                if not chunk:
                    break
                os.write(dst, chunk)
                self._touch(dst)  # the world's clock: rotated files are ordered by mtime
                yield
        finally:
            os.close(src)
            os.close(dst)
        yield
        c = os.stat(self.path + ".1").st_size
        bs = os.statvfs(self.directory).f_frsize
        n = c - c % bs
        size = os.stat(self.path).st_size
        if 0 < n < size:  # what mps-log-collapse does, in one step (fallocate is atomic)
            with open(self.path, "r+b") as fh:
                data = fh.read()
                fh.seek(0)
                fh.write(data[n:])
                fh.truncate(len(data) - n)

    def step(self) -> None:
        super().step()
        if self.written % 7 == 0:  # longer lines now and then: copies of several blocks
            # Not a run of one byte nor periodic: after a collapse the log starts mid-line,
            # and the follower's fingerprints (64 bytes) must not fall in such a run
            # (docs/logs.md: the fingerprints' limit).
            os.write(self.fd, f"NEW UI {self.written} {self.rng.getrandbits(1200):0300x}\n".encode())
            self.written += 1


def follow(tmp_path, monkeypatch, seed: int, chance: float) -> Counter:
    rng = random.Random(seed)
    world = CollapseWorld(str(tmp_path), rng, 1)
    inject_births(world, monkeypatch)
    f = FileFollower(world.path)
    seen: List[int] = []

    def poll_all() -> None:
        while True:
            lines, _ = f.poll()
            for line in lines:
                assert line.startswith("NEW UI "), f"seed {seed}: a broken line {line[:60]!r} after {seen[-3:]}"
                seen.append(int(line.split(" ")[2]))
            if not lines and not f.more:
                return

    interleave(world, rng, chance, monkeypatch, poll_all)
    counts = Counter(seen)
    assert set(counts) == set(range(world.written)), f"seed {seed}: lines lost {sorted(set(range(world.written)) - set(counts))[:10]}"
    assert f.rotation_gaps == 0, f"seed {seed}"
    return counts


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chance", [0.3, 0.6])
def test_every_line_read_once_whatever_the_order(tmp_path, monkeypatch, seed, chance):
    counts = follow(tmp_path, monkeypatch, seed, chance)
    assert max(counts.values()) == 1, f"seed {seed}: lines read twice {[n for n, c in counts.items() if c > 1][:10]}"
