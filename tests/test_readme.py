"""README.md's commands, run as a new user runs them, from a plain copy of the repository.

They run verbatim in a shell whose `python3` is laid out as Debian 12's system Python:
its standard library carries the `EXTERNALLY-MANAGED` marker (PEP 668), so a system-wide
`pip install` is refused as it is on a fresh Debian, and what the README promises is
checked on what the package really ships (the recorded session inside the wheel, the
console script) in the virtual environment the README makes. Where a command needs a
GPU node's paths or the default port, the test gives private ones: nothing outside the
copy and temporary directories is read or bound, and this machine's Python is left alone.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

import pytest

from tests.support.prometheus import free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# What a clone has (tracked files): leave out what building and testing add.
NOT_IN_A_CLONE = shutil.ignore_patterns(".git", ".venv*", "venv", "__pycache__", "*.egg-info", "build", "dist",
                                        ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache", ".gpu-*")
INSTALL_SECONDS = 900


def readme_command(prefix: str) -> str:
    """The indented README line that starts with `prefix` (it must be there)."""
    found = re.findall(rf"^    ({re.escape(prefix)}.*)$", README, re.MULTILINE)
    assert found, f"README.md no longer shows a command starting with {prefix!r}"
    return found[0]


def readme_block(containing: str) -> List[str]:
    """The lines of the indented README block that has a line starting with `containing`."""
    for block in re.findall(r"(?:^    \S.*\n)+", README, re.MULTILINE):
        lines = [line[4:] for line in block.splitlines()]
        if any(line.startswith(containing) for line in lines):
            return lines
    raise AssertionError(f"README.md no longer shows a block with a command starting with {containing!r}")


def apt_packages(lines: List[str]) -> List[str]:
    """The packages of the block's `sudo apt-get install` line (it must have one)."""
    apt = [line for line in lines if line.startswith("sudo apt-get install ")]
    assert len(apt) == 1, lines
    return apt[0].split()[3:]


