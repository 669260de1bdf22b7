"""Whether a client on a daemon's pending list still exists: the one thing the logs never say.

A client killed while it waits on the pending list (a job cancelled in its queue)
leaves no line: control.log keeps it pending until a server of its user starts, which
takes as long as the other user's server runs. It would count in
`mps_queued_clients` and keep `MpsClientsQueuedBehindOtherUser` firing all that time.
On an H100 (driver 580) the daemon then handed the dead client's connection to the
new server (`User did not send valid credentials`) and stopped answering
(tests/gpu/reports/h100-queuedeath*, three runs out of three).

So the log pipeline asks /proc about its waiting clients, but only where /proc shows
the daemon that wrote the log: the PIDs in the log are then this /proc's PIDs. Logs
read on another machine or replayed from a bundle (the daemon is not here) keep every
pending client, as before. A PID reused by a new process keeps its client counted:
telling them apart would trust the log's clock and time zone.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple


def _stat_state(text: str) -> Optional[str]:
    """Field 3 of /proc/PID/stat (R, S, Z, ...); the command before it may hold spaces and ')'."""
    rest = text[text.rfind(")") + 2:]
    return rest[:1] or None


class ProcLiveness:
    """Answers from a /proc tree (the host's, mounted elsewhere in a container)."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root
        self._daemon: Optional[Tuple[int, bool]] = None  # (pid, its cmdline is the control daemon's)

    def sees_daemon(self, pid: int) -> bool:
        """`pid` is a running nvidia-cuda-mps-control here (asked once per daemon PID)."""
        if self._daemon is None or self._daemon[0] != pid:
            try:
                with open(os.path.join(self.root, str(pid), "cmdline"), "rb") as f:
                    cmdline = f.read()
            except OSError:
                return False  # not (yet) visible: asked again next time
            if not cmdline:  # in exec() (its arguments not yet set up), or a zombie: ask again
                return False
            self._daemon = (pid, b"nvidia-cuda-mps-control" in cmdline)
        return self._daemon[1]

    def gone(self, pid: int) -> bool:
        """No process `pid` runs here (none, or a zombie); False when /proc cannot tell."""
        try:
            with open(os.path.join(self.root, str(pid), "stat"), encoding="ascii", errors="replace") as f:
                state = _stat_state(f.read())
        except (FileNotFoundError, ProcessLookupError):
            return True
        except OSError:
            return False
        return state in ("Z", "X")
