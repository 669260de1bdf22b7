"""deploy/systemd: the units pass `systemd-analyze verify`, the flags file parses with
the exporter's own parser, and logrotate rotates the MPS logs by copytruncate."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import subprocess

import pytest

from tests.deploy.helpers import DEPLOY
from tests.support.tools import require

SYSTEMD = os.path.join(DEPLOY, "systemd")
UNITS = ["mps-exporter.service", "nvidia-mps.service"]
SYSTEM_UNITS = "/usr/lib/systemd/system"


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # keys are case-sensitive
    with open(os.path.join(SYSTEMD, name), encoding="utf-8") as f:
        parser.read_file(f)
    return parser


def _executables(unit_text: str):
    """Absolute paths of the programs the unit's Exec*= lines run."""
    for line in unit_text.splitlines():
        m = re.match(r"Exec\w+=[-@:+!]*(/\S+)", line)
        if m:
            yield m.group(1)
            # `sh -c '... | /usr/bin/x'`: the program inside runs too.
            yield from re.findall(r"\| (/\S+)'", line)


@pytest.fixture
def fake_root(tmp_path):
    """A root for `systemd-analyze verify --root`: the units, the system's own units
    (targets they depend on), and stub executables where the unit's programs go.
    Stubs, because the real programs (the exporter's venv, the NVIDIA driver) are
    not installed in CI: verify checks that each ExecStart= program exists and is
    executable, not what it does."""
    require("systemd-analyze")
    assert os.path.isdir(SYSTEM_UNITS), f"{SYSTEM_UNITS} is missing: the systemd package did not install its units"
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / SYSTEM_UNITS.lstrip("/"), symlinks=True)
    etc = root / "etc" / "systemd" / "system"
    etc.mkdir(parents=True)
    for name in UNITS:
        shutil.copy(os.path.join(SYSTEMD, name), etc / name)
        with open(os.path.join(SYSTEMD, name), encoding="utf-8") as f:
            for program in _executables(f.read()):
                stub = root / program.lstrip("/")
                stub.parent.mkdir(parents=True, exist_ok=True)
                stub.write_text("#!/bin/sh\nexit 0\n")
                stub.chmod(0o755)
    return root


def _verify(root, *units):
    paths = [str(root / "etc" / "systemd" / "system" / u) for u in units]
    return subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", *paths],
                          capture_output=True, text=True, timeout=60)


def test_systemd_analyze_verify_accepts_the_units(fake_root):
    result = _verify(fake_root, *UNITS)
    # Unknown keys are only warnings (exit 0): any output counts as a failure.
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr


def test_verify_would_catch_mistakes(fake_root):
    unit = fake_root / "etc" / "systemd" / "system" / "nvidia-mps.service"
    unit.write_text(unit.read_text().replace("RuntimeDirectory=", "RuntimeDirectroy="))
    assert "Unknown key" in _verify(fake_root, "nvidia-mps.service").stderr
    (fake_root / "usr" / "bin" / "nvidia-cuda-mps-control").unlink()
    assert _verify(fake_root, "nvidia-mps.service").returncode != 0


def test_exporter_unit_exposure_stays_low(fake_root):
    """systemd's own hardening score (0 best, 10 worst): 2.7 ("OK") with this unit."""
    unit = fake_root / "etc" / "systemd" / "system" / "mps-exporter.service"
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={fake_root}", str(unit)],
                            capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for mps-exporter.service: (\d+\.\d+)", result.stdout)
    if match is None and "offline" in result.stderr:
        pytest.skip("this systemd-analyze cannot score units offline (systemd < 250)")
    assert match, result.stdout[-500:] + result.stderr
    assert float(match.group(1)) <= 3.0


def test_exporter_unit_hardening():
    service = _unit("mps-exporter.service")["Service"]
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict" and service["ProtectHome"] == "yes"
    assert service["DynamicUser"] == "yes"
    capabilities = {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}
    assert set(service["AmbientCapabilities"].split()) == capabilities
    assert set(service["CapabilityBoundingSet"].split()) == capabilities
    # Settings that would blind the exporter must stay off.
    assert service.get("ProtectProc", "default") == "default"
    assert service.get("ProcSubset", "all") == "all"
    assert service.get("PrivateDevices", "no") == "no" and "ProtectClock" not in service
    assert service["StateDirectory"] == "mps-exporter"
    # A flood of idle connections must not reach the descriptor limit (issue 26).
    assert int(service["LimitNOFILE"]) >= 65536


