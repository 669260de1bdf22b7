"""`status --watch` in a real terminal: tmux runs it, capture-pane reads the screen,
send-keys types. Every wait polls the screen against a generous deadline."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List

from mps_exporter.replay import shipped_bundle

from tests.support.shipped import moments
from tests.support.tools import require

DEADLINE = 60.0


class Terminal:
    def __init__(self, tmp: Path, command: str, width: int = 160, height: int = 60) -> None:
        self.tmux = require("tmux")
        self.socket = str(tmp / "tmux.sock")  # a tmux server of our own, without any user's config
        self.run("-f", "/dev/null", "new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height), command)

    def run(self, *args: str) -> str:
        res = subprocess.run([self.tmux, "-S", self.socket, *args], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "t")

    def wait_for(self, what: str, check: Callable[[str], bool]) -> str:
        deadline = time.monotonic() + DEADLINE
        while True:
            screen = self.screen()
            if check(screen):
                return screen
            assert time.monotonic() < deadline, f"no {what} on the screen:\n{screen}"
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run([self.tmux, "-S", self.socket, "kill-server"], capture_output=True, timeout=30)


def position(screen: str) -> float:
    m = re.search(r"at ([\d.]+) s of [\d.]+ s", screen)
    assert m, screen
    return float(m.group(1))


def lines(screen: str) -> List[str]:
    return screen.rstrip("\n").split("\n")


def test_watch_refreshes_in_place_scrolls_and_quits(tmp_path):
    # The shipped session in real time from a little before a client is queued.
    start = max(0.0, moments().queued - 3)
    cmd = (f"{sys.executable} -m mps_exporter.cli status --bundle {shipped_bundle()} --at {start} --watch 0.5;"
           " echo status-exited-$?; sleep 600")
    term = Terminal(tmp_path, cmd)
    try:
        first = term.wait_for("report", lambda s: "mps-exporter status:" in s)
        assert lines(first)[0].startswith(f"mps-exporter status: bundle {Path(shipped_bundle()).name} at ")
        queued = term.wait_for("queued client", lambda s: re.search(r"^  QUEUED +UID +REASON +WAITING +SINCE\n  \d+ +\d+ +user_switch ",
                                                                    s, re.M) is not None)
        later = term.wait_for("refresh", lambda s: position(s) >= position(queued) + 1)
        for screen in (first, queued, later):  # redrawn in place: one report on the screen, at its top
            assert screen.count("mps-exporter status:") == 1 and lines(screen)[0].startswith("mps-exporter status:")
            assert re.search(r"^ every 0\.5 s \| updated \d\d:\d\d:\d\d \| q quits", screen, re.M), screen

        # A terminal smaller than the report: the footer says which lines show; the arrows scroll.
        term.run("resize-window", "-t", "t", "-y", "12")
        small = term.wait_for("scroll hint", lambda s: re.search(r"lines 1-11 of \d+, arrows scroll", s) is not None)
        assert lines(small)[0].startswith("mps-exporter status:")
        term.run("send-keys", "-t", "t", "Down")
        scrolled = term.wait_for("scrolled report", lambda s: re.search(r"lines 2-12 of \d+", s) is not None)
        assert not lines(scrolled)[0].startswith("mps-exporter status:")

        term.run("send-keys", "-t", "t", "q")
        after = term.wait_for("exit", lambda s: "status-exited-0" in s)
        assert "mps-exporter status:" not in after  # curses gave the terminal back as it found it
    finally:
        term.close()
