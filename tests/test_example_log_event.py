"""Issue 39's test of counted log events: a new MPS log event with a counter and an alert
(tests/support/example_log_event.py) is written into a copy of the repository by hand in
at most four product modules (the event type, the parser rule, the handler line and the
declaration); `make generate` regenerates the rest, and there the line is counted, served,
kept across a restart through the state file, and the suite's tests of logs, metrics,
dashboards and alerts pass."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.example_log_event import ELSEWHERE, LINE, METRIC, PRODUCT
from tests.support.repo_copy import RepoCopy, files

SUBSET = ["tests/logs/test_state.py", "tests/logs/test_statefile_v1.py", "tests/logs/test_parser.py",
          "tests/test_contract.py", "tests/test_catalog.py", "tests/test_versioning.py", "tests/test_status.py",
          "tests/test_capture_replay.py", "tests/dashboards", "tests/alerts/test_rules.py"]
# What `make generate` rewrites after such a change.
GENERATED = {"README.md", "docs/labels.md", "tests/golden/busy.prom", "alerts/README.md",
             "alerts/prometheus/mps-exporter.rules.yml", "alerts/grafana/mps-exporter-alert-rules.json",
             "alerts/kubernetes/prometheusrule.yaml", "deploy/helm/mps-exporter/files/rules/mps-exporter.rules.yml",
             "deploy/kubernetes/prometheusrule.yaml", "exporter/data/runbook.md",
             "dashboards/json/contention.json", "deploy/helm/mps-exporter/files/dashboards/contention.json",
             "deploy/kubernetes/dashboards.yaml", "mixin/alerts.libsonnet", "mixin/dashboards/contention.json"}
PROGRAM = f'''
import json, sys
from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.logs.state import LogState
from mps_exporter.logs.statefile import StateStore
logs, state = sys.argv[1], sys.argv[2]
first = LogPipeline("default", logs, "UTC", StateStore(state))
snap = first.read_once()
assert snap.count("{METRIC}") == 1 and snap.unrecognized == {{"control": 0, "server": 0}}, snap
first.stop()
saved = json.load(open(state))["default"]["state"]
assert saved["counts"]["{METRIC}"] == 1, saved["counts"]
assert LogState.from_dict(saved).snapshot().count("{METRIC}") == 1
store = StateStore(state)
assert LogPipeline("default", logs, "UTC", store).read_once().count("{METRIC}") == 1 and store.errors == {{}}
print("ok")
'''


def edit(repo: Path, path: str, anchor: str, text: str) -> None:
    target = repo / path
    content = target.read_text()
    assert content.count(anchor) == 1, f"{path}: the anchor of the edit is not there once: {anchor!r}"
    target.write_text(content.replace(anchor, anchor + text))


@pytest.mark.slow
def test_a_counted_log_event_with_an_alert_is_four_product_modules(tmp_path: Path):
    copy = RepoCopy(tmp_path)
    repo, run = copy.repo, copy.run
    before = files(repo)
    for path, anchor, text in PRODUCT + ELSEWHERE:
        edit(repo, path, anchor, text)
    by_hand = {path for path, _, _ in PRODUCT + ELSEWHERE}
    product = {path for path in by_hand if path.startswith("exporter/")}
    assert len(product) <= 4, f"{len(product)} product modules edited by hand: {sorted(product)}"
    assert run(sys.executable, "-c", "import mps_exporter; print(mps_exporter.__file__)").startswith(str(copy.site))
    run("make", "generate", f"PYTHON={sys.executable}")
    run("make", "check-generated", f"PYTHON={sys.executable}")
    after = files(repo)
    changed = {rel for rel in after if before.get(rel) != after[rel]}
    assert changed - by_hand <= GENERATED, f"edited, yet not by hand nor generated: {sorted(changed - by_hand - GENERATED)}"
    assert changed >= by_hand | {"README.md", "tests/golden/busy.prom", "alerts/prometheus/mps-exporter.rules.yml"}
    assert sorted(p for p in changed if p.startswith("exporter/") and p.endswith(".py")) == sorted(product)
    assert f'{METRIC}{{daemon="default"}} 0.0' in (repo / "tests" / "golden" / "busy.prom").read_text()
    assert "MpsClientWaitTimedOut" in (repo / "alerts" / "prometheus" / "mps-exporter.rules.yml").read_text()

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "control.log").write_text("[2026-11-21 04:19:21.161 Control   546] Starting control daemon using socket "
                                      f"/tmp/mps/pipe/control\n[2026-11-21 04:19:22.000 Control   546] {LINE}\n")
    assert run(sys.executable, "-c", PROGRAM, str(logs), str(tmp_path / "state.json")).strip() == "ok"
    dump = run(sys.executable, "-m", "mps_exporter.cli", "dump", "--mps.log-directory", str(logs),
               "--mps.pipe-directory", "/nonexistent", "--mps.control-binary", "/nonexistent/nvidia-cuda-mps-control",
               "--mps.log-timezone", "UTC", "--no-collector.nvml", "--no-collector.dcgm", "--no-collector.proc")
    assert f'{METRIC}{{daemon="default"}} 1.0' in dump
    out = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *SUBSET, timeout=900)
    assert " passed" in out and "failed" not in out
