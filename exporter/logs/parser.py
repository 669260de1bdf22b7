"""One MPS log line -> one event. Pure: no I/O, no state.

Formats (every line: `[YYYY-MM-DD HH:MM:SS.mmm ROLE PID] message`, ROLE one of
`Control`, `Server`, `Other`, `Legacy Server`):

- CUDA 13.x, as in tests/data/captures/h200-driver580-a: `Client {PID: P, Context ID: C}
  connected`, `Client process P disconnected`, `Active Threads Percentage set to 25.0`,
  `Device pinned memory limit for device 0 set to 0x80000000 bytes`, and the fatal
  error report (`Client {PID: P, Context: C} encountered a fatal GPU error.`,
  `Server is handling a fatal GPU error.`, `The following devices will be reset:`
  followed by bare device numbers, `The following client process have a sticky
  error set:` followed by bare PIDs).
- CUDA 11.x/12.x server.log, role `Other`: `Start`, `Volta MPS: Creating server
  context on device 0`, `activeThreadsPercentage set to 33.000000`, `MPS Server is
  started`, `Volta MPS Server: Received new client request`, `Volta MPS: Device
  Tesla T4 (uuid ...) is associated` (once per client process), `Volta MPS: Client
  disconnected. Number of active client contexts is N` (per context), `Volta MPS:
  Client process disconnected` (no PID). Control daemon start is a bare `Start`.
  (Recorded in public issue threads: NVIDIA/nvidia-container-toolkit#277, a
  CUDA 11.2 docker-compose run.)
  Their fatal error report is 13.x's, each line behind `Volta MPS: ` (`Volta MPS: Server
  is handling a fatal GPU error.`, the two list headings, bare numbers).
- Any version: `Server Priority set to N` (the daemon's default client priority when the
  server started), and for `terminate_client` `MPS server requesting client {PID: P,
  Context ID: C} to exit` then `Client termination succeeded.`.
- Pre-Volta (NVIDIA's MPS documentation, "Server Log"): `New client 14781 connected`,
  `Client 14777 disconnected`, `MPS server failed to start`.
- Role `Legacy Server`: `Failed to start : invalid argument` (NVIDIA/k8s-device-plugin#685),
  and `Server encountered a fatal exception. Shutting down` in control.log.

Timestamps carry no zone: they are read in `tz` (None: the machine's local time).
In control.log the lines a command prints (bare PIDs, `ACTIVE`, `25.0`, the `ps`
table, `Server 713 not found`, the `set_default_... 2G.` echo) parse as
CommandOutput, never as events; the state machine also treats any unmatched line
between `Cmd:` and `UI closed` as output.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone, tzinfo
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from .events import (
    AcceptFailed, ClientAccepted, ClientContextActive, DeviceKey, ClientContextConnected, ClientProcessConnected, ClientProcessDisconnected,
    ClientPushed, ClientRejected, ClientTerminated, Command, CommandOutput, DaemonExited, DaemonStarted, DaemonVersion,
    FatalGpuError,
    Noise, ParseResult, ReportHeading, ReportItem, ServerActiveThreads, ServerExited, ServerExiting,
    ServerPinnedLimit, ServerPriority, ServerReady, ServerStartFailed, ServerStarting, ShutdownAttempt,
    ShutdownDeferred, UiClosed, UiOpened, Unrecognized,
)

# ------------------------------------------------------------------ time
# Consecutive lines mostly share their second: one cached conversion saves nearly
# all datetime work (parse_line checks the cache inline). The seconds of one minute share
# its conversion (its second 0 plus theirs): the same value where the zone's offset changes
# only on a whole minute, as every change in the time zone database since 1972 does.
_cached_second = ""
_cached_tz: Optional[tzinfo] = None
_cached_epoch = 0.0
_cached_minute = ""
_cached_minute_tz: Optional[tzinfo] = None
_cached_minute_epoch = 0.0


def _second_epoch(text: str, tz: Optional[tzinfo]) -> float:
    """'2026-11-21 04:19:21' -> unix seconds, read in tz (None: local time, DST included)."""
    global _cached_second, _cached_tz, _cached_epoch, _cached_minute, _cached_minute_tz, _cached_minute_epoch
    second = int(text[17:19])
    if not 0 <= second <= 59:
        raise ValueError(f"second {second} out of range")
    minute = text[:17]
    if minute != _cached_minute or tz is not _cached_minute_tz:
        dt = datetime(int(text[0:4]), int(text[5:7]), int(text[8:10]), int(text[11:13]), int(text[14:16]),
                      tzinfo=tz)
        _cached_minute, _cached_minute_tz, _cached_minute_epoch = minute, tz, dt.timestamp()
    value = _cached_minute_epoch + second
    _cached_second, _cached_tz, _cached_epoch = text, tz, value
    return value


def resolve_timezone(name: str) -> Optional[tzinfo]:
    """'local' -> None (the machine's zone); 'UTC' or an IANA name -> tzinfo.

    Raises ValueError with one clear line for an unknown name."""
    if not name or name == "local":
        return None
    if name.upper() in ("UTC", "Z"):
        return timezone.utc
    try:
        from zoneinfo import ZoneInfo  # Python 3.9+
        return ZoneInfo(name)
    except Exception as e:  # ZoneInfoNotFoundError, ValueError for odd keys
        raise ValueError(f"unknown time zone {name!r} for MPS log timestamps") from e


# --------------------------------------------------------------- helpers
_new = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (hot path)

# A rule: (prefix, match, build, kind). A pattern without regex syntax is a plain prefix
# (str.startswith: cheaper than a regex; match None), else match is its compiled match
# (prefix None); a build that is a str is the kind of a Noise event (kind), else
# build(ts, pid, match) makes the event (kind None; match None for a prefix).
_Rule = Tuple[Optional[str], Optional[Callable[[str], Optional["re.Match[str]"]]],
              Union[str, Callable[..., ParseResult]], Optional[str]]


_REGEX_SYNTAX = set(".^$*+?{}[]\\|()")


def _rules(*pairs: Tuple[str, Union[str, Callable[..., ParseResult]]]) -> List[_Rule]:
    return [(None, re.compile(p).match, build, build if isinstance(build, str) else None) if _REGEX_SYNTAX & set(p)
            else (p, None, build, build if isinstance(build, str) else None) for p, build in pairs]


def _apply_rules(rules: List[_Rule], ts: float, pid: int, msg: str) -> Optional[ParseResult]:
    for prefix, match, build, kind in rules:
        if match is None:
            if not msg.startswith(prefix):  # type: ignore[arg-type]
                continue
            m = None
        else:
            m = match(msg)
            if m is None:
                continue
        return _new(Noise, (ts, pid, kind)) if kind is not None else build(ts, pid, m)  # type: ignore[operator]
    return None


# ---------------------------------------------------------- control.log
_CONTROL_EXACT: Dict[str, Union[str, Callable[[float, int], ParseResult]]] = {
    "Accepting connection...": "accepting_connection",
    "User did not send valid credentials": "invalid_credentials",
    "NEW UI": UiOpened,
    "UI closed": UiClosed,
    "Start": DaemonStarted,  # 11.x
    "Unable to read new connection type information": "bad_connection",
    "Unable to accept connection": AcceptFailed,
    "Server encountered a fatal exception. Shutting down": "server_fatal_exception",
    "No default pinned memory limit set for the device!": lambda ts, pid: _new(CommandOutput, (ts, pid, "no_default_pinned_limit")),
}


def _new_client(ts: float, pid: int, m: "re.Match[str]") -> ParseResult:
    """`NEW CLIENT`'s event from its rule's match, or from the line's (_LINE["control"]: the
    same three groups, last)."""
    last = m.lastindex or 0
    client, uid, tail = int(m.group(last - 2)), int(m.group(last - 1)), m.group(last)
    if tail.startswith("Server already exists"):
        return ClientAccepted(ts, pid, client, uid)
    if tail.startswith("Server is not ready"):
        return ClientPushed(ts, pid, client, uid)
    return Unrecognized(ts, pid, "NEW CLIENT with an unknown outcome")


# Keyed by the message's first word; tried in order.
_CONTROL_RULES: Dict[str, List[_Rule]] = {
    "NEW": _rules(
        (r"NEW CLIENT (-?\d{1,10}) from user (\d{1,10}): (.*)$", _new_client),
        (r"NEW SERVER (\d{1,10}): Ready$", lambda ts, pid, m: _new(ServerReady, (ts, pid, int(m.group(1))))),
    ),
    "Starting": _rules(
        (r"Starting new server (\d{1,10}) for user (\d{1,10})$",
         lambda ts, pid, m: ServerStarting(ts, pid, int(m.group(1)), int(m.group(2)))),
        (r"Starting control daemon", lambda ts, pid, m: _new(DaemonStarted, (ts, pid))),
    ),
    "Server": _rules(
        (r"Server (\d{1,10}) exited with status (-?\d{1,10})$",
         lambda ts, pid, m: ServerExited(ts, pid, int(m.group(1)), int(m.group(2)))),
        (r"Server (\d{1,10}) has (\d{1,10}) active worker threads?\. Server will not shutdown\.?$",
         lambda ts, pid, m: ShutdownDeferred(ts, pid, int(m.group(1)), int(m.group(2)))),
        (r"Server (?:-?\d+ )?not found$", lambda ts, pid, m: _new(CommandOutput, (ts, pid, m.group(0)))),  # bare: `ps`
    ),
    "Try": _rules(
        (r"Try shutting down server (\d{1,10})(?!\d)", lambda ts, pid, m: _new(ShutdownAttempt, (ts, pid, int(m.group(1))))),
    ),
    "Control": _rules(
        ("Control will try shutting down server ", "shutdown_retry"),
    ),
    "To": _rules(
        (r"To connect CUDA applications to this daemon", "pipe_hint"),
    ),
    "CUDA": _rules(
        (r"CUDA MPS Control binary version: (\S+)$", lambda ts, pid, m: _new(DaemonVersion, (ts, pid, m.group(1)))),
    ),
    "Exit": _rules(
        (r"Exit with status (-?\d{1,10})$", lambda ts, pid, m: _new(DaemonExited, (ts, pid, int(m.group(1))))),
    ),
    "Unknown": _rules(
        (r'Unknown command "', lambda ts, pid, m: _new(CommandOutput, (ts, pid, "unknown_command"))),
    ),
    "PID": _rules(  # the ps table's heading
        (r"PID\s+ID\s+SERVER\b", lambda ts, pid, m: _new(CommandOutput, (ts, pid, "ps_heading"))),
    ),
}

# Shapes of command output that have no first word to key on.
_CONTROL_OUTPUT = re.compile(
    r"-?\d+(?:\.\d+)?[KMGTP]?"                  # PID, `25.0`, `712.1`, `2G`
    r"|(?:ACTIVE|INITIALIZING|FAULT)"            # get_server_status
    r"|\d+\s+\d+\s+\d+\s+\S+.*"                  # a ps row
    r"|\[\d+\] .*"                               # get_device_client_list heading
    r"|[a-z_]+ .*\.",                            # `set_default_device_pinned_mem_limit 0 2G.` echo
)

_COMMAND = re.compile(r"Cmd:\s*(\S*)\s*(.*)$")


def _parse_control(ts: float, pid: int, msg: str) -> ParseResult:
    build = _CONTROL_EXACT.get(msg)
    if build is not None:
        return _new(Noise, (ts, pid, build)) if isinstance(build, str) else build(ts, pid)
    if msg.startswith("Cmd:"):
        m = _COMMAND.match(msg)
        return Command(ts, pid, m.group(1), m.group(2)) if m else Unrecognized(ts, pid, "bad Cmd line")
    space = msg.find(" ")
    rules = _CONTROL_RULES.get(msg[:space] if space > 0 else msg)
    event = _apply_rules(rules, ts, pid, msg) if rules else None
    if event is not None:
        return event
    if _CONTROL_OUTPUT.fullmatch(msg.rstrip()):
        return CommandOutput(ts, pid, msg)
    return Unrecognized(ts, pid, "no control rule matched")


# ----------------------------------------------------------- server.log
_SERVER_EXACT: Dict[str, Union[str, Callable[[float, int], ParseResult]]] = {}
for _kind, _texts in {
    "server_startup": ("Startup", "Start", "Initializing server process", "Server has started",
                       "MPS Server is started"),
    "shutdown_request": ("Server has been notified to shutdown", "Waiting for current clients to finish"),
    "client_request": ("Volta MPS Server: Received new client request", "MPS Server: worker created",
                       "Volta MPS: Creating worker thread"),
    "client_context_exit": ("Receive command failed, assuming client exit",),
}.items():
    for _text in _texts:
        _SERVER_EXACT[_text] = _kind
# The fatal error report: bare on 13.x, behind `Volta MPS: ` on 11.x/12.x (_VOLTA).
_REPORT_EXACT: Dict[str, Callable[[float, int], ParseResult]] = {
    "Server is handling a fatal GPU error.": lambda ts, pid: _new(FatalGpuError, (ts, pid, None)),
    "The following devices will be reset:": lambda ts, pid: _new(ReportHeading, (ts, pid, "reset_devices")),
    "The following client process have a sticky error set:": lambda ts, pid: _new(ReportHeading, (ts, pid, "sticky_clients")),
}
_SERVER_EXACT.update(_REPORT_EXACT)
_SERVER_EXACT.update({
    "Exiting": ServerExiting,
    "Client termination succeeded.": "client_terminated",
    "Volta MPS: Client process disconnected": lambda ts, pid: _new(ClientProcessDisconnected, (ts, pid, None)),
    "MPS server failed to start": lambda ts, pid: _new(ServerStartFailed, (ts, pid, "failed to start")),
})


def _limit(text: str) -> int:
    return int(text, 16) if text.lower().startswith("0x") else int(text)


def _device(text: str) -> DeviceKey:
    """A device ordinal, or the GPU UUID it was named by."""
    return int(text) if text.isdigit() else text


_CLIENT_FATAL = r"Client \{PID: (-?\d{1,10}), Context(?: ID)?: \d+\} encountered a fatal GPU error"

_SERVER_RULES: Dict[str, List[_Rule]] = {
    # A server refusing a connection the daemon handed it: on driver 580, that of a client
    # that was killed while it waited on the pending list (tests/gpu/reports/h100-queuedeath.md).
    "User": _rules(("User did not send valid credentials",
                    lambda ts, pid, m: _new(ClientRejected, (ts, pid, "invalid_credentials", None))),),
    "Client": _rules(
        (r"Client \{PID: (-?\d{1,10}), Context ID: \d+\} connected$",
         lambda ts, pid, m: _new(ClientContextConnected, (ts, pid, int(m.group(1))))),
        (r"Client process (-?\d{1,10}) disconnected$",
         lambda ts, pid, m: _new(ClientProcessDisconnected, (ts, pid, int(m.group(1))))),
        (_CLIENT_FATAL, lambda ts, pid, m: _new(FatalGpuError, (ts, pid, int(m.group(1))))),
        (r"Client \{PID: -?\d+, Context ID: \d+\} exiting", "client_context_exit"),
        (r"Client \{PID: -?\d+, Context ID: \d+\} on .* to be torn down", "fatal_report"),
        (r"Client (\d{1,10}) disconnected$",  # pre-Volta
         lambda ts, pid, m: _new(ClientProcessDisconnected, (ts, pid, int(m.group(1))))),
    ),
    "New": _rules(
        (r"New client (\d{1,10}) connected$", lambda ts, pid, m: _new(ClientContextConnected, (ts, pid, int(m.group(1))))),
    ),
    "Active": _rules(
        (r"Active Threads Percentage set to (\d{1,3}(?:\.\d{1,9})?)$",
         lambda ts, pid, m: _new(ServerActiveThreads, (ts, pid, float(m.group(1))))),
    ),
    "activeThreadsPercentage": _rules(
        (r"activeThreadsPercentage set to (\d{1,3}(?:\.\d{1,9})?)$",
         lambda ts, pid, m: _new(ServerActiveThreads, (ts, pid, float(m.group(1))))),
    ),
    "Device": _rules(
        (r"Device pinned memory limit for device ([0-9]{1,10}|GPU-[0-9a-fA-F-]{1,40}) set to "
         r"(0x[0-9a-fA-F]{1,16}|[0-9]{1,20}) bytes$",
         lambda ts, pid, m: ServerPinnedLimit(ts, pid, _device(m.group(1)), _limit(m.group(2)))),
        (r"Device .* is associated$", "device_associated"),
    ),
    "Volta": _rules(
        # 11.x/12.x: logged once per client process, the only place its connection shows.
        (r"Volta MPS: Device .* is associated$", lambda ts, pid, m: _new(ClientProcessConnected, (ts, pid))),
        (r"Volta MPS: Client disconnected\.", "client_context_exit"),
        (r"Volta MPS: (?:Creating|Destroy) server context", "server_context"),
    ),
    "Server": _rules(
        ("Server failed to rece", "client_context_exit"),
        ("Server was unable to shutdown due to ", "shutdown_refused"),
        (r"Server Priority set to (-?\d{1,10})$", lambda ts, pid, m: _new(ServerPriority, (ts, pid, int(m.group(1))))),
    ),
    "Received": _rules((r"Received new client request", "client_request"),),
    "Creating": _rules(
        ("Creating worker thread", "client_request"),
        ("Creating server context", "server_context"),
    ),
    "Created": _rules((r"Created anonymous shared memory region", "server_startup"),),
    "Destroy": _rules((r"Destroy server context", "server_context"),),
    "Status": _rules(
        (r"Status of client \{PID: (-?\d{1,10}), Context(?: ID)?: \d+\} is ACTIVE$",
         lambda ts, pid, m: _new(ClientContextActive, (ts, pid, int(m.group(1))))),
        (r"Status of client .* is \w+$", "client_status"),
    ),
    "CUDA": _rules((r"CUDA MPS Server for Linux/Unix", "server_version"),),
    "Display": _rules((r"Display Driver version", "server_version"),),
    "Connecting": _rules((r"Connecting to control daemon", "server_startup"),),
    "MPS": _rules(
        # terminate_client <server> <client> (tests/data/captures/h100-limits24, server.log 13:26:26)
        (r"MPS server requesting client \{PID: (-?\d{1,10}), Context ID: \d+\} to exit$",
         lambda ts, pid, m: _new(ClientTerminated, (ts, pid, int(m.group(1))))),
        (r"MPS Server connecting to control daemon", "server_startup"),
        (r"MPS is only supported on .*", lambda ts, pid, m: _new(ServerStartFailed, (ts, pid, m.string))),
    ),
    "All": _rules((r"All clients belonging to error trigg?ing process", "fatal_report"),),
    "Failed": _rules(
        (r"Failed to start\b", lambda ts, pid, m: _new(ServerStartFailed, (ts, pid, m.string))),
        (r"Failed to accept new client\. Maximum number of clients \((\d{1,10})\) reached",
         lambda ts, pid, m: _new(ClientRejected, (ts, pid, "client_limit", int(m.group(1))))),
        # Clients that raise CUDA_DEVICE_MAX_CONNECTIONS fill a device sooner: with 8, MPS
        # admitted 15 and refused the rest so (2 x H100, issue 38). The same ceiling, no number.
        (r"Failed to accept new client\. Reached maximum number of device connections",
         lambda ts, pid, m: _new(ClientRejected, (ts, pid, "client_limit", None))),
        ("Failed to accept new client", lambda ts, pid, m: _new(ClientRejected, (ts, pid, "other", None))),
    ),
}

_BARE_NUMBER = re.compile(r"-?\d{1,10}")
_VOLTA = "Volta MPS: "
_VOLTA_CLIENT_FATAL = re.compile(_CLIENT_FATAL)


def _volta_report(ts: float, pid: int, msg: str) -> Optional[ParseResult]:
    """A fatal error report line of an 11.x/12.x server, `msg` without its `Volta MPS: `."""
    build = _REPORT_EXACT.get(msg)
    if build is not None:
        return build(ts, pid)
    if _BARE_NUMBER.fullmatch(msg):
        return ReportItem(ts, pid, int(msg))
    m = _VOLTA_CLIENT_FATAL.match(msg)
    return FatalGpuError(ts, pid, int(m.group(1))) if m else None


def _parse_server(ts: float, pid: int, msg: str) -> ParseResult:
    build = _SERVER_EXACT.get(msg)
    if build is not None:
        return _new(Noise, (ts, pid, build)) if isinstance(build, str) else build(ts, pid)
    if msg.startswith(_VOLTA):
        event = _volta_report(ts, pid, msg[len(_VOLTA):])
        if event is not None:
            return event
    space = msg.find(" ")
    if space < 0 and _BARE_NUMBER.fullmatch(msg):
        return ReportItem(ts, pid, int(msg))
    rules = _SERVER_RULES.get(msg[:space] if space > 0 else msg)
    event = _apply_rules(rules, ts, pid, msg) if rules else None
    if event is not None:
        return event
    return Unrecognized(ts, pid, "no server rule matched")


# ------------------------------------------------------------ the entry
PARSER_ERROR = "parser error"  # the reason of an Unrecognized line that made a rule raise
BAD_HEADER = Unrecognized(None, None, "bad header")  # a header whose date or time does not exist
# `[2026-11-21 04:19:24.641 Control   546] message`: second, milliseconds and PID; the
# role (`Control`, `Server`, `Other`, `Legacy Server`) only has to be there.
HEADER_PATTERN = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3}) +[A-Za-z ]*[A-Za-z] +(-?\d{1,10})\] ?"
_HEADER = re.compile(HEADER_PATTERN).match


# The hot path (issue 44). The commonest verbs that carry numbers are matched in the same
# regex call as the header, each as the one rule that its first word keys would try first
# (no exact message, `Volta MPS: ` report line or bare number can be one of them), where
# only what rstrip() removes follows the match (checked after it: `\s*\Z` in the pattern
# backtracks quadratically over a long line that fails it); the group named after the
# verb (its last one) says which matched, and holds what the event takes. Any other line:
# the header alone (the verbs are optional), then the rules below.
_VERBS: Dict[str, type] = {"connected": ClientContextConnected, "active": ClientContextActive,
                           "disconnected": ClientProcessDisconnected}
_NOISE_VERBS = frozenset(("client_request", "client_context_exit"))
_SERVER_VERBS = (r"Client \{PID: (?P<connected>-?\d{1,10}), Context ID: \d+\} connected"
                 r"|Status of client \{PID: (?P<active>-?\d{1,10}), Context(?: ID)?: \d+\} is ACTIVE"
                 r"|Client process (?P<disconnected>-?\d{1,10}) disconnected"
                 r"|(?P<client_request>Received new client request|Creating worker thread).*"
                 r"|(?P<client_context_exit>Server failed to rece|Client \{PID: -?\d+, Context ID: \d+\} exiting).*")
_CONTROL_VERBS = (r"NEW CLIENT (-?\d{1,10}) from user (\d{1,10}): (?P<new_client>.*)"
                  r"|Cmd:\s*(?P<command_verb>\S*)\s*(?P<command>.*)"
                  r"|(?P<output>\d+\s+\d+\s+\d+\s+\S+.*|-?\d+(?:\.\d+)?[KMGTP]?)"  # a ps row, a PID
                  # A server's life (_CONTROL_RULES' first rule of `Try`, `Starting` and `Server`;
                  # `NEW SERVER` follows `NEW CLIENT`, which no such line matches): the named
                  # group last, the server's PID the group before it where there are two.
                  r"|Try shutting down server (?P<shutdown_attempt>\d{1,10})(?!\d).*"
                  r"|Starting new server (\d{1,10}) for user (?P<server_starting>\d{1,10})"
                  r"|NEW SERVER (?P<server_ready>\d{1,10}): Ready"
                  r"|Server (\d{1,10}) exited with status (?P<server_exited>-?\d{1,10})")
# Those verbs' events, from the line's match: the same as their rules build.
_CONTROL_BUILDS: Dict[str, Callable[[float, int, "re.Match[str]"], ParseResult]] = {
    "shutdown_attempt": lambda ts, pid, m: _new(ShutdownAttempt, (ts, pid, int(m.group("shutdown_attempt")))),
    "server_ready": lambda ts, pid, m: _new(ServerReady, (ts, pid, int(m.group("server_ready")))),
    "server_starting": lambda ts, pid, m: _new(ServerStarting, (
        ts, pid, int(m.group((m.lastindex or 0) - 1)), int(m.group("server_starting")))),
    "server_exited": lambda ts, pid, m: _new(ServerExited, (
        ts, pid, int(m.group((m.lastindex or 0) - 1)), int(m.group("server_exited")))),
}
# The header in ASCII digits: a range is cheaper to match than \d (any Unicode digit, each
# asked of the Unicode database). Each line regex is tried with it first: where it matches,
# the header's \d matches the same characters the same way; where not (no header, a header
# in other digits), the regex with HEADER_PATTERN decides.
_ASCII_HEADER = HEADER_PATTERN.replace(r"\d", "[0-9]")
_LINE: Dict[str, Tuple[Callable[[str], Optional["re.Match[str]"]], ...]] = {
    file: tuple(re.compile(header + f"(?:(?:{verbs}))?").match for header in (_ASCII_HEADER, HEADER_PATTERN))
    for file, verbs in (("server", _SERVER_VERBS), ("control", _CONTROL_VERBS))}

# Most other messages recur word for word (`Accepting connection...`, `Volta MPS Server:
# Received new client request`), and each is taken apart once. _MESSAGES: per file, a
# message -> the type and the fields after (ts, pid) of the event it made, the same for
# every line with that message (rules read the message alone); not where a field is an
# int (a PID, a status) or the message itself (_UNIQUE: command output, unrecognized
# lines): such messages hardly recur. Full, it takes no more: bounded, and invisible but
# for the time it saves.
_MESSAGES: Dict[str, Dict[str, Tuple[type, Tuple[object, ...]]]] = {"control": {}, "server": {}}
_MESSAGES_MAX = 4096
_UNIQUE = (CommandOutput, Unrecognized)


def parse_line(line: str, file: str, tz: Optional[tzinfo] = None) -> ParseResult:
    """Parse one line (without its newline) of `file` ("control" or "server").

    Never raises: anything unexpected is Unrecognized. Every number a rule converts is
    matched with a bounded digit count (int() refuses more than 4300 digits), so no
    line can make a rule raise; the last resort is Unrecognized(reason=PARSER_ERROR)."""
    ascii_match, match = _LINE["control" if file == "control" else "server"]
    m = ascii_match(line) or match(line)
    if m is None:
        return Unrecognized(None, None, "no header")
    second, millis, pid_text = m.group(1, 2, 3)
    try:
        pid = int(pid_text)
        if second == _cached_second and tz is _cached_tz:
            ts = _cached_epoch + int(millis) * 0.001
        else:
            ts = _second_epoch(second, tz) + int(millis) * 0.001
    except (ValueError, OverflowError, OSError):  # odd digits, year 0, out-of-range dates
        return BAD_HEADER
    verb = m.lastgroup
    if verb is not None:  # a common verb, with the header: the commonest first
        end = m.end()
        if end == len(line) or line[end:].isspace():
            if verb in _NOISE_VERBS:  # a Noise event of that kind
                return _new(Noise, (ts, pid, verb))
            numbered = _VERBS.get(verb)
            if numbered is not None:
                return _new(numbered, (ts, pid, int(m.group(verb))))
            if verb == "new_client":
                return _new_client(ts, pid, m)
            if verb == "command":
                return _new(Command, (ts, pid, m.group("command_verb"), m.group("command").rstrip()))
            build = _CONTROL_BUILDS.get(verb)
            if build is not None:
                return build(ts, pid, m)
            # output: no first word keys a rule: the output shapes, as _parse_control tries them
            return _new(CommandOutput, (ts, pid, m.group(verb).rstrip()))
    end = m.end(3) + 1  # the header's: `]` and the space after it, where there is one
    return _parse_message(ts, pid, (line[end + 1:] if line[end:end + 1] == " " else line[end:]).rstrip(), file)


def _parse_message(ts: float, pid: int, msg: str, file: str) -> ParseResult:
    """The event of a line whose header gave ts and pid and whose message (after the
    header's space, rstripped) is no common verb."""
    known = _MESSAGES.get(file)
    if known is not None:
        made = known.get(msg)
        if made is not None:
            return _new(made[0], (ts, pid) + made[1])
    try:
        event = _parse_control(ts, pid, msg) if file == "control" else _parse_server(ts, pid, msg)
    except Exception:  # a rule's bug: the line stays one line (the tests require this never happens)
        return Unrecognized(ts, pid, PARSER_ERROR)
    if known is not None and len(known) < _MESSAGES_MAX and type(event) not in _UNIQUE:
        rest = event[2:]
        for field in rest:  # a number from the message (a PID): the message hardly recurs
            if type(field) is int:
                return event
        known[msg] = (type(event), rest)
    return event


# ------------------------------------------------------------- catch-up
# A batch of server.log lines (a backlog: many at once) taken apart by one findall over
# their text instead of a regex call per line: per line, the header's groups, then those of
# _SERVER_VERBS (the verb followed by what rstrip() removes), or else the message; a
# line without the header, its whole text. Each line is one match (the last alternative
# takes any line), none crosses a newline (`.` takes none).
# The header in ASCII digits (a range is cheaper to match than \d, any Unicode digit): a line
# dated in other digits is scanned as a line without the header, and applied as parse_line says.
_SCAN_HEADER = _ASCII_HEADER
# The verbs too: one numbered in other digits is scanned as a message, which server_row_event
# takes apart by the rules (the same event: each verb is the first rule its first word tries).
_SCAN_VERBS = _SERVER_VERBS.replace(r"\d", "[0-9]")
_SERVER_SCAN = re.compile(_SCAN_HEADER + rf"(?:(?:{_SCAN_VERBS})[^\S\n]*\n|(.*)\n)|(.*)\n").findall


def scan_server(lines: Sequence[str]) -> Optional[List[Tuple[str, ...]]]:
    """One row of strings per line (_SERVER_SCAN's groups), or None where a line holds a
    newline (never from the follower)."""
    if not lines:
        return []
    rows = _SERVER_SCAN("\n".join(lines) + "\n")
    return rows if len(rows) == len(lines) else None


def scan_server_text(text: str) -> List[Tuple[str, ...]]:
    """scan_server of lines given as one text, each line ended by a newline: one row a line."""
    return _SERVER_SCAN(text)


second_epoch = _second_epoch
# Messages (as scanned: before rstrip) that parse as Noise other than a fatal error report's:
# rules read a message alone, so each is taken apart once. Bounded like _MESSAGES.
_QUIET: Dict[str, None] = {}


def server_row_event(ts: float, pid: str, connected: str, active: str, disconnected: str,
                     msg: str) -> Optional[ParseResult]:
    """The event of a scan_server row (its groups from the PID on, but the Noise verbs') of a
    line with a header, its time ts: None where that is Noise other than a fatal error
    report's (a line only counted, its time kept)."""
    if connected:
        return _new(ClientContextConnected, (ts, int(pid), int(connected)))
    if active:
        return _new(ClientContextActive, (ts, int(pid), int(active)))
    if disconnected:
        return _new(ClientProcessDisconnected, (ts, int(pid), int(disconnected)))
    if msg in _QUIET:
        return None
    event = _parse_message(ts, int(pid), msg.rstrip(), "server")
    if type(event) is not Noise or event[2] == "fatal_report":
        return event
    if len(_QUIET) < _MESSAGES_MAX:
        _QUIET[msg] = None
    return None


def server_row_noise(ts: float, pid: str, request: str, context_exit: str, msg: str) -> ParseResult:
    """The Noise event of a scan_server row of a line with a header, its time ts, that is a
    Noise verb (request, context_exit: its group) or a message server_row_event found Noise:
    parse_line's event of that line."""
    if request or context_exit:
        return _new(Noise, (ts, int(pid), "client_request" if request else "client_context_exit"))
    return _parse_message(ts, int(pid), msg.rstrip(), "server")
