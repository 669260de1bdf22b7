"""The truth check as a pytest test: runs only where a GPU and MPS are (marker `gpu`).

    python3 -m pytest -m gpu tests/gpu   # as root on a GPU machine, mps_exporter importable

Starts its own MPS control daemon under a temporary directory and quits it at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _gpu_present() -> bool:
    if not (shutil.which("nvidia-smi") and shutil.which("nvidia-cuda-mps-control")):
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _gpu_present(), reason="needs an NVIDIA GPU, nvidia-smi and the MPS binaries"),
              pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() != 0,
                                 reason="needs root (a second user's client, /proc of every client)")]


def test_truth_check_passes(tmp_path):
    result = subprocess.run([sys.executable, str(HERE / "truth_check.py"), "--work", str(tmp_path / "work"),
                             "--report-dir", str(tmp_path), "--name", "pytest"], timeout=900)
    report = json.loads((tmp_path / "pytest.json").read_text())
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    assert result.returncode == 0 and not failed and report["total"] >= 20, failed
