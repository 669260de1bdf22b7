"""control.log's command echoes, recognised and counted without the parser.

MPS writes every control command into control.log, framed by `Accepting
connection...`, `NEW UI` and `UI closed`, with the command's answer between (a `ps`
row per client, PIDs, percentages, a status, `Server N not found`), and refused
connections (`User did not send valid credentials`) follow `Accepting connection...`.
On a monitored node they are most of the file (bench/steady_log.py: 95 % of a busy
node's lines), and none of them changes the state but "in a command or not" and the
counts. So the batch's lines are joined
and runs of echoes matched in one regex call each (the daemon's header, then an
answer's line or a framing line; as many commands, each framed, as follow each other, the
verbs of their `Cmd:` lines counted over the run's text); they are counted, their newest
time kept, and never parsed into events. Every other line (`Cmd:` lines, whose verbs are counted, and
everything that happens) goes through `parse_line` and `LogState.apply` as before, but
for one: while nobody is queued, a client's context admitted (`NEW CLIENT P from user U:
Server already exists`, the commonest line that is no echo on a busy node) changes
nothing but a count, and the runs take it too (issue 44: control.log's lines through the
parser in the 1 M-line catch-up, 118k -> 69k); and outside commands, a server's shutdown
deferred (`Server S has N active worker threads. Server will not shutdown.`, only counted)
and the daemon's `Control will try shutting down server S again ...` (Noise) are counted
in runs too (69k -> 57k).

The same counts and state as parsing each line (tests/logs/test_echoes.py), except on
malformed lines: a line of a command's answer that starts with a digit but fits no
output shape, and an echo whose date does not exist (month 13), count as echoes instead
of unrecognized lines; and the time of a batch's echoes (admitted contexts taken in runs
included) is that of its last echo (their newest, unless the clock stepped back within
the batch).
"""

from __future__ import annotations

import re
from typing import Callable, List, Sequence, Tuple, cast

from .events import ParseResult
from .state import LogState

# The daemon's own lines, as driver 580 writes them: a narrower header than the parser's
# (HEADER_PATTERN), so that every line it matches the parser would take apart the same way,
# and cheaper to match (no backtracking over the role). Any other line is parsed.
_HEAD = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} Control +\d{1,10}\] "
_END = r"[^\S\n]*\n"  # what the parser strips from a message's end, then the line's end
# A line of a command's answer: a PID, a `ps` row, a percentage (they start with a digit),
# a server's status, the `ps` heading, driver 580's "no limit" sentence, a server not
# found, an unknown command (parse_line: CommandOutput, which changes nothing). None with a
# `]` in it (parsed, as the rest): in a run, a `]` ends a header (_VERBS_IN, _accepted).
_ANSWER = (r"\d[^\]\n]*\n|(?:ACTIVE|INITIALIZING|FAULT)" + _END
           + r"|PID[^\S\n]+ID[^\S\n]+SERVER\b[^\]\n]*\n|No default pinned memory limit set for the device!" + _END
           + r"|Server (?:-?\d+ )?not found" + _END + r'|Unknown command "[^\]\n]*\n')
# A framing line, and a refused connection (`User did not send valid credentials`: a client
# that could not say who it is; a Noise line that ends no command), taken after framing lines.
_FRAMING = r"(?:Accepting connection\.\.\.|NEW UI|UI closed)" + _END
_REFUSED = "User did not send valid credentials" + _END
# The daemon waiting on a server it would shut down (ShutdownDeferred, only counted), and
# when it tries again (Noise): taken outside commands, like refused connections; the first
# counted over the run's text by the start of its message (_DEFERRALS_IN).
_DEFERRED = r"Server \d{1,10} has \d{1,10} active worker threads?\. Server will not shutdown\.?" + _END
_RETRY = r"Control will try shutting down server [^\]\n]*\n"
_DEFERRED_TEXT = " active worker thread"
_DEFERRALS_IN = cast(Callable[[str, int, int], List[str]], re.compile(r"\] Server \d{1,10} has ").findall)
# A read-only command (what monitoring sends; `set_*` and the rest are parsed).
_READ_COMMAND = r"Cmd:(?:get_[a-z_]{1,40}|ps)(?: \d{1,10}){0,2}" + _END
# A client's context admitted (`NEW CLIENT P from user U: Server already exists`, parse_line:
# ClientAccepted): while nobody is queued it changes nothing but control_changes, so then the
# runs take it too, anywhere (it neither starts nor ends a command), and count it.
_ACCEPTED = r"NEW CLIENT -?\d{1,10} from user \d{1,10}: Server already exists[^\]\n]*\n"
_Run = Callable[[str, int], "re.Match[str]"]
# In a run every line is _HEAD (one `]`, its last character but the space after it) and a
# message without `]`: each `] Cmd:` in it starts a read-only command's message (group 1:
# its verb), each `] NEW CLIENT ` an admitted context's.
_VERBS_IN = cast(Callable[[str, int, int], List[str]], re.compile(r"\] Cmd:([a-z_]+)").findall)
_ACCEPTED_IN = "] NEW CLIENT "


