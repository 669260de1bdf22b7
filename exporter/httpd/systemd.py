"""Socket activation (`--web.systemd-socket`, as exporter-toolkit's exporters offer it):
systemd, or `systemd-socket-activate`, binds the listening socket and passes it to the
exporter as file descriptor 3, naming this process in LISTEN_PID and the count in
LISTEN_FDS (sd_listen_fds(3)). The exporter then binds nothing itself: the port is open
before it starts, and a privileged port needs no privilege in the exporter."""

from __future__ import annotations

import os
import socket

from ..errors import ConfigError

FIRST_FD = 3  # SD_LISTEN_FDS_START


def listening_socket() -> socket.socket:
    """The one stream socket systemd passed this process; ConfigError when there is none.
    The variables are removed, so no child process takes the socket for its own."""
    pid, count = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if not pid or not count:
        raise ConfigError("--web.systemd-socket: systemd passed no socket (LISTEN_PID and LISTEN_FDS are not set; "
                          "start it from a .socket unit or systemd-socket-activate)")
    if not pid.isdigit() or int(pid) != os.getpid():
        raise ConfigError(f"--web.systemd-socket: the sockets are for process {pid}, not this one ({os.getpid()})")
    if count != "1":
        raise ConfigError(f"--web.systemd-socket: systemd passed {count} sockets; give the .socket unit exactly one "
                          "ListenStream=")
    try:
        sock = socket.socket(fileno=FIRST_FD)
    except OSError as e:
        raise ConfigError(f"--web.systemd-socket: file descriptor {FIRST_FD} is not a socket: {e.strerror or e}") from e
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ConfigError(f"--web.systemd-socket: file descriptor {FIRST_FD} is not a listening stream socket "
                          "(ListenStream=, not ListenDatagram= or Accept=yes)")
    return sock
