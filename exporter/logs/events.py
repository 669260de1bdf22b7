"""What one MPS log line means: the events the parser returns.

Every event is a NamedTuple (cheap to build, compares by value) whose first
two fields are `ts` (unix time of the line) and `pid` (the PID in the line's
header: the control daemon, a server, or a freshly forked server). The state
machine (state.py) dispatches on the type.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union


# ------------------------------------------------------------ control.log
class DaemonStarted(NamedTuple):
    """`Starting control daemon using socket ...` (13.x) or `Start` (11.x)."""

    ts: float
    pid: int


class DaemonVersion(NamedTuple):
    """`CUDA MPS Control binary version: 13000`."""

    ts: float
    pid: int
    version: str


class DaemonExited(NamedTuple):
    """`Exit with status 0`: the control daemon ends (after `quit`)."""

    ts: float
    pid: int
    status: int


class ClientPushed(NamedTuple):
    """`NEW CLIENT P from user U: Server is not ready, push client to pending list`."""

    ts: float
    pid: int
    client_pid: int
    uid: int


class ClientAccepted(NamedTuple):
    """`NEW CLIENT P from user U: Server already exists` (one per client context)."""

    ts: float
    pid: int
    client_pid: int
    uid: int


class ServerStarting(NamedTuple):
    """`Starting new server S for user U` (logged by the forked server, pid == S)."""

    ts: float
    pid: int
    server_pid: int
    uid: int


class ServerReady(NamedTuple):
    """`NEW SERVER S: Ready`."""

    ts: float
    pid: int
    server_pid: int


class ServerExited(NamedTuple):
    """`Server S exited with status X`."""

    ts: float
    pid: int
    server_pid: int
    status: int


class ShutdownAttempt(NamedTuple):
    """`Try shutting down server S, backoff is enabled|disabled`."""

    ts: float
    pid: int
    server_pid: int


class ShutdownDeferred(NamedTuple):
    """`Server S has N active worker threads. Server will not shutdown.`"""

    ts: float
    pid: int
    server_pid: int
    threads: int


class UiOpened(NamedTuple):
    """`NEW UI`: a control client (nvidia-cuda-mps-control) connected."""

    ts: float
    pid: int


class AcceptFailed(NamedTuple):
    """`Unable to accept connection`: the control daemon's accept() failed; the client or
    control command connecting got no answer (5 times as 208 clients arrived at once on
    4 x H200, driver 580)."""

    ts: float
    pid: int


class UiClosed(NamedTuple):
    """`UI closed`: the end of a command's output."""

    ts: float
    pid: int


class Command(NamedTuple):
    """`Cmd:verb args...`: a command the daemon received."""

    ts: float
    pid: int
    verb: str
    args: str


class CommandOutput(NamedTuple):
    """A line a command printed (a bare PID, `ACTIVE`, a `ps` row, `Server 713 not found`, ...)."""

    ts: float
    pid: int
    text: str


# ------------------------------------------------------------- server.log
class ServerActiveThreads(NamedTuple):
    """`Active Threads Percentage set to 25.0` (13.x) / `activeThreadsPercentage set to 33.000000` (11.x)."""

    ts: float
    pid: int
    percentage: float


# How MPS names a device in a limit: the daemon's own ordinal (counted in its
# CUDA_VISIBLE_DEVICES), or a GPU UUID or prefix of one (`set_..._limit GPU-<uuid> 2G`).
DeviceKey = Union[int, str]


class ServerPinnedLimit(NamedTuple):
    """`Device pinned memory limit for device 0 set to 0x80000000 bytes` (or `for device
    GPU-<uuid> set to ...` after a limit set by UUID, as NVIDIA's DRA driver sets them)."""

    ts: float
    pid: int
    device: DeviceKey
    limit_bytes: int


class ClientContextConnected(NamedTuple):
    """`Client {PID: P, Context ID: C} connected` (13.x), `New client P connected` (pre-Volta).

    One per context: the state machine counts a process once.
    """

    ts: float
    pid: int
    client_pid: int


class ClientContextActive(NamedTuple):
    """`Status of client {PID: P, Context ID: C} is ACTIVE`: MPS gave the context a device.
    A client refused at the device connection limit has a context connected, never ACTIVE."""

    ts: float
    pid: int
    client_pid: int


class ClientProcessConnected(NamedTuple):
    """A client process connected, PID not logged (11.x/12.x `Volta MPS: Device ... is associated`)."""

    ts: float
    pid: int


class ClientProcessDisconnected(NamedTuple):
    """`Client process P disconnected` (13.x), `Client P disconnected` (pre-Volta),
    `Volta MPS: Client process disconnected` (11.x/12.x, client_pid None)."""

    ts: float
    pid: int
    client_pid: Optional[int]