def _runs(among: str) -> Tuple[_Run, _Run]:
    """Runs of echoes, as many commands as follow each other, matched over the batch's text in
    one call each (the header matched once a line, each alternative a message), `among` (`|`
    and a message, or nothing) taken anywhere in them. Outside a command: framing lines,
    refused connections, and read-only commands each with its answer, closed by a framing
    line, but the last (group `open`: the run ends inside it); a server's shutdown deferred
    and retried. Inside a command: the rest of
    its answer, then, where a framing line closes it (group `closed`), a run as outside."""
    answer = f"{_HEAD}(?:{_ANSWER}{among})"
    command = f"{_HEAD}{_READ_COMMAND}(?:{answer})*"
    framing = f"{_HEAD}{_FRAMING}"
    outside = (f"(?:{_HEAD}(?:{_FRAMING}|{_REFUSED}|{_DEFERRED}|{_RETRY}{among})|{command}(?={framing}))*"
               f"(?P<open>{command})?")
    return (cast(_Run, re.compile(f"(?:{answer})*(?:(?={framing})(?P<closed>){outside})?").match),
            cast(_Run, re.compile(outside).match))


_RUN_IN_COMMAND, _RUN_OUTSIDE = _runs("")
_QUIET_RUN_IN_COMMAND, _QUIET_RUN_OUTSIDE = _runs("|" + _ACCEPTED)


def apply_control(state: LogState, lines: Sequence[str], parse: Callable[[str], ParseResult],
                  on_error: Callable[[str], None]) -> None:
    """Apply control.log lines in order: echoes counted, the rest parsed and applied.
    `on_error(line)`: applying that line raised (a bug; the line still counts)."""
    text = "\n".join(lines) + "\n"
    count, find = text.count, text.find
    in_command = state.in_command
    pos = i = echoes = 0
    newest = -1  # index of the last echo
    quiet = not state.queued()
    n = len(lines)
    while i < n:
        # Every pattern can match nothing, so none returns None.
        if in_command:
            m = (_QUIET_RUN_IN_COMMAND if quiet else _RUN_IN_COMMAND)(text, pos)
            if m.start("closed") >= 0:  # the command's block ended: the run went on outside
                in_command = m.start("open") >= 0
        else:
            m = (_QUIET_RUN_OUTSIDE if quiet else _RUN_OUTSIDE)(text, pos)
            in_command = m.start("open") >= 0
        end = m.end()
        if end > pos:
            if find("] Cmd:", pos, end) >= 0:
                state.count_commands(_VERBS_IN(text, pos, end))
            if find(_DEFERRED_TEXT, pos, end) >= 0:
                state.count_shutdown_deferrals(len(_DEFERRALS_IN(text, pos, end)))
            if quiet:
                accepted = count(_ACCEPTED_IN, pos, end)
                if accepted:
                    state.count_accepted(accepted)
            run = count("\n", pos, end)
            i, pos, echoes = i + run, end, echoes + run
            newest = i - 1
            state.set_in_command(in_command)
            if i == n:
                break
        line = lines[i]  # no echo here: the parser's
        try:
            state.apply(parse(line), "control")
        except Exception:  # a bug costs this line's meaning, never the batch or the count
            on_error(line)
        in_command = state.in_command
        quiet = not state.queued()
        pos += len(line) + 1
        i += 1
    if echoes:
        state.count_echoes(echoes, parse(lines[newest])[0])
