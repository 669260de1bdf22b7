"""control.log's command echoes, recognised and counted without the parser.

MPS writes every control command into control.log, framed by `Accepting
connection...`, `NEW UI` and `UI closed`, with the command's answer between (a `ps`
row per client, PIDs, percentages, a status, `Server N not found`), and refused
connections (`User did not send valid credentials`) follow `Accepting connection...`.
On a monitored node they are most of the file (bench/steady_log.py: 95 % of a busy
node's lines), and none of them changes the state but "in a command or not" and the
counts. So runs of echoes are matched in the batch's text (FileFollower.poll_text), in
one regex call each (the daemon's header, then an answer's line or a framing line); they
are counted, their newest time kept, and never parsed into events; nor are the `Cmd:`
lines that change nothing but the counts (every command but the two that set a running
server's limit), whose verbs are counted, nor the daemon's attempts to shut a server down
that repeat the one just applied (_attempts). Every other line (those two commands, and
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
from typing import Callable, Dict, Optional, Sequence, Tuple, cast

from .events import ParseResult, ShutdownAttempt
from .state import LogState

# The daemon's own lines, as driver 580 writes them: a narrower header than the parser's
# (HEADER_PATTERN), so that every line it matches the parser would take apart the same way,
# and cheaper to match (no backtracking over the role, ASCII digits). Any other line is parsed.
_HEAD = r"\[[0-9]{4}-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]\.[0-9]{3} Control +[0-9]{1,10}\] "
_END = r"[^\S\n]*\n"  # what the parser strips from a message's end, then the line's end
# A line of a command's answer: a PID, a `ps` row, a percentage (they start with a digit),
# a server's status, the `ps` heading, driver 580's "no limit" sentence, a server not
# found, an unknown command (parse_line: CommandOutput, which changes nothing). `.*`, not
# `[^\n]*` (the same without DOTALL): the regex engine's fastest loop, on `ps` rows too.
_ANSWER = (r"[0-9].*\n|(?:ACTIVE|INITIALIZING|FAULT)" + _END
           + r"|PID[^\S\n]+ID[^\S\n]+SERVER\b.*\n|No default pinned memory limit set for the device!" + _END
           + r"|Server (?:-?[0-9]+ )?not found" + _END + r'|Unknown command ".*\n'
           # get_device_client_list's heading, and a `set_*` command's echo (`set_default_... 0 2G.`):
           # no message that starts so has a rule (they start with capitals), so the parser's
           # output shapes take them (parser._CONTROL_OUTPUT).
           + r"|\[[0-9]+\] .*\n|[a-z_]+ .*\." + _END)
# A framing line, and a refused connection (`User did not send valid credentials`: a client
# that could not say who it is; a Noise line that ends no command), taken after framing lines.
_FRAMING = r"(?:Accepting connection\.\.\.|NEW UI|UI closed)" + _END
_REFUSED = "User did not send valid credentials" + _END
# Outside commands, the daemon waiting on a server it would shut down (ShutdownDeferred,
# only counted) and saying when it tries again (Noise): they start a run, or follow in it.
_DEFERRED = r"Server [0-9]{1,10} has [0-9]{1,10} active worker threads?\. Server will not shutdown\.?" + _END
_DEFERRED_TEXT = " active worker thread"
_DEFERRED_LINE = re.compile(_HEAD + _DEFERRED).match
_SHUTDOWN = f"{_DEFERRED}|Control will try shutting down server .*\n"
# A command that changes nothing but the counts and "in a command" (LogState._command): any
# but the two that set a running server's limit, which are parsed. Group 1: its verb, as the
# parser takes it (what follows is a space or the line's end).
_READ_COMMAND = (r"Cmd:(?!(?:set_device_pinned_mem_limit|set_active_thread_percentage)(?![a-z_]))"
                 r"([a-z_]{1,40})(?: .*)?" + _END)
# A client's context admitted (`NEW CLIENT P from user U: Server already exists`, parse_line:
# ClientAccepted): while nobody is queued it changes nothing but control_changes, so then the
# runs take it too, anywhere (it neither starts nor ends a command), and count it.
_ACCEPTED = r"NEW CLIENT -?[0-9]{1,10} from user [0-9]{1,10}: Server already exists.*\n"
_ACCEPTED_TEXT = "Server already exists"
_ACCEPTED_LINE = re.compile(_HEAD + _ACCEPTED).match
_Run = Callable[[str, int], "re.Match[str]"]


def _runs(among: str) -> Tuple[_Run, _Run]:
    """Runs of echoes, matched over the batch's text in one call each (the header matched once
    a line, each alternative a message), `among` (`|` and a message, or nothing) taken anywhere
    in them. Inside a command: the rest of its answer, then framing lines (group 1). Outside:
    framing lines, then one command _READ_COMMAND takes (group 1: its verb), its answer and the
    framing after it (group 2). Refused connections are taken after framing lines; a server's
    shutdown deferred and retried, outside commands."""
    answer = f"{_HEAD}(?:{_ANSWER}{among})"
    after = f"(?:{_HEAD}(?:{_FRAMING}|{_REFUSED}|{_SHUTDOWN}{among}))*"
    framed = f"({_HEAD}{_FRAMING}{after})?"
    return (cast(_Run, re.compile(f"(?:{answer})*{framed}").match),
            cast(_Run, re.compile(f"(?:{_HEAD}(?:{_FRAMING}|{_SHUTDOWN}{among}){after})?"
                                  f"(?:{_HEAD}{_READ_COMMAND}(?:{answer})*{framed})?").match))


_RUN_IN_COMMAND, _RUN_OUTSIDE = _runs("")
_QUIET_RUN_IN_COMMAND, _QUIET_RUN_OUTSIDE = _runs("|" + _ACCEPTED)


def _attempts(among: str) -> _Run:
    """From a server's shutdown attempt outside commands (`Try shutting down server S`, just
    parsed), the run after it: its deferrals and retries, framing lines, refused connections
    (outside commands, Noise) and the daemon's next attempts on the same server (`\\1`), which
    change nothing once the first is applied (LogState._shutdown_attempt: S's record and the
    pending list are as it left them, since no line in between is parsed)."""
    again = r"Try shutting down server \1(?![0-9]).*\n"
    return cast(_Run, re.compile(f"{_HEAD}Try shutting down server ([0-9]{{1,10}})(?![0-9]).*\n"
                                 f"(?:{_HEAD}(?:{_FRAMING}|{_REFUSED}|{_SHUTDOWN}|{again}{among}))*").match)


_ATTEMPTS, _QUIET_ATTEMPTS = _attempts(""), _attempts("|" + _ACCEPTED)


def _lines_of(text: str, pos: int, end: int, needle: str, line: Callable[[str, int], object]) -> int:
    """How many of the lines of a run in text[pos:end] are `line`'s, found by `needle` in them
    (where their text shows: not inside another line, an answer's)."""
    n = 0
    at = text.find(needle, pos, end)
    while at >= 0:
        start = text.rfind("\n", pos, at) + 1 or pos
        if line(text, start):
            n += 1
        at = text.find(needle, text.find("\n", at, end) + 1 or end, end)
    return n


def apply_control(state: LogState, lines: Sequence[str], parse: Callable[[str], ParseResult],
                  on_error: Callable[[str], None]) -> None:
    """Apply control.log lines in order: echoes counted, the rest parsed and applied.
    `on_error(line)`: applying that line raised (a bug; the line still counts)."""
    if lines:
        apply_control_text(state, "\n".join(lines) + "\n", parse, on_error)


def apply_control_text(state: LogState, text: str, parse: Callable[[str], ParseResult],
                       on_error: Callable[[str], None]) -> int:
    """apply_control of the lines of `text`, each ended by a newline (FileFollower.poll_text):
    how many lines it held."""
    find = text.find
    in_command = state.in_command
    pos = parsed = 0  # parsed: lines through the parser; the others are echoes
    newest = -1  # where the last echo ends (after its newline)
    quiet = not state.queued()
    size = len(text)
    # The next place each needle shows at or after pos (size: nowhere): one search each over
    # the batch, not one per run.
    accepted_at, deferred_at = find(_ACCEPTED_TEXT), find(_DEFERRED_TEXT)
    accepted_at = size if accepted_at < 0 else accepted_at
    deferred_at = size if deferred_at < 0 else deferred_at
    verbs: Dict[str, int] = {}  # counted commands' verbs counted in runs, not yet in the state
    attempt = -1  # where a shutdown attempt just applied starts (outside commands)
    while pos < size:
        # Every run pattern can match nothing, so none returns None (_ATTEMPTS can).
        m: Optional["re.Match[str]"] = None
        if attempt >= 0:  # the attempts that repeat it, and what comes between
            m = (_QUIET_ATTEMPTS if quiet else _ATTEMPTS)(text, attempt)
            attempt = -1
            if m is not None and m.end() <= pos:  # nothing after it (or its header is not the daemon's)
                m = None
            framed = True  # a run may follow: a command after framing lines
        if m is not None:
            pass
        elif in_command:
            m = (_QUIET_RUN_IN_COMMAND if quiet else _RUN_IN_COMMAND)(text, pos)
            framed = m.end(1) > m.start(1)
            if framed:  # the command's block ended
                in_command = False
        else:
            m = (_QUIET_RUN_OUTSIDE if quiet else _RUN_OUTSIDE)(text, pos)
            verb = m.group(1)
            framed = False
            if verb is not None:
                verbs[verb] = verbs.get(verb, 0) + 1
                framed = m.end(2) > m.start(2)
                in_command = not framed  # no framing after it: its answer goes on
        end = m.end()
        if end > pos:
            if accepted_at < pos:  # in a line parsed since
                accepted_at = _next(find, _ACCEPTED_TEXT, pos, size)
            if accepted_at < end:
                if quiet:
                    state.count_accepted(_lines_of(text, pos, end, _ACCEPTED_TEXT, _ACCEPTED_LINE))
                accepted_at = _next(find, _ACCEPTED_TEXT, end, size)
            if deferred_at < pos:
                deferred_at = _next(find, _DEFERRED_TEXT, pos, size)
            if deferred_at < end:
                deferred = _lines_of(text, pos, end, _DEFERRED_TEXT, _DEFERRED_LINE)
                if deferred:
                    state.count_shutdown_deferrals(deferred)
                deferred_at = _next(find, _DEFERRED_TEXT, end, size)
            pos = newest = end
            # A run stops at a line that is no echo, but after framing lines a counted
            # command may start the next run; anywhere else the parser takes the line.
            if framed or pos == size:
                continue
        stop = find("\n", pos)
        line = text[pos:stop]  # no echo here: the parser's
        if verbs:  # the commands before it first, as line by line
            state.count_commands(verbs)
            verbs.clear()
        state.in_command = in_command
        event = _apply(state, line, parse, on_error)
        in_command = state.in_command
        quiet = not state.queued()
        if type(event) is ShutdownAttempt and not in_command:
            attempt = pos
        pos = stop + 1
        parsed += 1
    if verbs:
        state.count_commands(verbs)
    state.in_command = in_command
    lines = text.count("\n")
    echoes = lines - parsed
    if echoes:
        state.count_echoes(echoes, parse(text[text.rfind("\n", 0, newest - 1) + 1:newest - 1])[0])
    return lines


def _apply(state: LogState, line: str, parse: Callable[[str], ParseResult],
           on_error: Callable[[str], None]) -> Optional[ParseResult]:
    """The line parsed and applied: its event (None where that raised)."""
    try:
        event = parse(line)
        state.apply(event, "control")
        return event
    except Exception:  # a bug costs this line's meaning, never the batch or the count
        on_error(line)
        return None


def _next(find: Callable[[str, int], int], needle: str, start: int, size: int) -> int:
    at = find(needle, start)
    return size if at < 0 else at
