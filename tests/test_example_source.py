"""Issue 28's test of the declarations: adding a source is one new module. An example source
with two metrics of its own and one flag (tests/support/example_source.py) is written into a
copy of the repository; `make generate` then regenerates every generated file, and the
generated-files check and the tests that list sources, metrics, flags, dashboards and the
golden exposition pass there, with no other file edited."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.example_source import MODULE

ROOT = Path(__file__).resolve().parents[1]
# Everything in the suite that enumerates sources, metrics, labels, flags or dashboards.
SUBSET = ["tests/test_cli.py", "tests/test_registry.py", "tests/test_catalog.py", "tests/test_contract.py",
          "tests/test_bounds.py", "tests/test_collector.py", "tests/test_capture_replay.py", "tests/test_status.py",
          "tests/test_imports.py", "tests/test_readme.py", "tests/dashboards", "tests/alerts/test_rules.py"]
GENERATED = {"README.md", "docs/labels.md", "tests/golden/busy.prom", "dashboards/json/exporter.json",
             "deploy/helm/mps-exporter/files/dashboards/exporter.json", "mixin/dashboards/exporter.json",
             "deploy/kubernetes/dashboards.yaml"}
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
                                 "*.egg-info", "build")


def files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
def test_an_example_source_is_one_module(tmp_path: Path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=IGNORED, symlinks=True)
    before = files(repo)
    (repo / "exporter" / "sources" / "fans.py").write_text(MODULE)
    # `mps_exporter` from the copy: its exporter/ under the package's name, ahead of the
    # editable install on the path.
    site = tmp_path / "site"
    site.mkdir()
    (site / "mps_exporter").symlink_to(repo / "exporter")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{repo}"}

    def run(*args: str, timeout: float = 600) -> str:
        res = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, f"{' '.join(args)}:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
        return res.stdout

    assert run(sys.executable, "-c", "import mps_exporter; print(mps_exporter.__file__)").startswith(str(site))
    run("make", "generate", f"PYTHON={sys.executable}")
    run("make", "check-generated", f"PYTHON={sys.executable}")
    after = files(repo)
    changed = {rel for rel in after if before.get(rel) != after[rel]}
    assert changed - GENERATED == {"exporter/sources/fans.py"}, "a file other than the new module was edited"
    assert {"README.md", "docs/labels.md", "tests/golden/busy.prom", "dashboards/json/exporter.json"} <= changed
    readme = (repo / "README.md").read_text()
    assert "| mps_fan_stalls_total | counter | fan | Times the fan stalled. |" in readme
    assert "| `--fans.rpm` | `1200` | the speed the front fan reports |" in readme
    assert '| fan | mps_fan_speed_rpm, mps_fan_stalls_total | fixed |' in (repo / "docs" / "labels.md").read_text()
    golden = (repo / "tests" / "golden" / "busy.prom").read_text()
    assert 'mps_fan_speed_rpm{fan="back"} 600.0' in golden and 'collector="fans"' in golden
    assert "rate(mps_fan_stalls_total{" in (repo / "dashboards" / "json" / "exporter.json").read_text()
    dump = run(sys.executable, "-m", "mps_exporter.cli", "dump", "--fans.rpm", "900", "--no-collector.nvml",
               "--no-collector.control", "--no-collector.proc", "--no-collector.logs", "--no-collector.dcgm")
    assert 'mps_fan_speed_rpm{fan="front"} 900.0' in dump
    out = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *SUBSET, timeout=900)
    assert " passed" in out and "failed" not in out