def test_exporter_unit_documentation_is_this_projects():
    # `systemctl help mps-exporter` opens these: the project's docs (the URL the package
    # metadata names) and the runbook the exporter serves, not a generic Prometheus page.
    with open(os.path.join(DEPLOY, "..", "pyproject.toml"), encoding="utf-8") as f:
        documentation = re.search(r'^Documentation = "([^"]+)"$', f.read(), re.MULTILINE)
    assert documentation is not None
    urls = _unit("mps-exporter.service")["Unit"]["Documentation"].split()
    assert urls == [documentation.group(1), "http://localhost:10138/runbook"]


def test_control_daemon_unit_runs_daemonized():
    service = _unit("nvidia-mps.service")["Service"]
    # In the foreground the daemon writes no control.log; daemonized it leaves its
    # PID in the pipe directory.
    assert service["Type"] == "forking"
    assert service["ExecStart"].split()[1:] == ["-d"]
    assert service["PIDFile"] == f"/run/{service['RuntimeDirectory']}/nvidia-cuda-mps-control.pid"
    assert "quit" in service["ExecStop"]


def test_flags_file_matches_the_units():
    from mps_exporter import cli as exporter_config

    values = {}
    with open(os.path.join(SYSTEMD, "mps-exporter.default"), encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                key, _, value = line.strip().partition("=")
                values[key] = shlex.split(value)[0]
    exec_start = _unit("mps-exporter.service")["Service"]["ExecStart"]
    assert "$MPS_EXPORTER_ARGS" in exec_start.split()
    command, cfg = exporter_config.parse_args(shlex.split(values["MPS_EXPORTER_ARGS"]))
    assert command == "serve"
    mps = _unit("nvidia-mps.service")["Service"]
    # configparser keeps only the last of repeated keys: read the Environment= lines directly.
    with open(os.path.join(SYSTEMD, "nvidia-mps.service"), encoding="utf-8") as f:
        env = dict(re.findall(r"^Environment=(CUDA_MPS_\w+)=(\S+)$", f.read(), re.M))
    (daemon,) = cfg.daemons
    assert daemon.pipe_directory == env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/" + mps["RuntimeDirectory"]
    assert daemon.log_directory == env["CUDA_MPS_LOG_DIRECTORY"] == "/var/log/" + mps["LogsDirectory"]
    assert cfg.state_file.startswith("/var/lib/" + _unit("mps-exporter.service")["Service"]["StateDirectory"] + "/")


def test_logrotate_copies_and_truncates_the_mps_logs(tmp_path):
    logrotate = require("logrotate")
    with open(os.path.join(SYSTEMD, "nvidia-mps.logrotate"), encoding="utf-8") as f:
        config = f.read()
    assert "copytruncate" in config.split()
    logs = tmp_path / "log"
    logs.mkdir()
    config = config.replace("/var/log/nvidia-mps/", f"{logs}/")
    if os.geteuid() != 0:
        config = re.sub(r"^\s*su .*$", "", config, flags=re.M)
    conf = tmp_path / "nvidia-mps.conf"
    conf.write_text(config)
    lines = "[2026-11-21 04:21:26.123 Control  1419] Starting control daemon\n"
    control = logs / "control.log"
    control.write_text(lines)
    # The writer keeps its descriptor, as MPS does: after rotation it must still
    # write into control.log, not into the rotated copy.
    with open(control, "a", encoding="utf-8") as writer:
        result = subprocess.run([logrotate, "--force", "--state", str(tmp_path / "state"), str(conf)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        writer.write("after rotation\n")
    assert (logs / "control.log.1").read_text() == lines  # delaycompress: plain text
    assert control.read_text().lstrip("\0") == "after rotation\n"


@pytest.mark.parametrize("name", ["nvidia-mps.logrotate", "nvidia-mps-collapse.logrotate"])
def test_shipped_logrotate_files_parse_with_the_real_logrotate(tmp_path, name):
    logrotate = require("logrotate")
    # The file as shipped, in a copy of this process's mode: logrotate ignores a
    # configuration writable by group or others, as `git archive` (umask 002) leaves it.
    conf = tmp_path / name
    with open(os.path.join(SYSTEMD, name), encoding="utf-8") as f:
        conf.write_text(f.read())
    conf.chmod(0o644)
    result = subprocess.run([logrotate, "-d", "--state", str(tmp_path / "state"), str(conf)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "error:" not in result.stderr + result.stdout, result.stderr
    assert "/var/log/nvidia-mps/control.log" in result.stderr + result.stdout


def test_collapse_rotation_copies_then_removes_the_copied_blocks(tmp_path):
    """nvidia-mps-collapse.logrotate with the shipped mps-log-collapse: logrotate `copy`,
    then the copied bytes are removed from the front of the log in place (or, where the
    file system cannot collapse, copied on and truncated, as copytruncate)."""
    logrotate = require("logrotate")
    with open(os.path.join(SYSTEMD, "nvidia-mps-collapse.logrotate"), encoding="utf-8") as f:
        config = f.read()
    assert "copy" in config.split() and "copytruncate" not in config.split() and "delaycompress" in config.split()
    script = os.path.join(SYSTEMD, "mps-log-collapse")
    assert os.access(script, os.X_OK)
    with open(script, encoding="utf-8") as f:
        assert f.readline() == "#!/bin/sh\n"
    logs = tmp_path / "log"
    logs.mkdir()
    config = config.replace("/var/log/nvidia-mps/", f"{logs}/").replace("/usr/local/libexec/mps-log-collapse",
                                                                        shlex.quote(script))
    if os.geteuid() != 0:
        config = re.sub(r"^\s*su .*$", "", config, flags=re.M)
    conf = tmp_path / "nvidia-mps.conf"
    conf.write_text(config)
    block = os.statvfs(logs).f_frsize
    lines = "".join(f"[2026-11-21 04:21:26.123 Control  1419] line {i} {'x' * 40}\n" for i in range(200))
    assert len(lines) > 2 * block
    control = logs / "control.log"
    control.write_text(lines)
    with open(control, "a", encoding="utf-8") as writer:  # MPS's descriptor, kept
        result = subprocess.run([logrotate, "--force", "--state", str(tmp_path / "state"), str(conf)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        writer.write("after rotation\n")
    copy = (logs / "control.log.1").read_text()
    assert copy.startswith(lines)  # delaycompress: plain text
    if "fallocate --collapse-range failed" in result.stderr:  # tmpfs, btrfs, NFS: copytruncate
        assert control.read_text().lstrip("\0") == "after rotation\n"
    else:
        n = len(lines) - len(lines) % block
        assert copy == lines and control.read_text() == lines[n:] + "after rotation\n"


@pytest.mark.parametrize("platform,daemons,discover", [
    ("ecs", [("default", "/run/mps-ecs", "/var/log/nvidia-mps")], []),
    ("slurm", [], [("glob", "/run/mps-slurm/*")]),
])
def test_platform_flags_files_parse_as_documented(platform, daemons, discover):
    """docs/deploy.md's ECS and Slurm variants of the flags file: the exporter's own parser
    reads them, with the daemon directories those sections name (issue 41)."""
    from mps_exporter import cli as exporter_config

    with open(os.path.join(SYSTEMD, f"mps-exporter.{platform}.default"), encoding="utf-8") as f:
        (line,) = [line for line in f if line.startswith("MPS_EXPORTER_ARGS=")]
    command, cfg = exporter_config.parse_args(shlex.split(line.partition("=")[2])[0].split())
    assert command == "serve" and cfg.discover_processes
    assert [(d.name, d.pipe_directory, d.log_directory) for d in cfg.daemons] == daemons
    assert [(r.layout, r.path) for r in cfg.discover] == discover
    assert cfg.state_file.startswith("/var/lib/" + _unit("mps-exporter.service")["Service"]["StateDirectory"] + "/")
    if platform == "ecs":
        assert "/var/lib/docker/containers" in cfg.runtime_roots
