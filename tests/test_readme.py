"""README.md's commands, run as a new user runs them, from a plain copy of the repository.

The copy is installed with `pip install .` (into a private directory, without
dependencies: they are the suite's own), so what the README promises is checked on what
the package really ships (the recorded session inside the wheel, the console script),
not on this checkout's source tree. Where a command needs a GPU node's paths or the
default port, the test gives private ones: nothing outside the copy and temporary
directories is read or bound.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.prometheus import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# What a clone has (tracked files): leave out what building and testing add.
NOT_IN_A_CLONE = shutil.ignore_patterns(".git", ".venv*", "venv", "__pycache__", "*.egg-info", "build", "dist",
                                        ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", ".gpu-*")


def readme_command(prefix: str) -> str:
    """The indented README line that starts with `prefix` (it must be there)."""
    found = re.findall(rf"^    ({re.escape(prefix)}.*)$", README, re.MULTILINE)
    assert found, f"README.md no longer shows a command starting with {prefix!r}"
    return found[0]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`pip install .` from a plain copy -> (environment, mps-exporter program)."""
    work = tmp_path_factory.mktemp("readme")
    clone = work / "clone"
    shutil.copytree(ROOT, clone, ignore=NOT_IN_A_CLONE)
    install = readme_command("pip install . && mps-exporter replay").split(" && ")[0]
    assert install == "pip install ."
    site = work / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                          "--target", str(site), "."], cwd=clone, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    program = site / "bin" / "mps-exporter"
    assert program.exists()
    # The installed package, not this checkout, answers.
    where = subprocess.run([sys.executable, "-c", "import mps_exporter; print(mps_exporter.__file__)"],
                           env=env, cwd=work, capture_output=True, text=True, timeout=60).stdout
    assert where.startswith(str(site)), where
    return env, str(program), work


def run(installed, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env, program, work = installed
    return subprocess.run([sys.executable, program, *args], env=env, cwd=work, capture_output=True, text=True,
                          timeout=timeout)


def get(url: str) -> "tuple[int, str]":
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def test_metrics_prints_the_readme_table(installed):
    res = run(installed, "metrics")
    assert res.returncode == 0, res.stderr
    table = README.split("<!-- metrics:begin -->\n", 1)[1].split("<!-- metrics:end -->", 1)[0]
    assert res.stdout == table


def test_version(installed):
    res = run(installed, "--version")
    assert res.returncode == 0 and res.stdout.startswith("mps-exporter "), res


def test_dump_runs_every_collector_once_and_exits(installed, tmp_path):
    # README's node command, its two directories made private; no GPU here, so NVML fails
    # (its own series only) and the exposition still comes out.
    command = readme_command("pip install . && mps-exporter --mps.pipe-directory").split(" && ")[1].split()
    assert command[1:] == ["--mps.pipe-directory", "/tmp/nvidia-mps", "--mps.log-directory", "/var/log/nvidia-mps"]
    assert "`mps-exporter dump` runs every collector once" in README
    res = run(installed, "dump", "--mps.pipe-directory", str(tmp_path / "pipe"),
              "--mps.log-directory", str(tmp_path / "log"), "--mps.control-binary", str(tmp_path / "no-control"))
    assert res.returncode == 0, res.stderr
    assert 'mps_exporter_collector_success{collector="nvml"} 0.0' in res.stdout
    assert "mps_exporter_build_info{" in res.stdout


def test_replay_serves_the_shipped_session_and_its_counters_go_on(installed):
    assert readme_command("pip install . && mps-exporter replay") == "pip install . && mps-exporter replay"
    port = free_port()
    env, program, work = installed
    # `--speed 30`: README's `--speed` flag, so that passes of the 90 s session come quickly.
    proc = subprocess.Popen([sys.executable, program, "replay", "--web.listen-address", f"127.0.0.1:{port}",
                             "--speed", "30"], env=env, cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        fatal = 0.0
        while fatal < 2:  # a second pass adds to the counter: README says so
            assert proc.poll() is None and time.monotonic() < deadline, "replay did not get to its second pass"
            try:
                status, body = get(f"{base}/metrics")
            except OSError:
                time.sleep(0.2)
                continue
            assert status == 200
            found = re.search(r'^mps_fatal_gpu_errors_total\{daemon="[^"]*"\} (\S+)$', body, re.MULTILINE)
            fatal = float(found.group(1)) if found else 0.0
            time.sleep(0.2)
        assert get(f"{base}/")[0] == 200 and get(f"{base}/-/healthy")[0] == 200
    finally:
        stop_process(proc)
        err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 0, err
    listening = [line for line in err.splitlines() if "listening on" in line]
    assert len(listening) == 1 and f"127.0.0.1:{port}" in listening[0], err


def test_status_reads_the_shipped_session_as_readme_shows(installed):
    # README's bundle command, on the session inside the installed package: the wheel ships
    # the status package, and its first sample is what it prints.
    readme_command("mps-exporter status --bundle FILE --at ")
    bundle_name, at = re.search(r"`mps-exporter status --bundle exporter/data/(\S+) --at ([\d.]+)`", README).groups()
    env, _, work = installed
    bundle = Path(env["PYTHONPATH"]) / "mps_exporter" / "data" / bundle_name
    res = run(installed, "status", "--bundle", str(bundle), "--at", at)
    assert res.returncode == 0, res.stderr
    sample = README.split("## On the node: `mps-exporter status`\n", 1)[1].split("```\n", 2)[1]
    assert res.stdout == sample