class FatalGpuError(NamedTuple):
    """`Client {PID: P, Context: C} encountered a fatal GPU error.` (client_pid set) or
    `Server is handling a fatal GPU error.` (client_pid None). One report may hold both.
    11.x/12.x servers write the report's lines behind `Volta MPS: `."""

    ts: float
    pid: int
    client_pid: Optional[int]


class ReportHeading(NamedTuple):
    """`The following devices will be reset:` / `The following client process have a sticky error set:`.

    The bare numbers after it (ReportItem) are its list.
    """

    ts: float
    pid: int
    topic: str  # "reset_devices" or "sticky_clients"


class ReportItem(NamedTuple):
    """A bare number in server.log: an item of the list the last ReportHeading opened."""

    ts: float
    pid: int
    value: int


class ServerPriority(NamedTuple):
    """`Server Priority set to 1`: the priority the server runs its clients at (the daemon's
    `set_default_client_priority` when it started); clients without CUDA_MPS_CLIENT_PRIORITY
    run at it."""

    ts: float
    pid: int
    priority: int


class ClientTerminated(NamedTuple):
    """`MPS server requesting client {PID: 675, Context ID: 1} to exit`: an operator's
    `terminate_client <server> <client>` (followed by `Client termination succeeded.`)."""

    ts: float
    pid: int
    client_pid: int


class ClientRejected(NamedTuple):
    """`Failed to accept new client. Maximum number of clients (48) reached.`: a client refused.

    `limit` is the number the line gives (None for a refusal of another kind)."""

    ts: float
    pid: int
    reason: str  # "client_limit", "invalid_credentials" or "other"
    limit: Optional[int]


class ServerExiting(NamedTuple):
    """`Exiting` in server.log: the server process ends."""

    ts: float
    pid: int


class ServerStartFailed(NamedTuple):
    """`MPS server failed to start` (pre-Volta) / `Failed to start : invalid argument` (Legacy Server)."""

    ts: float
    pid: int
    reason: str


# ----------------------------------------------------------------- both
class Noise(NamedTuple):
    """A line that is understood and carries nothing the metrics need."""

    ts: float
    pid: int
    kind: str


class Unrecognized(NamedTuple):
    """No rule matched. `reason` says why; `ts` is None when there was no header."""

    ts: Optional[float]
    pid: Optional[int]
    reason: str


Event = Union[
    DaemonStarted, DaemonVersion, DaemonExited, ClientPushed, ClientAccepted, ServerStarting,
    ServerReady, ServerExited, ShutdownAttempt, ShutdownDeferred, AcceptFailed, UiOpened, UiClosed, Command,
    CommandOutput, ServerActiveThreads, ServerPinnedLimit, ClientContextConnected, ClientContextActive,
    ClientProcessConnected, ClientProcessDisconnected, FatalGpuError, ReportHeading, ReportItem,
    ClientRejected, ServerExiting, ServerStartFailed, ServerPriority, ClientTerminated, Noise,
]

ParseResult = Union[Event, Unrecognized]

FILES: Tuple[str, str] = ("control", "server")

# Why a log file cannot be read: the values of mps_log_read_errors_total's `reason`.
MISSING_DIRECTORY = "missing_directory"  # the log directory does not exist (the file's absence alone is normal)
NOT_A_DIRECTORY = "not_a_directory"  # the log directory is a file
PERMISSION_DENIED = "permission_denied"
NOT_REGULAR_FILE = "not_regular_file"  # a FIFO, directory, socket, device or symbolic link under the log's name
IO_ERROR = "io_error"  # any other OSError from stat, open or read
INTERNAL_ERROR = "internal_error"  # a bug in the pipeline while handling the file's lines
READ_ERROR_REASONS: Tuple[str, ...] = (MISSING_DIRECTORY, NOT_A_DIRECTORY, PERMISSION_DENIED,
                                       NOT_REGULAR_FILE, IO_ERROR, INTERNAL_ERROR)

# Why a state file (or a daemon's entry in it) was not used, or could not be written:
UNREADABLE = "unreadable"  # not JSON, or cannot be read (a directory at the path, permissions)
SHAPE = "shape"  # JSON of the wrong shape or types, or another format version
NEGATIVE_COUNTER = "negative_counter"  # a counter, histogram count or sum below zero (or not finite)
POSITION = "position"  # an offset past its file's end, or the file's content is not what was saved
SAVE_FAILED = "save_failed"
STATE_FILE_ERROR_REASONS = (UNREADABLE, SHAPE, NEGATIVE_COUNTER, POSITION, SAVE_FAILED)
