"""A copy of the repository for the tests that edit it as a contributor would
(tests/test_example_*.py): its files, and commands run with `mps_exporter` imported
from the copy."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[2]
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
                                 "*.egg-info", "build")


def files(root: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


class RepoCopy:
    """The repository copied under `tmp` (git, venvs and caches left out); `mps_exporter` is
    the copy's exporter/ under the package's name, ahead of the editable install on the path."""

    def __init__(self, tmp: Path) -> None:
        self.repo = tmp / "repo"
        shutil.copytree(ROOT, self.repo, ignore=IGNORED, symlinks=True)
        site = tmp / "site"
        site.mkdir()
        (site / "mps_exporter").symlink_to(self.repo / "exporter")
        self.site = site
        self.env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{self.repo}"}

    def run(self, *args: str, timeout: float = 600) -> str:
        """The command's output; it must succeed."""
        res = subprocess.run(args, cwd=self.repo, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, f"{' '.join(args)}:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
        return res.stdout
