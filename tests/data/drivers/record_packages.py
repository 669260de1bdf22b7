#!/usr/bin/env python3
"""Record each driver family's control answers from NVIDIA's real `nvidia-cuda-mps-control`.

Run by hand, never by CI (it downloads from deb.debian.org and archive.ubuntu.com):

    .venv/bin/python tests/data/drivers/record_packages.py [--cache DIR] [FAMILY ...]

Debian's archive ships NVIDIA's own `nvidia-cuda-mps` package for several driver
families, Ubuntu's `restricted` component its `nvidia-compute-utils-<family>` packages
(the same program, with the MPS server and man page) for others. The control program
links only libc, pthread, rt and dl, so its daemon starts and answers on a machine
without a GPU: every command that needs no MPS server gets its real answer; every command
about a server answers `Server 1 not found` (none can start).

For each family this script downloads the package, checks its sha256 against the one
below (the archive's Packages index of 2026-11-28), unpacks it (`dpkg-deb -x`), starts a
control daemon with private pipe and log directories (`-d`), sends each verb of the
exporter's allowlist (`control.READ_ONLY_COMMANDS`) with the arguments the exporter sends
(server pid 1, device 0 or a GPU UUID), then `help`, one process per command as the
exporter runs them, and `quit`. It writes, under tests/data/drivers/<family>/:

- `answers.txt`: "> command", what the program printed (stdout and stderr), `rc=N`;
- `control.recorded.log`: the daemon's control.log of that session;
- `version.txt`: what `nvidia-cuda-mps-control -v` printed with the daemon up;
- the part of `SOURCE` from the marker below on: the package, its sha256, the date, and
  the COMMANDS its man page lists (the verbs the family's program documents).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, NamedTuple, Sequence, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository: its exporter imports as mps_exporter

from mps_exporter.sources.control import READ_ONLY_COMMANDS, ControlClient  # noqa: E402

# archive -> where its packages are
MIRRORS = {"Debian": "https://deb.debian.org/debian", "Ubuntu": "https://archive.ubuntu.com/ubuntu"}
MARKER = "## Recorded from the package (written by record_packages.py)"
PROGRAM = "usr/bin/nvidia-cuda-mps-control"
MAN_PAGE = "usr/share/man/man1/nvidia-cuda-mps-control.1.gz"


class Package(NamedTuple):
    family: str  # the directory under tests/data/drivers
    archive: str  # a key of MIRRORS
    pool: str  # the package's directory under the mirror
    name: str  # the package's name
    version: str  # the archive's version of the package
    suite: str  # the suite it was taken from
    sha256: str  # as the suite's Packages index lists it
    driver: bool = False  # its daemon needs the NVIDIA driver to start (below)

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version}_amd64.deb"

    @property
    def url(self) -> str:
        return f"{MIRRORS[self.archive]}/{self.pool}/{self.filename}"


DEBIAN_POOL = "pool/non-free/n/nvidia-graphics-drivers"
# Ubuntu's nvidia-compute-utils-525 of jammy and focal, and -570 of jammy and noble, are
# transitional packages (no program: they depend on -535 and -580); the last builds with
# the program are in the LTS suites below (bionic for 525; focal and the ended plucky for
# 570, focal's kept: an LTS suite stays on archive.ubuntu.com).
PACKAGES = (
    Package("470", "Debian", DEBIAN_POOL, "nvidia-cuda-mps", "470.256.02-2", "bullseye",
            "ee5b7389ad930a887ce725f9fe5e980fcf59e25b60e63371b12064a279610224"),
    Package("525", "Ubuntu", "pool/restricted/n/nvidia-graphics-drivers-525", "nvidia-compute-utils-525",
            "525.105.17-0ubuntu0.18.04.1", "bionic-updates",
            "4b3b901908ed75896e5cd5a06ab16c186d6ab5053ce3881fcbefed79ea6540c1"),
    Package("535", "Debian", DEBIAN_POOL, "nvidia-cuda-mps", "535.261.03-1", "bookworm",
            "1341544805aa9c839af45bac5a4bd697cb3eb43105eec439bfba60a8e13ba35a"),
    Package("550", "Debian", DEBIAN_POOL, "nvidia-cuda-mps", "550.163.01-5.1", "sid",
            "1ccfe0d531ba35df61c25c327a544e7c820139edbd363805c8ce54a8e58e23b7"),
    Package("555", "Debian", DEBIAN_POOL, "nvidia-cuda-mps", "555.58.02-4", "experimental",
            "7f68f5de74d4ab4fa3182e23bcb7eaa8fd86e54cb8f406f4bebdee963cd4b725"),
    Package("570", "Ubuntu", "pool/restricted/n/nvidia-graphics-drivers-570", "nvidia-compute-utils-570",
            "570.133.07-0ubuntu0.20.04.1", "focal-updates",
            "d9d7d68b6a05651a5791128e834172f8e8f12d39a95748dd4e1fc14839242473"),
    # R580's daemon loads libcuda.so.1 and opens the driver (/dev/nvidiactl) when it starts:
    # without libcuda it exits 244, with libcuda but no driver loaded 100, before it listens
    # (every 580 build of Ubuntu's archive, 580.82.07 to 580.178.04). It is recorded on a
    # GPU node only, with that node's libcuda: `--cache DIR` with the .deb in DIR, as
    # such a node reaches no archive.
    Package("580", "Ubuntu", "pool/restricted/n/nvidia-graphics-drivers-580", "nvidia-compute-utils-580",
            "580.178.04-0ubuntu0.24.04.1", "noble-updates",
            "2561d32edc1becd0d9595471bb93e885c960b16c20d3c68e769e56c807e820a9", driver=True),
)
DRIVER_VERSION = Path("/proc/driver/nvidia/version")  # present where the NVIDIA driver is loaded

SERVER = "1"  # no server runs: every server command answers about a pid that is none
UUID = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"  # the H200 capture's GPU
# verb -> the argument lists the exporter sends it (a server pid, a device ordinal or UUID).
ARGUMENTS: Dict[str, Sequence[Tuple[str, ...]]] = {
    "get_server_list": [()],
    "ps": [()],
    "get_server_status": [(SERVER,)],
    "get_client_list": [(SERVER,)],
    "get_active_thread_percentage": [(SERVER,)],
    "get_device_pinned_mem_limit": [(SERVER, "0"), (SERVER, UUID)],
    "get_default_active_thread_percentage": [()],
    "get_default_device_pinned_mem_limit": [("0",), (UUID,)],
    "get_default_client_priority": [()],
    "get_device_client_list": [(SERVER,)],
}


def commands() -> List[str]:
    """Every command line the exporter can send, checked by its own allowlist, then `help`
    (which no driver knows: what `Unknown command` looks like there)."""
    missing = set(READ_ONLY_COMMANDS) ^ set(ARGUMENTS)
    if missing:
        raise SystemExit(f"ARGUMENTS and READ_ONLY_COMMANDS differ: {sorted(missing)}")
    check = ControlClient("/nonexistent")
    lines = [check.command_line(verb, *args) for verb in READ_ONLY_COMMANDS for args in ARGUMENTS[verb]]
    return lines + ["get_device_client_list", "help"]  # also without its optional server pid


def fetch(pkg: Package, cache: Path) -> Path:
    path = cache / pkg.filename
    if not path.exists():
        print(f"downloading {pkg.url}", flush=True)
        with urllib.request.urlopen(pkg.url, timeout=60) as r, open(path.with_suffix(".part"), "wb") as f:
            shutil.copyfileobj(r, f)
        path.with_suffix(".part").rename(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    print(f"{pkg.filename} sha256 {digest}", flush=True)
    if digest != pkg.sha256:
        raise SystemExit(f"{pkg.filename}: sha256 {digest}, the index says {pkg.sha256}: not used")
    return path


def man_commands(root: Path) -> List[str]:
    """The COMMANDS of the man page: each `.TP` entry's first line, fonts dropped."""
    text = gzip.decompress((root / MAN_PAGE).read_bytes()).decode("utf-8", "replace")
    body = text.split(".SH \"ENVIRONMENT\"")[0]
    body = body[body.find("Commands supported"):]
    lines = body.splitlines()
    found = []
    for i, line in enumerate(lines[:-1]):
        if line.strip() == ".TP" and lines[i + 1].startswith("\\fB"):
            found.append(re.sub(r"\\f[BIRP]", "", lines[i + 1]).strip())
    return found


