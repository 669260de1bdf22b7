"""Events in, state out: the queue, lifecycle and fault state the MPS logs describe.

Pure: no I/O and no clock. `LogState.apply(result, file)` takes what `parse_line`
returned for one line of `file`; `snapshot()` returns a copy the render reads.
Memory is bounded by what is running (servers, clients, pending clients), never
by the length of the log: finished things are dropped, and every table that a
broken log could grow has a cap.

Rules (control.log is the source of truth for lifecycle and queueing, server.log
for client connections, fatal errors and per-server settings):
- A client is queued at `NEW CLIENT P ...: push client to pending list`. Its reason
  is `user_switch` when a server of another user is running (or when the daemon
  then shuts a server of another user down by itself), else `server_starting`.
- It is admitted at the next `NEW CLIENT P ...: Server already exists` for the same
  PID: the wait from push to there goes into the histogram. It stops counting as
  queued earlier, at `NEW SERVER S: Ready` of a server of its user: the daemon hands
  its pending clients to that server (tens of ms before the client's next context
  logs `Server already exists`). If that line never comes (a client with a single
  context), the wait up to the handover is observed when the server exits.
- A handoff is a server the daemon shut down on its own (`Try shutting down server S`
  outside a `Cmd:` block: only a waiting client of another user makes it do that)
  that then exited. `shutdown_server` and `quit` are commands, not handoffs.
- A start failure is a server that exited before `NEW SERVER S: Ready`.
- A client process counts once: on its first `Client {PID: P, Context ID: C}
  connected` (13.x) / `New client P connected` (pre-Volta); on 11.x/12.x, which
  log no PID, on `Volta MPS: Device ... is associated` (once per process).
- One fatal GPU error is one report: `Client ... encountered a fatal GPU error.`
  and `Server is handling a fatal GPU error.` of the same report count once.
- Lines between `Cmd:` and `UI closed` that no rule knows are the command's
  output, not unrecognized lines.
- Limits bind a client as they were when it connected: a server's limits are kept
  as a history of changes (server.log's `... set to` lines at start, control.log's
  `Cmd:set_device_pinned_mem_limit S D V` / `Cmd:set_active_thread_percentage S P`
  while it runs) and each client's are looked up at its connection time.
- A client an operator ended (`terminate_client`) is server.log's `MPS server requesting
  client {PID: P, Context ID: C} to exit`: one per context, counted once per process.
- A server's priority is its `Server Priority set to N` (the daemon default at its start).
- A refused client is server.log's `Failed to accept new client. Maximum number
  of clients (N) reached.`
- A server exited with clients when control.log's `Server S exited` comes while
  server.log still has clients connected to S (SIGKILL, a crash: control.log says
  `status 0` either way). Decided once server.log has been read past the exit:
  at its next line with a later time, or at `settle()` (the reader calls it after
  each round in which it read server.log, after control.log, to its end).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Deque, Dict, Iterator, List, NamedTuple, Optional, Protocol, Set, Tuple

from ..codec import expect
from ..contract import OTHER, QUEUE_WAIT_BUCKETS, command_verb, exit_status
from ..model import (REASONS, SERVER_STARTING, THREADS, USER_SWITCH, ClientLimits, LogEvent,
                     LogServer, LogSnapshot, PendingClient, queue_wait_histogram)
from ..units import ascii_digits, parse_decimal, parse_size
from .events import (
    AcceptFailed, ClientAccepted, ClientContextActive, DeviceKey, ClientContextConnected, ClientProcessConnected, ClientProcessDisconnected,
    ClientPushed, ClientRejected, ClientTerminated, Command, DaemonExited, DaemonStarted, DaemonVersion, FILES, FatalGpuError, Noise,
    ParseResult, ReportHeading, ReportItem, ServerActiveThreads, ServerExited, ServerExiting,
    ServerPinnedLimit, ServerPriority, ServerReady, ServerStartFailed, ServerStarting, ShutdownAttempt, ShutdownDeferred,
    UiClosed, UiOpened, Unrecognized,
)

# Caps: what a broken or hostile log could otherwise grow without bound.
MAX_PENDING = 1024
MAX_CLIENTS = 4096
MAX_SERVERS = 1024
MAX_EXITED_MEMORY = 4096  # exited server PIDs remembered, so late server.log lines do not revive them
MAX_ORPHAN_FACTS = 64  # server.log facts of servers control.log has not announced (yet)
MAX_RECENT_EVENTS = 64  # the last events `mps-exporter status` lists with their times
MAX_PENDING_EXITS = 4096
MAX_ATTACHED = 4096  # clients per server remembered for the exits-with-clients check
MAX_COUNTED_EVENTS = 1024  # names in a saved map of counted events (the exporter declares a dozen)
# A line dated further ahead of the clock than this is not believed: its time moves no
# exported time (one line dated 9999 once pinned the last-line time there for good).
MAX_CLOCK_AHEAD = 86400.0


class NegativeCounter(ValueError):
    """A saved counter, histogram count or sum below zero or not finite."""



class Liveness(Protocol):
    """What forget_gone asks about processes (liveness.ProcLiveness reads /proc)."""

    def sees_daemon(self, pid: int) -> bool: ...

    def gone(self, pid: int) -> bool: ...


class PendingQueue:
    """The daemon's pending list: clients in push order, indexed so that no line scans it
    (issue 42: 100,000 PIDs and users read 6.5 times slower while every accepted client
    searched the list). Entries are keyed by their push number."""

    def __init__(self) -> None:
        self._next = 0
        self.clear()

    def clear(self) -> None:
        self._all: Dict[int, PendingClient] = {}  # push number -> client, in push order
        self._by_pid: Dict[int, Dict[int, None]] = {}  # pid -> its entries, oldest first
        self._waiting: Dict[int, Dict[int, None]] = {}  # uid -> entries not handed to a server yet
        self._served: Dict[int, Dict[int, None]] = {}  # uid -> entries handed to a server of theirs
        self._starting: Dict[int, Dict[int, None]] = {}  # uid -> waiting entries queued as server_starting
        self.waiting = 0

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[PendingClient]:
        return iter(self._all.values())

    def items(self) -> List[Tuple[int, PendingClient]]:
        return list(self._all.items())

    def push(self, p: PendingClient) -> None:
        """At the end; the oldest entry leaves beyond MAX_PENDING."""
        if len(self._all) >= MAX_PENDING:
            self.remove(next(iter(self._all)))
        key = self._next
        self._next += 1
        self._all[key] = p
        _index(self._by_pid, p.pid, key)
        if p.served_at is None:
            self.waiting += 1
            _index(self._waiting, p.uid, key)
            if p.reason == SERVER_STARTING:
                _index(self._starting, p.uid, key)
        else:
            _index(self._served, p.uid, key)

    def remove(self, key: int) -> PendingClient:
        p = self._all.pop(key)
        _unindex(self._by_pid, p.pid, key)
        if p.served_at is None:
            self.waiting -= 1
            _unindex(self._waiting, p.uid, key)
            _unindex(self._starting, p.uid, key)
        else:
            _unindex(self._served, p.uid, key)
        return p

    def first_of(self, pid: int) -> Optional[int]:
        """The oldest entry of `pid`."""
        keys = self._by_pid.get(pid)
        return next(iter(keys)) if keys else None

    def serve(self, uid: Optional[int], ts: float) -> None:
        """A server of `uid` (None: of a user not known) is ready: it is handed the waiting
        clients of that user (None: every waiting client)."""
        for u in list(self._waiting) if uid is None else [uid]:
            keys = self._waiting.pop(u, None)
            if not keys:
                continue
            self._starting.pop(u, None)
            for key in keys:
                self._all[key].served_at = ts
                _index(self._served, u, key)
            self.waiting -= len(keys)

    def served_of(self, uid: Optional[int]) -> List[int]:
        """The entries of `uid` handed to a server, in push order."""
        return sorted(self._served.get(uid, ())) if uid is not None else []

    def switch_starting(self, but: Optional[int]) -> int:
        """Waiting `server_starting` entries of any user but `but` become `user_switch`: how many."""
        n = 0
        for u in [u for u in self._starting if u != but]:
            for key in self._starting.pop(u):
                self._all[key].reason = USER_SWITCH
                n += 1
        return n


def _index(index: Dict[int, Dict[int, None]], at: int, key: int) -> None:
    keys = index.get(at)
    if keys is None:
        keys = index[at] = {}
    keys[key] = None


def _unindex(index: Dict[int, Dict[int, None]], at: int, key: int) -> None:
    keys = index.get(at)
    if keys is not None:
        keys.pop(key, None)
        if not keys:
            del index[at]


class LogState:
    """The state machine. Not thread-safe: one writer; readers take snapshot()."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock  # wall time: a line dated more than MAX_CLOCK_AHEAD after it is not believed
        self._believed_until = 0.0  # clock() + MAX_CLOCK_AHEAD, renewed when a line passes it
        self.implausible_times = 0  # lines whose time was not believed
        self.s = LogSnapshot()  # counters and the published parts live here
        self._servers: Dict[int, LogServer] = {}
        self._pending = PendingQueue()
        self._pusher_pid: Optional[int] = None  # the PID that logged the last push
        self._clients: "OrderedDict[int, Tuple[int, float]]" = OrderedDict()  # pid -> (server, since)
        self._clients_of: Dict[int, Dict[int, None]] = {}  # server -> its pids in _clients
        self._server_uids: Dict[int, int] = {}  # uid -> how many of _servers run as it
        self._exited: Deque[int] = deque()
        self._exited_set: Set[int] = set()
        self._orphans: "OrderedDict[int, LogServer]" = OrderedDict()
        self._in_command = False
        self._last_ts: Dict[str, float] = {}  # file -> newest line timestamp (published as last_line_times)
        self._open_reports: Dict[int, str] = {}  # server pid -> topic of the fatal report being read
        self._recent: Deque[LogEvent] = deque(maxlen=MAX_RECENT_EVENTS)
        # exits with clients: server.log's clients per server, and exits not yet decided
        self._attached: Dict[int, Set[int]] = {}
        # server -> client processes with a context MPS made ACTIVE (the device connection ceiling)
        self._active: Dict[int, Set[int]] = {}
        self._pending_exits: List[Tuple[float, int]] = []  # heap of (time of `Server S exited`, S)
        self._unnamed = 0  # keys for 11.x clients, whose lines name no PID
        # server pid -> the client whose context connected last: MPS logs a refusal right
        # after the refused client's `Client {PID: P, Context ID: 1} connected`
        self._last_connected: "OrderedDict[int, int]" = OrderedDict()
        self._failures_counted: "OrderedDict[int, None]" = OrderedDict()  # start failures counted from server.log
        self._handlers: Dict[type, Callable[[Any], None]] = {
            DaemonStarted: self._daemon_started, DaemonExited: self._daemon_exited,
            DaemonVersion: _recognized, ClientPushed: self._client_pushed,
            ClientAccepted: self._client_accepted, ServerStarting: self._server_starting,
            ServerReady: self._server_ready, ServerExited: self._server_exited,
            ShutdownAttempt: self._shutdown_attempt,
            Command: self._command, UiOpened: self._end_command, UiClosed: self._end_command,
            ServerActiveThreads: self._active_threads, ServerPinnedLimit: self._pinned_limit,
            ClientContextConnected: self._context_connected, ClientContextActive: self._context_active,
            ClientProcessConnected: self._process_connected,
            ClientProcessDisconnected: self._process_disconnected,
            FatalGpuError: self._fatal_error, ReportHeading: self._report_heading,
            ReportItem: self._report_item, ServerExiting: self._server_exiting,
            ServerStartFailed: self._start_failed, ClientRejected: self._client_rejected,
            ServerPriority: self._server_priority, ClientTerminated: self._client_terminated,
            # Events that are only counted: one line each, the metric's name (logs/render.py declares it).
            ShutdownDeferred: self._counter("mps_server_shutdown_deferrals_total"),
            AcceptFailed: self._counter("mps_control_accept_failures_total"),
        }

    # --------------------------------------------------------------- input
    def apply(self, result: ParseResult, file: str) -> None:
        # The hot path (every line): plain lookups, Noise handled inline.
        s = self.s
        lines = s.lines
        lines[file] = lines.get(file, 0) + 1
        if isinstance(result, Unrecognized):
            if not (file == "control" and self._in_command and result.ts is not None):
                s.unrecognized[file] = s.unrecognized.get(file, 0) + 1
            return
        ts = result[0]
        if ts > self._believed_until:
            self._believed_until = self.clock() + MAX_CLOCK_AHEAD
            if not ts <= self._believed_until:  # NaN included: the line's time is the newest believed one
                self.implausible_times += 1
                ts = self._last_ts.get(file) or max(self._last_ts.values(), default=0.0) or self.clock()
                result = result._replace(ts=ts)
        last_ts = self._last_ts
        if ts > last_ts.get(file, 0.0):
            last_ts[file] = ts
        if self._pending_exits and file == "server" and ts > self._pending_exits[0][0]:
            self._decide_exits(before=ts)
        if self._open_reports and file == "server" and not _in_report(result):
            self._open_reports.pop(result[1], None)
        if isinstance(result, Noise):
            if result.kind == "accepting_connection":  # a new connection: any command block is over
                self._in_command = False
            return
        kind = type(result)
        handler = self._handlers.get(kind)
        if handler is not None:
            handler(result)
            if kind in _CONTROL_CHANGES:
                s.control_changes += 1

    def _count(self, metric: str) -> None:
        """One more of a counted event, by the name of the metric that publishes it."""
        counts = self.s.counts
        counts[metric] = counts.get(metric, 0) + 1

    def _counter(self, metric: str) -> Callable[[Any], None]:
        """The handler of an event that is only counted."""
        return lambda ev: self._count(metric)

    @property
    def in_command(self) -> bool:
        """Between a `Cmd:` line and the end of its block (logs/echoes.py sets it where its
        runs of echoes start or end one)."""
        return self._in_command

    @in_command.setter
    def in_command(self, value: bool) -> None:
        self._in_command = value

    def count_commands(self, verbs: Dict[str, int]) -> None:
        """`Cmd:` lines recognised without the parser (logs/echoes.py: none that sets a running
        server's limit): verb -> how many, the verbs in the order they first came. The same
        counts as one Command each (their verbs' labels: the first of a verb decides them
        all), but in_command, which the caller keeps."""
        s = self.s
        commands = s.commands
        for verb, n in verbs.items():
            if verb.startswith("set_"):
                s.limit_commands += n
            verb = command_verb(verb, commands)
            commands[verb] = commands.get(verb, 0) + n

    def count_echoes(self, lines: int, newest: Optional[float]) -> None:
        """control.log command echoes (logs/echoes.py): counted as lines, their time kept."""
        s = self.s
        s.lines["control"] = s.lines.get("control", 0) + lines
        if newest is not None and newest > self._last_ts.get("control", 0.0):
            self._last_ts["control"] = newest

    def queued(self) -> bool:
        """Whether the pending list holds anyone, waiting or handed to a server (logs/echoes.py:
        only then does a client's `Server already exists` change more than control_changes)."""
        return bool(self._pending._all)

    def count_accepted(self, lines: int) -> None:
        """Clients' contexts admitted while nobody is queued, counted among the command echoes
        (logs/echoes.py): what _client_accepted and apply then change."""
        self.s.control_changes += lines

    def count_shutdown_deferrals(self, n: int) -> None:
        """Servers' shutdowns deferred, counted among the command echoes (logs/echoes.py) by
        ShutdownDeferred's handler (it reads no field)."""
        count = self._handlers[ShutdownDeferred]
        for _ in range(n):
            count(None)

    def count_truncated(self, file: str) -> None:
        self.s.truncated[file] = self.s.truncated.get(file, 0) + 1

    def settle(self) -> bool:
        """server.log has been read to its end after control.log: decide every exit seen.

        True if there was one to decide (the state changed)."""
        if not self._pending_exits:
            return False
        self._decide_exits(before=float("inf"))
        return True

    def _decide_exits(self, before: float) -> None:
        pending = self._pending_exits
        while pending and pending[0][0] < before:
            self._decide_exit(*heapq.heappop(pending))

    def _decide_exit(self, exited_at: float, server: int) -> None:
        clients = self._attached.pop(server, None)
        self._active.pop(server, None)
        if clients:
            self._count("mps_server_exits_with_clients_total")
            self._note(LogEvent(exited_at, "exit_with_clients", server, sorted(c for c in clients if c >= 0)[:64]))

    # ------------------------------------------------------- control.log
    def _daemon_started(self, ev: DaemonStarted) -> None:
        # A new daemon: the old one's servers and pending list are gone with it.
        self._forget_daemon()
        self.s.daemon_pid = ev.pid

    def _daemon_exited(self, ev: DaemonExited) -> None:
        self._forget_daemon()

    def _forget_daemon(self) -> None:
        for p in self._pending:
            if p.served_at is not None:
                self._observe(p, p.served_at)
        self._pending.clear()
        for pid in list(self._servers):
            self._drop_server(pid)
        self._in_command = False

    def _client_pushed(self, ev: ClientPushed) -> None:
        uids = self._server_uids
        other_user = len(uids) > 1 or (len(uids) == 1 and ev.uid not in uids)
        reason = USER_SWITCH if other_user else SERVER_STARTING
        self.s.pushes[reason] += 1
        self._pending.push(PendingClient(ev.client_pid, ev.uid, reason, ev.ts))
        self._pusher_pid = ev.pid  # the daemon, where no `Starting control daemon` line was read

    def waiting(self) -> bool:
        """Whether a queued client waits (then /proc is asked about it every few seconds)."""
        return self._pending.waiting > 0

    def forget_gone(self, liveness: Liveness, now: float) -> int:
        """Drop the waiting clients whose process is gone (liveness.py says why and when
        /proc is asked at all); how many. The daemon is the one that logged the pushes."""
        waiting = [p for p in self._pending if p.served_at is None]
        daemon = self.s.daemon_pid if self.s.daemon_pid is not None else self._pusher_pid
        if not waiting or daemon is None or not liveness.sees_daemon(daemon):
            return 0
        gone = [(key, p) for key, p in self._pending.items() if p.served_at is None and liveness.gone(p.pid)]
        for key, p in gone:
            self._pending.remove(key)
            self._count("mps_queued_clients_gone_total")
            self._note(LogEvent(now, "left_queue", None, [p.pid],
                                f"uid {p.uid}, {p.reason}, queued {now - p.pushed_at:.0f} s: its process is gone"))
        return len(gone)

    def _client_accepted(self, ev: ClientAccepted) -> None:
        key = self._pending.first_of(ev.client_pid)
        if key is not None:
            self._observe(self._pending.remove(key), ev.ts)

    def _observe(self, p: PendingClient, admitted_at: float) -> None:
        self.s.queue_wait[p.reason].observe(admitted_at - p.pushed_at)

    def _shutdown_attempt(self, ev: ShutdownAttempt) -> None:
        srv = self._servers.get(ev.server_pid)
        if srv is not None:
            srv.daemon_shutdown = not self._in_command
        if self._in_command:
            return
        # The daemon shuts a server down on its own only for a waiting client of another user.
        switched = self._pending.switch_starting(None if srv is None else srv.uid)
        self.s.pushes[SERVER_STARTING] -= switched
        self.s.pushes[USER_SWITCH] += switched

    def _server_starting(self, ev: ServerStarting) -> None:
        srv = self._server(ev.server_pid, create=True)
        if srv is not None:
            self._count_uid(srv.uid, -1)
            srv.uid = ev.uid
            self._count_uid(srv.uid, 1)

    def _server_ready(self, ev: ServerReady) -> None:
        self._count("mps_server_starts_total")
        srv = self._server(ev.server_pid, create=True)
        if srv is None:
            return
        srv.start_time = ev.ts
        self._pending.serve(srv.uid, ev.ts)

    def _server_exited(self, ev: ServerExited) -> None:
        s = self.s
        status = exit_status(ev.status)
        s.server_exits[status] = s.server_exits.get(status, 0) + 1
        heapq.heappush(self._pending_exits, (ev.ts, ev.server_pid))
        if len(self._pending_exits) > MAX_PENDING_EXITS:  # decide the oldest with what is known
            self._decide_exit(*heapq.heappop(self._pending_exits))
        srv = self._servers.get(ev.server_pid)
        if srv is not None:
            if srv.start_time is None and ev.server_pid not in self._failures_counted:
                self._count("mps_server_start_failures_total")
                self._note(LogEvent(ev.ts, "start_failure", ev.server_pid, detail=srv.start_failure or ""))
            elif srv.daemon_shutdown:
                self._count("mps_server_handoffs_total")
                self._note(LogEvent(ev.ts, "handoff", ev.server_pid,
                                    detail="" if srv.uid is None else f"uid {srv.uid}"))
            # Clients it was handed but that never logged `Server already exists`.
            for key in self._pending.served_of(srv.uid):
                p = self._pending.remove(key)
                self._observe(p, p.served_at)  # type: ignore[arg-type]
        self._drop_server(ev.server_pid)

    def _drop_server(self, pid: int) -> None:
        self._forget_server(pid)
        self._orphans.pop(pid, None)
        self._open_reports.pop(pid, None)
        self._drop_clients_of(pid)
        if pid not in self._exited_set:
            self._exited.append(pid)
            self._exited_set.add(pid)
            if len(self._exited) > MAX_EXITED_MEMORY:
                self._exited_set.discard(self._exited.popleft())

    def _command(self, ev: Command) -> None:
        commands = self.s.commands
        verb = command_verb(ev.verb, commands)
        commands[verb] = commands.get(verb, 0) + 1
        self._in_command = True
        if ev.verb.startswith("set_"):  # the raw verb: `verb` may be bounded to "other"
            self.s.limit_commands += 1
        if verb in ("set_device_pinned_mem_limit", "set_active_thread_percentage"):
            self._set_server_limit(ev)

    def _set_server_limit(self, ev: Command) -> None:
        """`set_device_pinned_mem_limit S D 3G` / `set_active_thread_percentage S 30`: from now on."""
        args = ev.args.split()
        # Bounded ASCII numbers only: anyone who can reach the control pipe writes these lines.
        if not args or not ascii_digits(args[0]) or any(len(a) > 24 for a in args):
            return
        srv = self._facts(int(args[0]))
        if srv is None:
            return
        if ev.verb == "set_active_thread_percentage" and len(args) == 2:
            share = parse_decimal(args[1])
            if share is not None and 0 <= share <= 100:
                srv.change_limit(ev.ts, THREADS, share)
        elif ev.verb == "set_device_pinned_mem_limit" and len(args) == 3 and ascii_digits(args[1]):
            size = parse_size(args[2])
            if size is not None:
                srv.change_limit(ev.ts, int(args[1]), size)

    def _end_command(self, ev: Any) -> None:
        self._in_command = False

    # -------------------------------------------------------- server.log
    def _server(self, pid: int, create: bool) -> Optional[LogServer]:
        """The record of a server control.log announced; with create, announce it."""
        srv = self._servers.get(pid)
        if srv is not None or not create:
            return srv
        if pid in self._exited_set:  # PID reuse: a new server under an old PID
            self._exited_set.discard(pid)
        if len(self._servers) >= MAX_SERVERS:
            self._forget_server(next(iter(self._servers)))
        srv = self._orphans.pop(pid, None) or LogServer(pid)
        self._servers[pid] = srv
        self._count_uid(srv.uid, 1)
        return srv

    def _forget_server(self, pid: int) -> None:
        srv = self._servers.pop(pid, None)
        if srv is not None:
            self._count_uid(srv.uid, -1)

    def _count_uid(self, uid: Optional[int], n: int) -> None:
        """_server_uids follows the uids of _servers: a push asks whether another user's runs."""
        if uid is None:
            return
        left = self._server_uids.get(uid, 0) + n
        if left > 0:
            self._server_uids[uid] = left
        else:
            self._server_uids.pop(uid, None)

    def _set_client(self, pid: int, server: int, since: float) -> None:
        old = self._clients.get(pid)
        if old is not None and old[0] != server:
            _unindex(self._clients_of, old[0], pid)
        self._clients[pid] = (server, since)
        self._clients.move_to_end(pid)
        _index(self._clients_of, server, pid)
        if len(self._clients) > MAX_CLIENTS:
            self._pop_client(next(iter(self._clients)))

    def _pop_client(self, pid: int) -> None:
        old = self._clients.pop(pid, None)
        if old is not None:
            _unindex(self._clients_of, old[0], pid)

    def _drop_clients_of(self, server: int) -> None:
        for pid in self._clients_of.pop(server, ()):
            del self._clients[pid]

    def _facts(self, pid: int) -> Optional[LogServer]:
        """Where server.log facts about server `pid` go: its record, or, while control.log
        has not announced it yet, an orphan record; None for a server that has exited."""
        srv = self._servers.get(pid)
        if srv is not None:
            return srv
        if pid in self._exited_set:
            return None
        srv = self._orphans.get(pid)
        if srv is None:
            srv = self._orphans[pid] = LogServer(pid)
            if len(self._orphans) > MAX_ORPHAN_FACTS:
                self._orphans.popitem(last=False)
        return srv

    def _active_threads(self, ev: ServerActiveThreads) -> None:
        srv = self._facts(ev.pid)
        if srv is not None:
            srv.change_limit(ev.ts, THREADS, ev.percentage)

    def _pinned_limit(self, ev: ServerPinnedLimit) -> None:
        srv = self._facts(ev.pid)
        if srv is not None:
            srv.change_limit(ev.ts, ev.device, ev.limit_bytes)

    def _attach(self, server: int, client: int) -> None:
        clients = self._attached.get(server)
        if clients is None:
            clients = self._attached[server] = set()
            if len(self._attached) > MAX_SERVERS:
                self._attached.pop(next(iter(self._attached)))
        if len(clients) < MAX_ATTACHED:
            clients.add(client)

    # The handlers of server.log's commonest events take their fields: logs/bulk.py calls
    # them straight from a scanned row, without building the event.
    def _context_connected(self, ev: ClientContextConnected) -> None:
        self.context_connected(ev.ts, ev.pid, ev.client_pid)

    def context_connected(self, ts: float, pid: int, client_pid: int) -> None:
        """ClientContextConnected's handler."""
        last_connected = self._last_connected
        last_connected[pid] = client_pid  # a refusal that follows names no PID: this is it
        last_connected.move_to_end(pid)
        if len(last_connected) > MAX_SERVERS:
            last_connected.popitem(last=False)
        known = self._clients.get(client_pid)
        if known is not None and known[0] == pid:
            return  # another context of a process already counted
        self._count("mps_client_connections_total")
        self._attach(pid, client_pid)
        self._set_client(client_pid, pid, ts)

    def _context_active(self, ev: ClientContextActive) -> None:
        self.context_active(ev.ts, ev.pid, ev.client_pid)

    def context_active(self, ts: float, pid: int, client_pid: int) -> None:
        """ClientContextActive's handler."""
        active = self._active.get(pid)
        if active is None:
            active = self._active[pid] = set()
            if len(self._active) > MAX_SERVERS:
                self._active.pop(next(iter(self._active)))
        if len(active) < MAX_ATTACHED:
            active.add(client_pid)

    def _process_connected(self, ev: ClientProcessConnected) -> None:
        self._count("mps_client_connections_total")
        self._unnamed -= 1
        self._attach(ev.pid, self._unnamed)

    def _process_disconnected(self, ev: ClientProcessDisconnected) -> None:
        self.process_disconnected(ev.ts, ev.pid, ev.client_pid)

    def process_disconnected(self, ts: float, pid: int, client_pid: Optional[int]) -> None:
        """ClientProcessDisconnected's handler."""
        attached = self._attached.get(pid)
        if client_pid is not None:
            self._pop_client(client_pid)
            active = self._active.get(pid)
            if active is not None:
                active.discard(client_pid)
            if attached is None or client_pid not in attached:
                return  # not connected (any more): a refused client logs `disconnected` twice
            attached.discard(client_pid)
        elif attached:  # 11.x names no PID: one of its unnamed clients left
            attached.discard(min(attached))
        self._count("mps_client_disconnections_total")

    def _client_rejected(self, ev: ClientRejected) -> None:
        s = self.s
        s.rejections[ev.reason] = s.rejections.get(ev.reason, 0) + 1
        client = self._last_connected.get(ev.pid)
        if ev.limit is not None:
            s.client_limit = ev.limit
        elif ev.reason == "client_limit":  # out of device connections: the ceiling is who got in
            s.client_limit = len(self._active.get(ev.pid, ()))
        self._note(LogEvent(ev.ts, "client_rejected", ev.pid, [] if client is None else [client],
                            detail=f"maximum number of clients ({ev.limit}) reached" if ev.limit is not None else ev.reason))

    def _server_priority(self, ev: ServerPriority) -> None:
        srv = self._facts(ev.pid)
        if srv is not None:
            srv.priority = ev.priority

    def _client_terminated(self, ev: ClientTerminated) -> None:
        last = next((e for e in reversed(self._recent) if e.kind == "client_terminated"), None)
        if last is not None and last.server_pid == ev.pid and last.clients == [ev.client_pid]:
            return  # the same client's next context
        self._count("mps_clients_terminated_total")
        self._note(LogEvent(ev.ts, "client_terminated", ev.pid, [ev.client_pid]))

    def _fatal_error(self, ev: FatalGpuError) -> None:
        if ev.pid in self._open_reports:
            return  # the same report's second line
        self._open_reports[ev.pid] = ""
        self._count("mps_fatal_gpu_errors_total")
        self._note(LogEvent(ev.ts, "fatal_gpu_error", ev.pid, [] if ev.client_pid is None else [ev.client_pid]))

    def _report_heading(self, ev: ReportHeading) -> None:
        if ev.pid in self._open_reports:
            self._open_reports[ev.pid] = ev.topic

    def _report_item(self, ev: ReportItem) -> None:
        topic = self._open_reports.get(ev.pid)
        if topic == "sticky_clients":  # the report names who lost their work: its event lists them
            report = next((e for e in reversed(self._recent) if e.kind == "fatal_gpu_error" and e.server_pid == ev.pid), None)
            if report is not None and ev.value not in report.clients and len(report.clients) < 64:
                report.clients.append(ev.value)

    def _server_exiting(self, ev: ServerExiting) -> None:
        srv = self._servers.get(ev.pid)
        if srv is not None:
            srv.running = False  # control.log's `exited` line removes it
        self._orphans.pop(ev.pid, None)
        self._drop_clients_of(ev.pid)

    def _start_failed(self, ev: ServerStartFailed) -> None:
        srv = self._facts(ev.pid)
        if srv is None:
            return  # control.log saw it exit: counted there
        srv.start_failure = ev.reason[:200]
        if ev.pid not in self._servers and ev.pid not in self._failures_counted:
            # No `Starting new server` for it (control.log lost, cut, or elsewhere): the
            # failure is counted here, and not again if control.log announces it later.
            self._count("mps_server_start_failures_total")
            self._note(LogEvent(ev.ts, "start_failure", ev.pid, detail=srv.start_failure))
            self._failures_counted[ev.pid] = None
            if len(self._failures_counted) > MAX_SERVERS:
                self._failures_counted.popitem(last=False)

    def _note(self, event: LogEvent) -> None:
        self._recent.append(event)

    # -------------------------------------------------------------- output
    def snapshot(self) -> LogSnapshot:
        s = self.s
        waiting = [p for p in self._pending if p.served_at is None]
        queued = {r: 0 for r in REASONS}
        for p in waiting:
            queued[p.reason] += 1
        return LogSnapshot(
            servers={pid: srv.copy() for pid, srv in self._servers.items()},
            client_start_times={pid: since for pid, (_, since) in self._clients.items()},
            client_limits=self._client_limits(),
            queued=queued,
            oldest_queued_since=min((p.pushed_at for p in waiting), default=None),
            queue_wait={r: h.copy() for r, h in s.queue_wait.items()},
            pushes=dict(s.pushes), counts=dict(s.counts),
            rejections=dict(s.rejections), client_limit=s.client_limit, server_exits=dict(s.server_exits),
            commands=dict(s.commands), limit_commands=s.limit_commands, control_changes=s.control_changes,
            lines=dict(s.lines), unrecognized=dict(s.unrecognized),
            truncated=dict(s.truncated), daemon_pid=s.daemon_pid,
            last_line_times=dict(self._last_ts),
            pending=[PendingClient(p.pid, p.uid, p.reason, p.pushed_at) for p in waiting],
            recent_events=[e.copy() for e in self._recent],
        )

    def _client_limits(self) -> Dict[int, ClientLimits]:
        out = {}
        for pid, (server, since) in self._clients.items():
            srv = self._servers.get(server) or self._orphans.get(server)
            limits = srv.limits_at(since) if srv is not None else None
            if limits is not None:
                out[pid] = limits
        return out

    # ------------------------------------------------------ persistence
    def to_dict(self) -> Dict[str, Any]:
        """Everything needed to resume: JSON-safe (the parts and their layout: _PARTS)."""
        return {key: part.save(self) for key, part in _PARTS.items()}

    @classmethod
    def from_dict(cls, d: Dict[str, Any], clock: Callable[[], float] = time.time) -> "LogState":
        """Rebuild from to_dict(), or from what the exporter wrote before the counted events
        were one map (state file version 1). Raises (KeyError, TypeError, ValueError) on a
        malformed dict, NegativeCounter on a counter that went below zero; drops times from
        the future."""
        st = cls(clock)
        d = _upgrade(expect(d, dict, "the saved state"))
        for key, part in _PARTS.items():
            part.load(st, d[key] if part.default is _REQUIRED else d.get(key, part.default))
        st._check_counters()
        return st

    def _check_counters(self) -> None:
        s = self.s
        values: List[float] = [*s.counts.values(), s.limit_commands, s.control_changes]
        for k in _COUNTER_MAPS:
            values.extend(getattr(s, k).values())
        for h in s.queue_wait.values():
            values.extend([*h.counts, h.total, h.implausible])
        bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise NegativeCounter(f"{len(bad)} saved counter(s) below zero or not finite, e.g. {bad[0]!r}")


