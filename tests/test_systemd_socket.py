"""`--web.systemd-socket`: socket activation, as node_exporter and dcgm-exporter offer it,
driven by the real `systemd-socket-activate` (systemd package): it binds the port, starts
the exporter at the first connection and passes the listening socket as fd 3."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.support.prometheus import free_port, stop_process
from tests.support.tools import require


def test_the_exporter_serves_on_the_socket_systemd_passes(tmp_path):
    activate = require("systemd-socket-activate")
    port = free_port()
    proc = subprocess.Popen(
        [activate, "--listen", f"127.0.0.1:{port}", sys.executable, "-m", "mps_exporter.cli",
         "--web.systemd-socket", "--web.listen-address", "127.0.0.1:1",  # never bound: the socket is used
         "--mps.control-binary", str(tmp_path / "no-control"), "--mps.log-directory", str(tmp_path),
         "--no-collector.nvml", "--no-collector.dcgm"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        body = ""
        while not body:  # the first connection starts the exporter; it waits in the backlog
            assert proc.poll() is None and time.monotonic() < deadline, "the exporter did not answer"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                    assert r.status == 200
                    body = r.read().decode()
            except OSError:
                time.sleep(0.2)
        assert 'mps_exporter_collector_success{collector="control"}' in body
    finally:
        stop_process(proc)
        err = proc.stderr.read() if proc.stderr else ""
    listening = [line for line in err.splitlines() if "listening on" in line]
    assert len(listening) == 1 and f"127.0.0.1:{port}" in listening[0], err


@pytest.mark.parametrize("environment, message", [
    ({}, "systemd passed no socket"),
    ({"LISTEN_PID": "1", "LISTEN_FDS": "1"}, "the sockets are for process 1"),
    ({"LISTEN_FDS": "2"}, "systemd passed 2 sockets"),
])
def test_without_systemd_s_socket_it_is_one_line_and_exit_2(environment, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    # LISTEN_PID names the process itself where the case wants it to (exec keeps the PID).
    script = "".join(f"export {k}={v}; " for k, v in environment.items())
    if "LISTEN_FDS" in environment and "LISTEN_PID" not in environment:
        script += "export LISTEN_PID=$$; "
    res = subprocess.run(["sh", "-c", script + f'exec "{sys.executable}" -m mps_exporter.cli --web.systemd-socket'],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mps-exporter: error: --web.systemd-socket: ") and message in lines[0]