def run(program: Path, stdin: str, env: Dict[str, str], *args: str) -> Tuple[int, str]:
    proc = subprocess.run([str(program), *args], input=stdin, capture_output=True, text=True, env=env, timeout=20)
    return proc.returncode, proc.stdout + proc.stderr


def daemons(program: Path) -> List[int]:
    """The processes running `program` (this recording's unpacked copy, a path no other
    process runs): its daemon while it is up."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "exe") == str(program):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def stop(program: Path, family: str) -> None:
    """After `quit`: wait for the daemon to exit; one still up after 5 s is sent SIGTERM
    by its pid and the recording fails."""
    for _ in range(100):
        left = daemons(program)
        if not left:
            return
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGTERM)
    raise SystemExit(f"{family}: the daemon {left} did not exit on quit: terminated, nothing written")


class NeedsDriver(Exception):
    """The family's daemon cannot start on this machine: it has no NVIDIA driver."""


def driver() -> str:
    """The loaded NVIDIA driver's first line of /proc/driver/nvidia/version; '' without one."""
    try:
        return DRIVER_VERSION.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return ""


def record(pkg: Package, deb: Path, out: Path) -> None:
    node_driver = driver()
    if pkg.driver and not node_driver:
        raise NeedsDriver(f"{pkg.family}: its daemon starts only where the NVIDIA driver is loaded "
                          f"(none here: no {DRIVER_VERSION}); record it on a GPU node with --cache holding "
                          f"{pkg.filename}")
    with tempfile.TemporaryDirectory(prefix=f"mps-{pkg.family}-") as tmp:
        root = Path(tmp) / "root"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        program = root / PROGRAM
        pipe, logs = Path(tmp) / "pipe", Path(tmp) / "log"
        pipe.mkdir()
        logs.mkdir()
        env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
        rc, started = run(program, "", env, "-d")
        if rc != 0:
            raise SystemExit(f"{pkg.family}: the daemon did not start (exit {rc}): {started.strip()}")
        transcript: List[str] = []
        try:
            for _ in range(100):  # its control socket, once it listens
                if (pipe / "control").exists():
                    break
                time.sleep(0.05)
            _, version = run(program, "", env, "-v")
            for line in commands():
                rc, answer = run(program, line + "\n", env)
                transcript += [f"> {line}", *answer.splitlines(), f"rc={rc}"]
        finally:
            rc, answer = run(program, "quit\n", env)  # always: a daemon left behind holds its pipe
            print(f"{pkg.family}: quit: exit {rc} {answer.strip()!r}", flush=True)
            stop(program, pkg.family)
        control_log = (logs / "control.log").read_text(encoding="utf-8", errors="replace")
        commands_of_man = man_commands(root)
    directory = out / pkg.family
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "answers.txt").write_text("\n".join(transcript) + "\n")
    (directory / "control.recorded.log").write_text(control_log)
    (directory / "version.txt").write_text(version)
    write_source(directory / "SOURCE", pkg, commands_of_man, node_driver if pkg.driver else "")
    print(f"{pkg.family}: wrote {directory}", flush=True)