# ---------------------------------------------------------------- the state file's codec
# One part of the saved state per key: how it is written and read back, and what a file
# written before the part existed means (_REQUIRED: such a file is malformed). The counted
# events are one of them, the map `counts`: a new counted event needs nothing here.
_REQUIRED: Any = object()
_COUNTER_MAPS = ("pushes", "server_exits", "commands", "lines", "unrecognized", "truncated", "rejections")
_SIGNALS = ("limit_commands", "control_changes")  # counted lines nothing exports (LogSnapshot says why)


class _Part(NamedTuple):
    save: Callable[["LogState"], Any]
    load: Callable[["LogState", Any], None]
    default: Any = _REQUIRED


def _counts(value: Any) -> Dict[str, int]:
    """A saved map of counts (metric or label value -> count), its zeros left out."""
    return {str(name): n for name, n in ((name, int(n)) for name, n in expect(value, dict, "counts").items()) if n}


def _load_counts(st: "LogState", value: Any) -> None:
    counts = _counts(value)
    if len(counts) > MAX_COUNTED_EVENTS or any(len(name) > 200 for name in counts):
        raise ValueError(f"{len(counts)} counted events, or a name longer than 200 characters")
    st.s.counts = counts


def _load_signals(st: "LogState", value: Any) -> None:
    value = expect(value, dict, "signals")
    for k in _SIGNALS:
        setattr(st.s, k, int(value.get(k, 0)))


