"""The real programs the suite runs (Prometheus, promtool, Alertmanager, ...).

They come from Debian packages that README's set-up command installs. A missing one is a
failure naming the package, never a skip: a suite that silently skips its real checks
proves nothing.
"""

from __future__ import annotations

import os
import shutil

import pytest

# program -> Debian package that ships it
PACKAGES = {
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "amtool": "prometheus-alertmanager",
    "prometheus-alertmanager": "prometheus-alertmanager",
    "systemd-analyze": "systemd",
    "systemd-socket-activate": "systemd",
    "logrotate": "logrotate",
    "victoria-metrics": "victoria-metrics",
    "vmagent": "victoria-metrics",
    "vmalert": "victoria-metrics",
    "tmux": "tmux",
    "docker-compose": "docker-compose",
}


def require(program: str) -> str:
    """The program's path; the test fails (with the apt-get line) when it is not installed."""
    path = shutil.which(program) or next(
        (p for p in (f"/usr/sbin/{program}", f"/usr/bin/{program}") if os.access(p, os.X_OK)), None)
    if path is None:
        pytest.fail(f"{program} is not installed: apt-get install {PACKAGES.get(program, program)}")
    return path
