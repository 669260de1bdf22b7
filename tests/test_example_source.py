"""Issue 28's test of the declarations: adding a source is one new module. An example source
with two metrics of its own and one flag (tests/support/example_source.py) is written into a
copy of the repository; `make generate` then regenerates every generated file, and the
generated-files check and the tests that list sources, metrics, flags, dashboards and the
golden exposition pass there, with no other file edited."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.example_source import MODULE
from tests.support.repo_copy import RepoCopy, files

# Everything in the suite that enumerates sources, metrics, labels, flags or dashboards.
SUBSET = ["tests/test_cli.py", "tests/test_registry.py", "tests/test_catalog.py", "tests/test_contract.py",
          "tests/test_bounds.py", "tests/test_collector.py", "tests/test_capture_replay.py", "tests/test_status.py",
          "tests/test_imports.py", "tests/test_readme.py", "tests/dashboards", "tests/alerts/test_rules.py"]
GENERATED = {"README.md", "docs/labels.md", "tests/golden/busy.prom", "dashboards/json/exporter.json",
             "deploy/helm/mps-exporter/files/dashboards/exporter.json", "mixin/dashboards/exporter.json",
             "deploy/kubernetes/dashboards.yaml"}


@pytest.mark.slow
def test_an_example_source_is_one_module(tmp_path: Path):
    copy = RepoCopy(tmp_path)
    repo, run = copy.repo, copy.run
    before = files(repo)
    (repo / "exporter" / "sources" / "fans.py").write_text(MODULE)
    assert run(sys.executable, "-c", "import mps_exporter; print(mps_exporter.__file__)").startswith(str(copy.site))
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
