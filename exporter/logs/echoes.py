"""control.log's command echoes, recognised and counted without the parser.

MPS writes every control command into control.log, framed by `Accepting
connection...`, `NEW UI` and `UI closed`, with the command's answer between (a `ps`
row per client, PIDs, percentages, a status, `Server N not found`), and refused
connections (`User did not send valid credentials`) follow `Accepting connection...`.
On a monitored node they are most of the file (bench/steady_log.py: 95 % of a busy
node's lines), and none of them changes the state but "in a command or not" and the
counts. So the batch's lines are joined
and runs of echoes matched in one regex call each (the daemon's header, then an
answer's line or a framing line); they are counted, their newest time kept, and never
parsed into events. Every other line (`Cmd:` lines, whose verbs are counted, and
everything that happens) goes through `parse_line` and `LogState.apply` as before.

The same counts and state as parsing each line (tests/logs/test_echoes.py), except on
malformed lines: a line of a command's answer that starts with a digit but fits no
output shape, and an echo whose date does not exist (month 13), count as echoes instead
of unrecognized lines; and the time of a batch's echoes is that of its last
echo (their newest, unless the clock stepped back within the batch).
"""

from __future__ import annotations

import re
from typing import Callable, Sequence, cast

from .events import ParseResult
from .state import LogState

# The daemon's own lines, as driver 580 writes them: a narrower header than the parser's
# (HEADER_PATTERN), so that every line it matches the parser would take apart the same way,
# and cheaper to match (no backtracking over the role). Any other line is parsed.
_HEAD = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} Control +\d{1,10}\] "
_END = r"[^\S\n]*\n"  # what the parser strips from a message's end, then the line's end
# A line of a command's answer: a PID, a `ps` row, a percentage (they start with a digit),
# a server's status, the `ps` heading, driver 580's "no limit" sentence, a server not
# found, an unknown command (parse_line: CommandOutput, which changes nothing).
_ANSWER = (_HEAD + r"(?:\d[^\n]*\n|(?:ACTIVE|INITIALIZING|FAULT)" + _END
           + r"|PID[^\S\n]+ID[^\S\n]+SERVER\b[^\n]*\n|No default pinned memory limit set for the device!" + _END
           + r"|Server (?:-?\d+ )?not found" + _END + r'|Unknown command "[^\n]*\n)')
# A framing line, then any refused connections (`User did not send valid credentials`: a
# client that could not say who it is; a Noise line that ends no command) after it.
_FRAMING = (_HEAD + r"(?:Accepting connection\.\.\.|NEW UI|UI closed)" + _END
            + f"(?:{_HEAD}User did not send valid credentials{_END})*")
# A read-only command (what monitoring sends; `set_*` and the rest are parsed): group 1 its verb.
_READ_COMMAND = _HEAD + r"Cmd:(get_[a-z_]{1,40}|ps)(?: \d{1,10}){0,2}" + _END
# Runs of echoes, matched over the batch's text in one call each. Inside a command: the
# rest of its answer, then framing lines (group 1). Outside: framing lines, then one
# read-only command (group 1: its verb) with its answer and the framing after it (group 2).
_Run = Callable[[str, int], "re.Match[str]"]
_RUN_IN_COMMAND = cast(_Run, re.compile(f"(?:{_ANSWER})*((?:{_FRAMING})*)").match)
_RUN_OUTSIDE = cast(_Run, re.compile(f"(?:{_FRAMING})*(?:{_READ_COMMAND}(?:{_ANSWER})*((?:{_FRAMING})*))?").match)


def apply_control(state: LogState, lines: Sequence[str], parse: Callable[[str], ParseResult],
                  on_error: Callable[[str], None]) -> None:
    """Apply control.log lines in order: echoes counted, the rest parsed and applied.
    `on_error(line)`: applying that line raised (a bug; the line still counts)."""
    text = "\n".join(lines) + "\n"
    count = text.count
    in_command = state.in_command
    pos = i = echoes = 0
    newest = -1  # index of the last echo
    n = len(lines)
    while i < n:
        # Both patterns can match nothing, so they never return None.
        if in_command:
            m = _RUN_IN_COMMAND(text, pos)
            framed = m.end(1) > m.start(1)
            if framed:  # the command's block ended
                in_command = False
                state.end_command()
        else:
            m = _RUN_OUTSIDE(text, pos)
            verb = m.group(1)
            framed = False
            if verb is not None:
                state.count_command(verb)
                framed = m.end(2) > m.start(2)
                in_command = not framed  # no framing after it: its answer goes on
                if framed:
                    state.end_command()
        end = m.end()
        if end > pos:
            run = count("\n", pos, end)
            i, pos, echoes = i + run, end, echoes + run
            newest = i - 1
            # A run stops at a line that is no echo, but after framing lines a read-only
            # command may start the next run; anywhere else the parser takes the line.
            if framed or i == n:
                continue
        line = lines[i]  # no echo here: the parser's
        try:
            state.apply(parse(line), "control")
        except Exception:  # a bug costs this line's meaning, never the batch or the count
            on_error(line)
        in_command = state.in_command
        pos += len(line) + 1
        i += 1
    if echoes:
        state.count_echoes(echoes, parse(lines[newest])[0])
