"""`status --watch`: the report redrawn in place every few seconds, as `watch` or `top` do.

curses owns the terminal (the alternate screen, restored on exit, whatever the exit).
q, Esc or Ctrl-C quits; the arrows, j/k, PgUp/PgDn, Home/End scroll a report taller
than the terminal; a resize redraws at once.
"""

from __future__ import annotations

import curses
import os
import time
from typing import Any, Callable, Dict, List

from . import text, view

POLL_MS = 100  # how often keys and resizes are looked at between refreshes
_QUIT = {ord("q"), ord("Q"), 27}


def watch(collect: Callable[[], view.NodeStatus], interval: float) -> int:
    # The terminal's size from the terminal: curses prefers LINES/COLUMNS, which a shell
    # may have exported at another size, and stale ones would outlive every resize.
    for name in ("LINES", "COLUMNS"):
        os.environ.pop(name, None)
    try:
        result: int = curses.wrapper(_run, collect, interval)
        return result
    except KeyboardInterrupt:
        return 0


def _styles() -> Dict[str, int]:
    alert = curses.A_REVERSE
    if curses.has_colors():
        try:
            curses.start_color()
            curses.use_default_colors()
            curses.init_pair(1, curses.COLOR_RED, -1)
            alert = curses.color_pair(1) | curses.A_BOLD
        except curses.error:  # a terminal without default colours: reverse video it is
            pass
    return {text.TITLE: curses.A_BOLD, text.HEADING: curses.A_BOLD, text.ALERT: alert, text.PLAIN: curses.A_NORMAL}


def _run(screen: Any, collect: Callable[[], view.NodeStatus], interval: float) -> int:
    try:
        curses.curs_set(0)
    except curses.error:  # terminals that cannot hide the cursor
        pass
    styles = _styles()
    screen.timeout(POLL_MS)
    lines: List[text.Line] = []
    top, due, updated, dirty = 0, 0.0, "", True
    while True:
        now = time.monotonic()
        if now >= due:
            lines = text.report(collect())
            due, updated, dirty = now + interval, time.strftime("%H:%M:%S"), True
        height, width = screen.getmaxyx()
        body = max(1, height - 1)
        top = max(0, min(top, len(lines) - body))
        if dirty:
            footer = f" every {interval:g} s | updated {updated} | q quits"
            if len(lines) > body:
                footer += f" | lines {top + 1}-{min(top + body, len(lines))} of {len(lines)}, arrows scroll"
            _draw(screen, lines[top:top + body], footer, styles, height, width)
            dirty = False
        key = screen.getch()
        if key in _QUIT:
            return 0
        moves = {curses.KEY_DOWN: 1, ord("j"): 1, curses.KEY_UP: -1, ord("k"): -1,
                 curses.KEY_NPAGE: body, ord(" "): body, curses.KEY_PPAGE: -body,
                 curses.KEY_HOME: -len(lines), curses.KEY_END: len(lines)}
        if key in moves:
            top, dirty = top + moves[key], True
        elif key == curses.KEY_RESIZE:
            dirty = True


def _draw(screen: Any, lines: List[text.Line], footer: str, styles: Dict[str, int], height: int, width: int) -> None:
    screen.erase()
    for row, (line, style) in enumerate(lines):
        _put(screen, row, line, styles.get(style, curses.A_NORMAL), width)
    _put(screen, height - 1, footer.ljust(width), curses.A_REVERSE, width)
    screen.refresh()


def _put(screen: Any, row: int, line: str, attr: int, width: int) -> None:
    try:
        screen.addnstr(row, 0, line, max(0, width - 1), attr)
    except curses.error:  # a terminal shrunk under us: the next redraw fits it
        pass
