"""server.log's backlog applied in bulk (issue 44: catch-up of a long log).

The lines of a batch are taken apart by one findall over their text (parser.scan_server_text;
the follower hands the batch over as one text: FileFollower.poll_text),
and the commonest lines are applied without an event each: the verbs that are Noise
(a client's request, a context's exit) and every message the parser makes Noise, only
counted, their time kept; a client's connection, ACTIVE and disconnection handed
straight from the row to their handler's method (LogState.context_connected, ...), no
event built. What apply() does before a
handler (the line counted, its time kept and checked against the clock, the exits
decided that it comes after, a fatal error report closed) is done here in line: the
same state as parse_line + LogState.apply line by line (tests/logs/test_bulk.py).
Any other line goes through LogState.apply as before.
"""

from __future__ import annotations

from datetime import tzinfo
from typing import Callable, List, Optional, Sequence

from . import parser
from .parser import BAD_HEADER, parse_line, scan_server_text, second_epoch, server_row_event, server_row_noise
from .state import LogState

FILE = "server"
# A header's milliseconds (three ASCII digits: parser._SCAN_HEADER) as parse_line adds them.
_MILLIS = {f"{k:03d}": int(f"{k:03d}") * 0.001 for k in range(1000)}
_NEVER = float("inf")


def apply_server(state: LogState, lines: Sequence[str], tz: Optional[tzinfo],
                 on_error: Callable[[str], None]) -> None:
    """Apply server.log lines in order. `on_error(line)`: applying that line raised (a bug;
    the line still counts)."""
    if not lines:
        return
    text = "\n".join(lines) + "\n"
    if text.count("\n") != len(lines):  # a line holds a newline (never from the follower)
        _line_by_line(state, lines, tz, on_error)
        return
    apply_server_text(state, text, tz, on_error)


def apply_server_text(state: LogState, text: str, tz: Optional[tzinfo],
                      on_error: Callable[[str], None]) -> int:
    """apply_server of the lines of `text`, each ended by a newline (FileFollower.poll_text):
    no string is made for a line but where it is parsed whole (no header) or raised. How
    many lines it held."""
    apply = state.apply
    rows = scan_server_text(text)
    s = state.s
    last_ts = state._last_ts
    pending = state._pending_exits
    reports = state._open_reports
    decide = state._decide_exits
    connect, activate, disconnect = state.context_connected, state.context_active, state.process_disconnected
    quiet = parser._QUIET  # messages that are Noise (server_row_event's cache)
    believed = state._believed_until
    last = last_ts.get(FILE, 0.0)
    due = pending[0][0] if pending else _NEVER  # the first exit not decided yet: lines after it decide it
    last_second: Optional[str] = None
    epoch: Optional[float] = None
    lines: List[List[str]] = []  # the text split, where a line must be named (on_error)
    applied = 0  # lines through apply (it counts them); the others are counted at the end
    i = -1
    try:
        for i, (second, millis, pid, connected, active, disconnected, request, context_exit, msg, whole) in enumerate(rows):
            if second != last_second:
                epoch, last_second = (_epoch(second, tz) if second else None), second
            event = None
            if epoch is not None:  # a header (with one, second is never empty)
                ts = epoch + _MILLIS[millis]
                if connected or active or disconnected:  # a client's connection, ACTIVE or disconnection
                    if ts <= believed:
                        if ts > last:
                            last = last_ts[FILE] = ts
                        if ts > due:
                            decide(before=ts)
                            due = pending[0][0] if pending else _NEVER
                        p = int(pid)
                        if reports:
                            reports.pop(p, None)
                        try:
                            if connected:
                                connect(ts, p, int(connected))
                            elif active:
                                activate(ts, p, int(active))
                            else:
                                disconnect(ts, p, int(disconnected))
                        except Exception:  # a bug costs this line's meaning, never the batch or the count
                            on_error(_line(text, lines, i))
                        if not active:  # both change what the daemon lists
                            s.control_changes += 1
                        continue
                    event = server_row_event(ts, pid, connected, active, disconnected, msg)
                elif request or context_exit or msg in quiet or (
                        (event := server_row_event(ts, pid, connected, active, disconnected, msg)) is None):
                    if ts <= believed:  # Noise: counted, its time kept
                        if ts > last:
                            last = last_ts[FILE] = ts
                        if ts > due:
                            decide(before=ts)
                            due = pending[0][0] if pending else _NEVER
                        if reports:
                            reports.pop(int(pid), None)
                        continue
                    event = server_row_noise(ts, pid, request, context_exit, msg)  # past the clock
            applied += 1
            try:  # anything else, as line by line
                apply(event if event is not None else BAD_HEADER if second else parse_line(whole, FILE, tz), FILE)
            except Exception:
                on_error(_line(text, lines, i))
            believed = state._believed_until
            last = last_ts.get(FILE, 0.0)
            due = pending[0][0] if pending else _NEVER
    finally:
        counted = s.lines
        counted[FILE] = counted.get(FILE, 0) + i + 1 - applied
    return len(rows)


def _line(text: str, lines: List[List[str]], i: int) -> str:
    """The i-th line of text (split once, and only where asked)."""
    if not lines:
        lines.append(text.split("\n"))
    return lines[0][i]


def _line_by_line(state: LogState, lines: Sequence[str], tz: Optional[tzinfo],
                  on_error: Callable[[str], None]) -> None:
    for line in lines:
        try:
            state.apply(parse_line(line, FILE, tz), FILE)
        except Exception:
            on_error(line)


def _epoch(second: str, tz: Optional[tzinfo]) -> Optional[float]:
    """parser.second_epoch, None where parse_line finds a bad header."""
    try:
        return second_epoch(second, tz)
    except (ValueError, OverflowError, OSError):
        return None