def debian_like_python(root: Path) -> Path:
    """A Python at root/bin/python3 laid out as Debian 12's system Python, from this
    interpreter's base installation: its standard library (linked, not copied) beside
    an EXTERNALLY-MANAGED marker, pip (python3-pip) and nothing else installed; `pip`
    and `pip3` as on Debian. -> root/bin."""
    base = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = Path(subprocess.run([str(base), "-I", "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                                 capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    lib = root / "lib" / stdlib.name
    lib.mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "dist-packages", "EXTERNALLY-MANAGED"):
            (lib / entry.name).symlink_to(entry)
    (lib / "EXTERNALLY-MANAGED").write_text(
        "[externally-managed]\nError=To install Python packages system-wide, try apt install\n"
        " python3-xyz, where xyz is the package you are trying to\n install.\n")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    # A copy, not a link: Python finds its standard library next to the real executable.
    shutil.copy2(base, bin_dir / "python3")
    # Where this layout's Python looks for installed packages (Debian's: dist-packages).
    site = Path(subprocess.run([str(bin_dir / "python3"), "-I", "-c", "import site; print(site.getsitepackages()[-1])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    assert root in site.parents, site
    site.mkdir(parents=True, exist_ok=True)
    pip = importlib.util.find_spec("pip")
    assert pip is not None and pip.submodule_search_locations, "pip is not installed"
    (site / "pip").symlink_to(list(pip.submodule_search_locations)[0])
    for name in ("pip", "pip3"):
        (bin_dir / name).write_text('#!/bin/sh\nexec "$(dirname "$0")/python3" -m pip "$@"\n')
        (bin_dir / name).chmod(0o755)
    return bin_dir


def shell_env(bin_dir: Path) -> Dict[str, str]:
    """This environment with `python3` the Debian-like one and no virtual environment active."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    here = os.path.dirname(sys.executable)
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and os.path.realpath(p) != os.path.realpath(here)]
    env["PATH"] = os.pathsep.join([str(bin_dir), *path])
    return env


def run_lines(lines: List[str], cwd: Path, env: Dict[str, str]) -> subprocess.CompletedProcess:
    """README lines as one shell script, verbatim, `set -e`."""
    return subprocess.run(["bash", "-euc", "\n".join(lines)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=INSTALL_SECONDS)


@pytest.fixture(scope="module")
def debian(tmp_path_factory):
    """(a plain copy of the repository, the environment of a shell on a Debian-like Python)."""
    work = tmp_path_factory.mktemp("readme")
    clone = work / "clone"
    shutil.copytree(ROOT, clone, ignore=NOT_IN_A_CLONE)
    return clone, shell_env(debian_like_python(work / "python"))


def test_the_debian_like_python_refuses_a_system_wide_install(debian):
    # What the README's commands must get past: pip on Debian 12's Python outside a venv.
    clone, env = debian
    for command in ("pip install .", "python3 -m pip install -e .[test]"):
        res = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode != 0 and "externally-managed-environment" in res.stdout + res.stderr, (command, res)


@pytest.fixture(scope="module")
def installed(debian):
    """README's quick start, verbatim but for the apt line (the test can not run apt; its
    package is checked) and the exporter it starts -> (environment, mps-exporter, work)."""
    clone, env = debian
    lines = readme_block("pip install . && mps-exporter --mps.pipe-directory")
    assert "python3-venv" in apt_packages(lines)
    serve = lines[-1]
    assert serve.startswith("pip install . && mps-exporter "), lines
    install = [line for line in lines[:-1] if not line.startswith("sudo apt-get ")] + [serve.split(" && ")[0]]
    res = run_lines(install, clone, env)
    assert res.returncode == 0, res.stdout + res.stderr
    venv_bin = clone / ".venv" / "bin"
    program = venv_bin / "mps-exporter"
    assert program.exists(), list(venv_bin.iterdir())
    env = {**env, "PATH": os.pathsep.join([str(venv_bin), env["PATH"]])}
    # The installed package, not this checkout, answers.
    where = subprocess.run([str(venv_bin / "python"), "-c", "import mps_exporter; print(mps_exporter.__file__)"],
                           env=env, cwd=clone.parent, capture_output=True, text=True, timeout=60).stdout
    assert where.startswith(str(clone / ".venv")), where
    return env, str(program), clone.parent


@pytest.mark.slow
def test_readme_test_commands_run_verbatim_on_a_debian_like_python(debian):
    # The development set-up: its apt line is the one CI installs, and pytest runs in its venv.
    clone, env = debian
    lines = readme_block('python3 -m pip install -e ".[test]" && python3 -m pytest -q')
    ci = re.search(r'^packages="([^"]*)"$', (ROOT / ".ci" / "run").read_text(), re.MULTILINE)
    assert ci is not None and apt_packages(lines) == ci.group(1).split()
    test = lines[-1]
    assert test.endswith(" && python3 -m pytest -q"), lines
    script = [line for line in lines[:-1] if not line.startswith("sudo apt-get ")]
    # The whole suite inside one of its tests would recurse: one of its files shows the
    # test dependencies are installed and the suite runs.
    res = run_lines([*script, test.replace("python3 -m pytest -q", "python3 -m pytest -q -p no:cacheprovider "
                                           "tests/test_bounds.py")], clone, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"\d+ passed", res.stdout), res.stdout


def run(installed, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env, program, work = installed
    return subprocess.run([program, *args], env=env, cwd=work, capture_output=True, text=True, timeout=timeout)


def get(url: str) -> "tuple[int, str]":
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


@pytest.mark.slow
def test_metrics_prints_the_readme_table(installed):
    res = run(installed, "metrics")
    assert res.returncode == 0, res.stderr
    table = README.split("<!-- metrics:begin -->\n", 1)[1].split("<!-- metrics:end -->", 1)[0]
    assert res.stdout == table


@pytest.mark.slow
def test_version(installed):
    res = run(installed, "--version")
    assert res.returncode == 0 and res.stdout.startswith("mps-exporter "), res


@pytest.mark.slow
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


@pytest.mark.slow
def test_replay_serves_the_shipped_session_and_its_counters_go_on(installed):
    assert readme_command("pip install . && mps-exporter replay") == "pip install . && mps-exporter replay"
    port = free_port()
    env, program, work = installed
    # `--speed 30`: README's `--speed` flag, so that passes of the 90 s session come quickly.
    proc = subprocess.Popen([program, "replay", "--web.listen-address", f"127.0.0.1:{port}",
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


@pytest.mark.slow
def test_status_reads_the_shipped_session_as_readme_shows(installed):
    # README's bundle command, on the session inside the installed package: the wheel ships
    # the status package, and its first sample is what it prints.
    readme_command("mps-exporter status --bundle FILE --at ")
    bundle_name, at = re.search(r"`mps-exporter status --bundle exporter/data/(\S+) --at ([\d.]+)`", README).groups()
    env, program, work = installed
    package = subprocess.run([str(Path(program).parent / "python"), "-c", "import mps_exporter; print(mps_exporter.__file__)"],
                             env=env, capture_output=True, text=True, timeout=60).stdout.strip()
    bundle = Path(package).parent / "data" / bundle_name
    res = run(installed, "status", "--bundle", str(bundle), "--at", at)
    assert res.returncode == 0, res.stderr
    sample = README.split("## On the node: `mps-exporter status`\n", 1)[1].split("```\n", 2)[1]
    assert res.stdout == sample


@pytest.mark.slow
def test_the_package_names_its_license_and_where_its_docs_are(installed):
    # SPDX license expression (a license table stops building in 2027), project URLs, and
    # --help pointing at them: a pip install has no docs/ to read.
    env, program, work = installed
    fields = subprocess.run([str(Path(program).parent / "python"), "-c",
                             "import json; from importlib.metadata import metadata; "
                             "m = metadata('mps-exporter'); print(json.dumps([m['License-Expression'], "
                             "m.get_all('Project-URL')]))"],
                            env=env, capture_output=True, text=True, timeout=60)
    license_expression, urls = json.loads(fields.stdout)
    assert license_expression == "Apache-2.0"
    named = dict(url.split(", ", 1) for url in urls)
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(named), named
    helps = [run(installed, "--help").stdout] + [run(installed, command, "--help").stdout
                                                 for command in ("serve", "dump", "capture", "replay", "status")]
    cited = [m for text in helps for m in re.findall(r"\S*docs/\S*", text)]
    assert cited, "the help names no document"
    for mention in cited:
        assert mention.strip("()").startswith(named["Documentation"] + "/"), mention


def test_every_documented_pip_install_runs_in_a_virtual_environment():
    # On Debian 12 a pip install outside a venv stops with externally-managed-environment:
    # every README and CONTRIBUTING block that installs makes and activates one first.
    for doc in (ROOT / "README.md", ROOT / "CONTRIBUTING.md"):
        for block in re.findall(r"(?:^    \S.*\n)+", doc.read_text(), re.MULTILINE):
            lines = [line[4:] for line in block.splitlines()]
            installs = [i for i, line in enumerate(lines) if re.match(r"(python3 -m )?pip install", line)]
            if not installs:
                continue
            venv = [i for i, line in enumerate(lines) if "python3 -m venv .venv && . .venv/bin/activate" in line]
            assert venv and venv[0] < installs[0] or doc.name == "README.md" and lines == [
                "pip install . && mps-exporter replay"], (doc.name, lines)


def test_the_first_screen_shows_the_demo_and_the_tests_then_the_live_command():
    """Issue 43: what a visitor without a GPU can run comes first, on the first screen."""
    lines = README.splitlines()

    def line_of(command: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(f"    {command}"))

    demo = line_of("pip install . && mps-exporter replay")
    tests = line_of('python3 -m pip install -e ".[test]" && python3 -m pytest -q')
    live = line_of("pip install . && mps-exporter --mps.pipe-directory")
    assert demo < tests < live
    assert tests < 60, "the demo and the test commands must be on the first screen"


def test_every_apt_line_updates_first_and_the_readme_says_how_to_run_it_as_root():
    # A fresh VM or container has no package lists: `apt-get install` alone answers
    # "Unable to locate package"; a root shell in a container has no sudo.
    blocks = [[line[4:] for line in block.splitlines()] for block in re.findall(r"(?:^    \S.*\n)+", README, re.M)]
    installing = [lines for lines in blocks if any(line.startswith("sudo apt-get install ") for line in lines)]
    assert len(installing) >= 3
    for lines in installing:
        first = next(i for i, line in enumerate(lines) if line.startswith("sudo apt-get install "))
        assert first > 0 and lines[first - 1] == "sudo apt-get update", lines
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "as root" in quick_start and "leave `sudo` out" in quick_start
