"""The monitoring mixin (mixin/, written by alerts/mixin.py) built by jsonnet (the
`jsonnet` package of PyPI, a test dependency): its output equals the shipped rule
file, PrometheusRule and dashboards, and its `_config` re-selects every rule and
dashboard."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Dict, List

import _jsonnet  # PyPI's `jsonnet` (pip install -e ".[test]")
import pytest
import yaml

from alerts import generate, mixin

ROOT = Path(__file__).resolve().parents[2]
MIXIN = ROOT / "mixin"
OTHER_JOB = 'job=~"gpu-nodes|mps"'


@functools.lru_cache(maxsize=None)
def build(config: str = "") -> Dict[str, Any]:
    """The mixin's three outputs, with `config` merged into `_config`."""
    snippet = (f"local m = (import 'mixin.libsonnet') + {{ _config+:: {{ {config} }} }};\n"
               "{ alerts: m.prometheusAlerts, rules: m.prometheusRules, dashboards: m.grafanaDashboards }")
    out: Dict[str, Any] = json.loads(_jsonnet.evaluate_snippet(str(MIXIN / "build.jsonnet"), snippet,
                                                                jpathdir=[str(MIXIN)]))
    return out


def shipped_groups() -> List[Dict[str, Any]]:
    groups: List[Dict[str, Any]] = yaml.safe_load((ROOT / generate.PROMETHEUS_RULES).read_text())["groups"]
    return groups


def test_the_committed_mixin_is_what_the_generator_writes():
    assert generate.write_or_check(mixin.outputs(), check_only=True) == []


@pytest.mark.slow
def test_jsonnet_builds_the_shipped_rule_groups():
    built = build()
    assert built["rules"]["groups"] + built["alerts"]["groups"] == shipped_groups()
    crd = yaml.safe_load((ROOT / generate.PROMETHEUS_RULE_CRD).read_text())
    assert built["rules"]["groups"] + built["alerts"]["groups"] == crd["spec"]["groups"]
    # Recording groups in prometheusRules, alerting groups in prometheusAlerts, as mixins do.
    assert all("record" in r for g in built["rules"]["groups"] for r in g["rules"])
    assert all("alert" in r for g in built["alerts"]["groups"] for r in g["rules"])


@pytest.mark.slow
def test_jsonnet_builds_the_shipped_dashboards():
    dashboards = build()["dashboards"]
    shipped = {}
    for path in sorted((ROOT / "dashboards/json").glob("*.json")):
        data = json.loads(path.read_text())
        shipped[f"{data['uid']}.json"] = data
    assert len(shipped) == 7 and dashboards == shipped


@pytest.mark.slow
def test_the_build_files_print_the_rules_as_yaml():
    for name, field in (("alerts.jsonnet", "alerts"), ("rules.jsonnet", "rules")):
        text = json.loads(_jsonnet.evaluate_file(str(MIXIN / name)))  # -S: a string
        assert yaml.safe_load(text) == build()[field]


@pytest.mark.slow
def test_config_reselects_every_rule_and_dashboard():
    default = build()
    other = build(f"jobSelector: {json.dumps(OTHER_JOB)}, runbookURLPattern: 'https://wiki.example/mps#%s'")
    dumped = json.dumps(other)
    assert 'job=\\"mps-exporter\\"' not in dumped
    reselected = 0
    for field in ("rules", "alerts"):
        for old, new in zip(default[field]["groups"], other[field]["groups"]):
            for a, b in zip(old["rules"], new["rules"]):
                reselected += a["expr"] != b["expr"]
                assert b["expr"] == a["expr"].replace('job="mps-exporter"', OTHER_JOB)
                if "alert" in a:
                    assert b["annotations"]["runbook_url"] == f"https://wiki.example/mps#{a['alert'].lower()}"
    # Every rule that reads the exporter's series (the others read records only).
    selecting = [r for g in shipped_groups() for r in g["rules"] if 'job="mps-exporter"' in r["expr"]]
    assert reselected == len(selecting) > 40
    job_variable = [v["query"] for v in other["dashboards"]["mps-gpu-overview.json"]["templating"]["list"]
                    if v["name"] == "job"]
    assert job_variable == [f"label_values(mps_exporter_build_info{{{OTHER_JOB}}}, job)"]