def _load_maps(st: "LogState", value: Any) -> None:
    s, value = st.s, expect(value, dict, "maps")
    for k in _COUNTER_MAPS:
        getattr(s, k).update(_counts(value.get(k, {}) if k == "rejections" else value[k]))
    exits: Dict[str, int] = {}  # a file from before the statuses were bounded
    for status, n in s.server_exits.items():
        label = exit_status(int(status)) if status.lstrip("-").isdigit() and len(status) < 12 else OTHER
        exits[label] = exits.get(label, 0) + n
    s.server_exits = exits


def _load_queue_wait(st: "LogState", value: Any) -> None:
    for r in REASONS:
        h = value[r]
        counts = [int(n) for n in h["counts"]]
        if len(counts) != len(QUEUE_WAIT_BUCKETS) + 1:
            raise ValueError("queue_wait buckets changed")
        st.s.queue_wait[r] = queue_wait_histogram(counts, float(h["sum"]), int(h.get("implausible", 0)))


def _load_daemon(st: "LogState", value: Any) -> None:
    st.s.daemon_pid = value["pid"]  # older files also hold the version and running: nothing reads them
    # A file from before the times were kept per file has one for both: not worth keeping.
    # One from a line dated in the future (before such lines were refused) neither.
    believed = st.clock() + MAX_CLOCK_AHEAD
    st._last_ts = {str(f): float(t) for f, t in (value.get("last_line_times") or {}).items()
                   if f in FILES and float(t) <= believed}


