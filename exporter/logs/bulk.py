"""server.log's backlog applied in bulk (issue 44: catch-up of a long log).

The lines of a batch are taken apart by one findall over their text (parser.scan_server),
and the commonest lines are applied without an event each: the verbs that are Noise
(a client's request, a context's exit) and every message the parser makes Noise, only
counted, their time kept; a client's connection, ACTIVE and disconnection built as
events straight from the row and handed to their handler. What apply() does before a
handler (the line counted, its time kept and checked against the clock, the exits
decided that it comes after, a fatal error report closed) is done here in line: the
same state as parse_line + LogState.apply line by line (tests/logs/test_bulk.py).
Any other line goes through LogState.apply as before.
"""

from __future__ import annotations

from datetime import tzinfo
from typing import Callable, Optional, Sequence

from .events import ClientContextActive, ClientContextConnected, ClientProcessDisconnected
from .parser import parse_line, scan_server, second_epoch, server_row_event
from .state import LogState

FILE = "server"
# A header's milliseconds (three ASCII digits: parser._SCAN_HEADER) as parse_line adds them.
_MILLIS = {f"{k:03d}": int(f"{k:03d}") * 0.001 for k in range(1000)}
# The events handed to their handler here; any other goes through apply.
_SHORT = frozenset((ClientContextConnected, ClientContextActive, ClientProcessDisconnected))


def apply_server(state: LogState, lines: Sequence[str], tz: Optional[tzinfo],
                 on_error: Callable[[str], None]) -> None:
    """Apply server.log lines in order. `on_error(line)`: applying that line raised (a bug;
    the line still counts)."""
    apply = state.apply
    rows = scan_server(lines)
    if rows is None:
        for line in lines:
            try:
                apply(parse_line(line, FILE, tz), FILE)
            except Exception:
                on_error(line)
        return
    s = state.s
    counted = s.lines
    last_ts = state._last_ts
    pending = state._pending_exits
    reports = state._open_reports
    handlers = state._handlers
    believed = state._believed_until
    last = last_ts.get(FILE, 0.0)
    last_second: Optional[str] = None
    epoch: Optional[float] = None
    n = 0  # lines counted here
    i = -1
    try:
        for second, millis, pid, connected, active, disconnected, request, context_exit, msg, _ in rows:
            i += 1
            if second and second != last_second:
                epoch, last_second = _epoch(second, tz), second
            event = None
            if second and epoch is not None:
                ts = epoch + _MILLIS[millis]
                if not (request or context_exit):  # else a Noise verb: nothing to build
                    event = server_row_event(ts, pid, connected, active, disconnected, msg)
                if ts <= believed and (event is None or type(event) in _SHORT):
                    n += 1
                    if ts > last:
                        last = last_ts[FILE] = ts
                    if pending and ts > pending[0][0]:
                        state._decide_exits(before=ts)
                    if reports:
                        reports.pop(int(pid), None)
                    if event is None:
                        continue
                    try:
                        handlers[type(event)](event)
                    except Exception:  # a bug costs this line's meaning, never the batch or the count
                        on_error(lines[i])
                    if type(event) is not ClientContextActive:  # both change what the daemon lists
                        s.control_changes += 1
                    continue
            try:  # anything else, as line by line
                apply(event if event is not None else parse_line(lines[i], FILE, tz), FILE)
            except Exception:
                on_error(lines[i])
            believed = state._believed_until
            last = last_ts.get(FILE, 0.0)
    finally:
        counted[FILE] = counted.get(FILE, 0) + n


def _epoch(second: str, tz: Optional[tzinfo]) -> Optional[float]:
    """parser.second_epoch, None where parse_line finds a bad header."""
    try:
        return second_epoch(second, tz)
    except (ValueError, OverflowError, OSError):
        return None
