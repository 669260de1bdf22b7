"""The `mps-exporter` program itself, as a user runs it on a machine without a GPU."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.data import CAPTURE
from tests.support.tools import require
EXE = [sys.executable, "-m", "mps_exporter.cli"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def test_serves_without_gpu_and_keeps_serving(tmp_path):
    port = free_port()
    (tmp_path / "log").mkdir()
    proc = subprocess.Popen(EXE + ["--web.listen-address", f"127.0.0.1:{port}", "--mps.pipe-directory", str(tmp_path / "pipe"),
                                   "--mps.log-directory", str(tmp_path / "log"),
                                   "--mps.control-binary", str(tmp_path / "no-such-nvidia-cuda-mps-control")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 20
        while True:
            try:
                status, body = get(f"http://127.0.0.1:{port}/metrics")
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "exporter did not come up"
                time.sleep(0.2)
        assert status == 200
        assert 'mps_exporter_collector_success{collector="nvml"} 0.0' in body
        assert 'mps_control_daemon_up{daemon="default"} 0.0' in body
        assert 'mps_exporter_build_info{' in body
        # the log files do not exist yet (MPS has not started): not an error
        assert 'mps_exporter_collector_success{collector="logs"} 1.0' in body
        for _ in range(3):  # and it keeps serving
            assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200
        status, landing = get(f"http://127.0.0.1:{port}/")
        assert status == 200 and "/metrics" in landing
        assert get(f"http://127.0.0.1:{port}/-/healthy")[0] == 200
        assert proc.poll() is None
    finally:
        proc.terminate()
        out = proc.communicate(timeout=10)[0]
    assert proc.returncode == 0, out
    # failures are logged once, in logfmt, not on every scrape
    assert out.count("collector nvml failed") == 1, out


def test_dump_of_a_captured_log_directory_passes_promtool():
    res = subprocess.run(EXE + ["dump", "--mps.log-directory", str(CAPTURE), "--mps.pipe-directory", "/nonexistent",
                                "--mps.control-binary", "/nonexistent/nvidia-cuda-mps-control", "--mps.log-timezone", "UTC"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert 'mps_fatal_gpu_errors_total{daemon="default"} 1.0' in res.stdout
    assert 'mps_server_handoffs_total{daemon="default"} 4.0' in res.stdout
    check = subprocess.run([require("promtool"), "check", "metrics"], input=res.stdout, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), check.stdout + check.stderr


@pytest.mark.parametrize("args,message", [
    (["--no-such-flag"], "unrecognized arguments"),
    (["--mps.command-timeout", "0"], "--mps.command-timeout must be positive"),
    (["--web.telemetry-path", "metrics"], "must start with '/'"),
    (["--config.file", "/nonexistent.yml"], "cannot read config file"),
    (["--log.level", "loud"], "invalid choice"),
])
def test_bad_flags_give_one_line_and_exit_2(args, message):
    res = subprocess.run(EXE + args, capture_output=True, text=True, timeout=30)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], res.stderr


@pytest.mark.parametrize("content,message", [
    ("daemons: [", "not valid YAML"),
    ("daemons: []", "non-empty list under 'daemons'"),
    ("daemons:\n  - name: a\n", "needs 'name' and 'pipe_directory'"),
    ("daemons:\n  - {name: a, pipe_directory: /p}\n  - {name: a, pipe_directory: /q}\n", "appears twice"),
    ("daemons:\n  - {name: a, pipe_directory: /p, colour: red}\n", "unknown keys"),
])
def test_bad_config_file(tmp_path, content, message):
    f = tmp_path / "mps.yml"
    f.write_text(content)
    res = subprocess.run(EXE + ["dump", "--config.file", str(f)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and message in res.stderr, res.stderr


def test_config_file_names_the_daemons(tmp_path):
    f = tmp_path / "mps.yml"
    f.write_text(f"daemons:\n  - {{name: train, pipe_directory: {tmp_path}/p1, log_directory: {tmp_path}/l1}}\n"
                 f"  - {{name: infer, pipe_directory: {tmp_path}/p2}}\n")
    res = subprocess.run(EXE + ["dump", "--config.file", str(f), "--no-collector.nvml",
                                "--mps.control-binary", "/nonexistent/x"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert 'mps_control_daemon_up{daemon="train"} 0.0' in res.stdout
    assert 'mps_control_daemon_up{daemon="infer"} 0.0' in res.stdout


def test_taken_port_is_one_error_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run(EXE + ["--web.listen-address", f"127.0.0.1:{port}", "--no-collector.logs",
                                    "--mps.control-binary", "/nonexistent/x"],
                             capture_output=True, text=True, timeout=30)
    assert res.returncode == 1
    assert "cannot listen on 127.0.0.1:" in res.stderr and "Traceback" not in res.stderr, res.stderr