def _load_servers(st: "LogState", value: Any) -> None:
    st._servers = {int(x["pid"]): _server_from(x) for x in value}
    for srv in st._servers.values():
        st._count_uid(srv.uid, 1)


def _load_pending(st: "LogState", value: Any) -> None:
    for a, b, c, e, f in value:
        if c in REASONS:
            st._pending.push(PendingClient(int(a), int(b), str(c), float(e), None if f is None else float(f)))


def _load_clients(st: "LogState", value: Any) -> None:
    for a, b, c in value:
        st._set_client(int(a), int(b), float(c))


def _load_exited(st: "LogState", value: Any) -> None:
    st._exited = deque(int(x) for x in value)
    st._exited_set = set(st._exited)


def _load_recent(st: "LogState", value: Any) -> None:
    st._recent.extend(LogEvent(float(t), str(k), None if p is None else int(p), [int(c) for c in cs], str(x))
                      for t, k, p, cs, x in value)


def _load_client_limit(st: "LogState", value: Any) -> None:
    st.s.client_limit = None if value is None else int(value)


def _by_server(value: Any) -> Dict[int, Set[int]]:
    return {int(a): {int(c) for c in b} for a, b in value}


def _set(attr: str, convert: Callable[[Any], Any]) -> Callable[["LogState", Any], None]:
    """The load of a part kept whole in one attribute of the state machine."""
    return lambda st, value: setattr(st, attr, convert(value))


