"""Small helpers the log tests share."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Dict, Iterable, List, Optional

from mps_exporter.logs.parser import parse_line
from mps_exporter.logs.state import LogState

UTC = timezone.utc


def at(text: str) -> float:
    """'04:22:16.630' (on the capture's day) or '2026-11-23 18:29:10.000', read as UTC -> unix time."""
    text = text if " " in text else "2026-11-21 " + text
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp()


def line_time(line: str) -> Optional[float]:
    try:
        return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def replay(files: Dict[str, Iterable[str]], until: Optional[str] = None, state: Optional[LogState] = None,
           settle: bool = True) -> LogState:
    """Feed control then server lines (UTC timestamps) into a state machine, stopping
    each file at the first line later than `until` ('HH:MM:SS.mmm'); then settle() as
    the pipeline does once server.log is read to its end."""
    state = state or LogState()
    limit = at(until) if until else None
    for file in ("control", "server"):
        for line in files.get(file, ()):
            t = line_time(line)
            if limit is not None and t is not None and t > limit:
                break
            state.apply(parse_line(line, file, UTC), file)
    if settle:
        state.settle()
    return state


def lines_of(text: str) -> List[str]:
    return [l for l in text.strip("\n").splitlines()]