def write_source(path: Path, pkg: Package, man: Sequence[str], node_driver: str) -> None:
    kept = path.read_text().split(MARKER)[0] if path.exists() else ""
    kept = kept.rstrip() + "\n\n" if kept.strip() else ""
    section = [
        MARKER,
        f"Package ({pkg.archive} {pkg.suite}): {pkg.url}",
        f"sha256 {pkg.sha256}, recorded {datetime.date.today().isoformat()} by record_packages.py beside this file.",
        *([f"Recorded from the real binary on a GPU node, with its libcuda.so.1 and driver: {node_driver}.",
           "A control daemon with private pipe and log directories, no MPS server (no client asked",
           "for one), so answers about servers are `Server N not"] if node_driver else
          ["Recorded from the real binary without a GPU: a control daemon with private pipe and log",
           "directories, no MPS server (none can start), so answers about servers are `Server N not"]),
        "found`. answers.txt: each command as the exporter sends it, one process each, what the",
        "program printed and its exit code (`rc=N`). control.recorded.log: the daemon's control.log",
        "of the session (ending with `quit`). version.txt: what `-v` printed with the daemon up.",
        "",
        f"COMMANDS of its man page ({MAN_PAGE} of the package):",
        *(f"    {line}" for line in man),
        "",
    ]
    path.write_text(kept + "\n".join(section))


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("families", nargs="*", help="families to record (default: all)")
    p.add_argument("--cache", type=Path, help="where the packages are kept (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=HERE, help="where the families' directories are (default: here)")
    ns = p.parse_args(argv)
    chosen = [pkg for pkg in PACKAGES if not ns.families or pkg.family in ns.families]
    with tempfile.TemporaryDirectory(prefix="mps-debs-") as tmp:
        cache = ns.cache or Path(tmp)
        cache.mkdir(parents=True, exist_ok=True)
        for pkg in chosen:
            try:
                record(pkg, fetch(pkg, cache), ns.out)
            except NeedsDriver as e:
                if pkg.family in ns.families:  # asked for by name: the run fails
                    raise SystemExit(str(e)) from None
                print(f"{e}: skipped", flush=True)
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main(sys.argv[1:]))