_PARTS: Dict[str, _Part] = {
    "counts": _Part(lambda st: dict(st.s.counts), _load_counts),
    "signals": _Part(lambda st: {k: getattr(st.s, k) for k in _SIGNALS}, _load_signals),
    "maps": _Part(lambda st: {k: dict(getattr(st.s, k)) for k in _COUNTER_MAPS}, _load_maps),
    "queue_wait": _Part(lambda st: {r: {"counts": h.counts, "sum": h.total, "implausible": h.implausible}
                                    for r, h in st.s.queue_wait.items()}, _load_queue_wait),
    "daemon": _Part(lambda st: {"pid": st.s.daemon_pid, "last_line_times": dict(st._last_ts)}, _load_daemon),
    "servers": _Part(lambda st: [_server_dict(srv) for srv in st._servers.values()], _load_servers),
    "orphans": _Part(lambda st: [_server_dict(srv) for srv in st._orphans.values()],
                     _set("_orphans", lambda v: OrderedDict((int(x["pid"]), _server_from(x)) for x in v))),
    "pending": _Part(lambda st: [[p.pid, p.uid, p.reason, p.pushed_at, p.served_at] for p in st._pending],
                     _load_pending),
    "clients": _Part(lambda st: [[pid, server, since] for pid, (server, since) in st._clients.items()],
                     _load_clients),
    "exited": _Part(lambda st: list(st._exited), _load_exited),
    "in_command": _Part(lambda st: st._in_command, _set("_in_command", bool)),
    "open_reports": _Part(lambda st: [[pid, topic] for pid, topic in st._open_reports.items()],
                          _set("_open_reports", lambda v: {int(a): str(b) for a, b in v})),
    # The parts below are absent from files written before they were kept.
    "recent": _Part(lambda st: [[e.time, e.kind, e.server_pid, e.clients, e.detail] for e in st._recent],
                    _load_recent, []),
    "client_limit": _Part(lambda st: st.s.client_limit, _load_client_limit, None),
    "attached": _Part(lambda st: [[server, sorted(clients)] for server, clients in st._attached.items()],
                      _set("_attached", _by_server), []),
    "active": _Part(lambda st: [[server, sorted(clients)] for server, clients in st._active.items()],
                    _set("_active", _by_server), []),
    "pending_exits": _Part(lambda st: [[ts, server] for ts, server in st._pending_exits],
                           _set("_pending_exits", lambda v: sorted((float(a), int(b)) for a, b in v)), []),
    "unnamed": _Part(lambda st: st._unnamed, _set("_unnamed", int), 0),
}

# Version 1 of the state file kept the counted events as named fields, "counters": these
# are their metrics. Fixed for good: a counter added since is saved in "counts" only.
_V1_COUNTERS = {
    "handoffs": "mps_server_handoffs_total", "shutdown_deferrals": "mps_server_shutdown_deferrals_total",
    "client_connections": "mps_client_connections_total",
    "client_disconnections": "mps_client_disconnections_total", "server_starts": "mps_server_starts_total",
    "server_start_failures": "mps_server_start_failures_total", "fatal_gpu_errors": "mps_fatal_gpu_errors_total",
    "exits_with_clients": "mps_server_exits_with_clients_total", "queued_gone": "mps_queued_clients_gone_total",
    "clients_terminated": "mps_clients_terminated_total",
}


def _upgrade(d: Dict[str, Any]) -> Dict[str, Any]:
    """A version 1 state (tests/logs/fixtures/statefile-v1) as version 2 writes it."""
    if "counts" in d:
        return d
    old = expect(d["counters"], dict, "counters")
    return {**d, "counts": {_V1_COUNTERS[k]: n for k, n in old.items() if k in _V1_COUNTERS},
            "signals": {k: old.get(k, 0) for k in _SIGNALS}}


_REPORT_EVENTS = (FatalGpuError, ReportHeading, ReportItem)
# The events that change who the daemon lists (`get_server_list`, `ps`) or a server's status.
_CONTROL_CHANGES = frozenset({
    DaemonStarted, DaemonExited, ClientPushed, ClientAccepted, ServerStarting, ServerReady, ServerExited,
    ServerExiting, ServerStartFailed, ClientContextConnected, ClientProcessConnected, ClientProcessDisconnected,
    ClientRejected, FatalGpuError,
})


def _recognized(ev: ParseResult) -> None:
    """A line the parser knows that changes nothing kept (the daemon's version: nothing reads it)."""


def _in_report(ev: ParseResult) -> bool:
    """Lines that belong to a fatal error report (it stays open while they come)."""
    return type(ev) in _REPORT_EVENTS or (type(ev) is Noise and ev.kind == "fatal_report")


def _server_dict(srv: LogServer) -> Dict[str, Any]:
    return {"pid": srv.pid, "uid": srv.uid, "start_time": srv.start_time,
            "atp": srv.active_thread_percentage,
            "pinned": [[dev, n] for dev, n in srv.pinned_limits.items()], "running": srv.running,
            "start_failure": srv.start_failure, "daemon_shutdown": srv.daemon_shutdown,
            "limit_changes": [list(c) for c in srv.limit_changes], "priority": srv.priority}


def _device_key(value: Any) -> DeviceKey:
    """A device as the state file keeps it: an ordinal, or a GPU UUID (a short string)."""
    if isinstance(value, str) and value.startswith("GPU-") and len(value) <= 44:
        return value
    return int(value)


def _server_from(x: Dict[str, Any]) -> LogServer:
    return LogServer(int(x["pid"]), x["uid"], x["start_time"], x["atp"],
                     {_device_key(dev): int(n) for dev, n in x["pinned"]}, bool(x["running"]),
                     x["start_failure"], bool(x["daemon_shutdown"]),
                     [(float(a), _device_key(b), float(c)) for a, b, c in x.get("limit_changes", [])],
                     None if x.get("priority") is None else int(x["priority"]))
