"""The generated rule files: in sync with definitions.py, accepted by promtool,
and every alert tested (firing and quiet), documented and routed."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from alerts import definitions, generate
from tests.support.promtool import group_order
from tests.support.tools import require

ROOT = Path(__file__).resolve().parents[2]
TEST_FILES = sorted((ROOT / "alerts" / "tests").glob("*.yaml"))
ALERTNAMES = {a.alertname for a in definitions.ALERTS}



def _rule_tests():
    """(alertname, exp_alerts) for every alert_rule_test in every test file."""
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                yield case["alertname"], case.get("exp_alerts") or []


def test_generated_files_are_in_sync():
    stale = generate.write_or_check(generate.outputs(), check_only=True)
    assert stale == [], f"run `make generate` and commit: {stale}"


def test_helm_copy_matches_rule_file():
    assert (ROOT / generate.HELM_RULES).read_text() == (ROOT / generate.PROMETHEUS_RULES).read_text()


def test_promtool_check_rules():
    out = subprocess.run([require("promtool"), "check", "rules", str(ROOT / generate.PROMETHEUS_RULES)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    n = len(definitions.ALERTS) + len(definitions.RECORDINGS)
    assert f"SUCCESS: {n} rules found" in out.stdout


@pytest.mark.slow
def test_promtool_unit_tests():
    out = subprocess.run([require("promtool"), "test", "rules", *map(str, TEST_FILES)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_unit_test_files_evaluate_groups_in_the_rule_files_order():
    """Without group_eval_order promtool runs a step's groups in random order, and a record
    that reads another group's record is a step late in some runs (tests/support/promtool.py)."""
    order = group_order(generate.prometheus_rules())
    assert {p.name: yaml.safe_load(p.read_text()).get("group_eval_order") for p in TEST_FILES} == \
        {p.name: order for p in TEST_FILES}


def test_every_alert_has_a_firing_and_a_quiet_case():
    firing, quiet = set(), set()
    for name, expected in _rule_tests():
        assert name in ALERTNAMES, f"test for unknown alert {name}"
        (firing if expected else quiet).add(name)
    assert ALERTNAMES - firing == set(), "alerts without a firing case"
    assert ALERTNAMES - quiet == set(), "alerts without a case where they must not fire"


def test_firing_cases_check_annotations_and_severity():
    by_name = {a.alertname: a for a in definitions.ALERTS}
    for name, expected in _rule_tests():
        for alert in expected:
            assert alert["exp_labels"]["severity"] == by_name[name].severity
            assert set(alert["exp_annotations"]) == {"summary", "description", "runbook_url"}


def test_descriptions_use_labels_the_alert_has():
    """A `$labels.x` in a description that no firing case carries renders empty."""
    seen = {}
    for name, expected in _rule_tests():
        for alert in expected:
            seen.setdefault(name, set()).update(alert["exp_labels"])
    for a in definitions.ALERTS:
        used = set(re.findall(r"\$labels\.(\w+)", a.description))
        assert used <= seen[a.alertname], f"{a.alertname}: {used - seen[a.alertname]} never present"


def test_alert_names_and_labels_follow_conventions():
    for a in definitions.ALERTS:
        assert re.fullmatch(r"Mps[A-Z][A-Za-z]+", a.alertname)
        assert a.severity in ("critical", "warning", "info")
        assert a.summary.endswith(".") and "{{" not in a.summary, "summary: a static sentence"
        assert "{{" in a.description


def test_runbook_has_a_section_per_alert():
    text = (ROOT / "alerts" / "runbook.md").read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    assert set(sections) == ALERTNAMES
    for name, body in sections.items():
        for part in ("**Meaning.**", "**Impact.**", "**Diagnose.**", "**Mitigate.**"):
            assert part in body, f"{name}: no {part}"


def test_runbook_urls_point_at_sections():
    rules = yaml.safe_load((ROOT / generate.PROMETHEUS_RULES).read_text())
    text = (ROOT / "alerts" / "runbook.md").read_text()
    anchors = {h.lower() for h in re.findall(r"^## (\w+)$", text, flags=re.M)}
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                url = rule["annotations"]["runbook_url"]
                assert url == generate.C.RUNBOOK_URL_PATTERN.replace("%s", rule["alert"].lower())
                assert url.split("#", 1)[1] in anchors


def test_runbook_url_pattern_is_configurable(monkeypatch):
    monkeypatch.setenv("RUNBOOK_URL_PATTERN", "https://wiki.example/mps/%s.html")
    text = generate.prometheus_rules()
    assert "runbook_url: https://wiki.example/mps/mpsserverfault.html" in text
    assert "/runbook#" not in text
    monkeypatch.setenv("RUNBOOK_URL_PATTERN", "https://wiki.example/mps")
    with pytest.raises(ValueError):
        generate.prometheus_rules()


def test_the_exporter_serves_the_runbook_of_its_version():
    """The package ships the runbook and serves it at /runbook, an anchor for every alert
    (the target of a pattern built from `instance`, docs/deploy.md)."""
    from mps_exporter import runbook

    assert runbook.SOURCE.read_text() == (ROOT / "alerts" / "runbook.md").read_text()
    page = runbook.served_page().decode()
    for a in definitions.ALERTS:
        assert f'<h2 id="{a.anchor}">{a.alertname}</h2>' in page
    body = runbook.page("## A <b>\nx < y\n").decode()
    assert '<h2 id="a-b">A &lt;b&gt;</h2>\n<p>x &lt; y</p>\n</body>' in body


def test_the_served_runbook_is_html_not_markdown():
    """Issue 43: /runbook showed the Markdown as it is (`**Meaning.**`, backticks, list
    dashes) in preformatted blocks."""
    from mps_exporter import runbook

    page = runbook.served_page().decode()
    text = re.sub(r"<pre><code>.*?</code></pre>", "", page, flags=re.S)
    assert "**" not in text and "`" not in text and "\n- " not in text
    assert "<p><strong>Meaning.</strong> " in page
    assert "<pre><code>mps-exporter status --watch" in page
    assert "<li><code>client_limit</code>: server.log says" in page
    md = runbook.page("Text with `a*b` and **bold *em* part**, [a link](https://x.example/?a=1&b=2).\n\n"
                      "- one\n  goes on\n- two\n\n    code <x>\n\n```\nfenced\n```\n").decode()
    assert ("<p>Text with <code>a*b</code> and <strong>bold <em>em</em> part</strong>, "
            '<a href="https://x.example/?a=1&amp;b=2">a link</a>.</p>') in md
    assert "<ul>\n<li>one goes on</li>\n<li>two</li>\n</ul>\n<pre><code>code &lt;x&gt;</code></pre>\n" in md
    assert "<pre><code>fenced</code></pre>" in md


def test_the_runbook_names_every_dashboard():
    """Issue 43: the runbook's list of dashboards named 5 of the 7."""
    titles = {json.loads(p.read_text())["title"].removeprefix("MPS / ")
              for p in (ROOT / "dashboards" / "json").glob("*.json")}
    text = (ROOT / "alerts" / "runbook.md").read_text()
    (listed,) = re.findall(r"^Dashboards \(folder \"MPS\"\): (.*?)\.\n\n", text, flags=re.M | re.S)
    assert set(re.findall(r"\*\*(.+?)\*\*", listed)) == titles


def test_every_raw_series_is_read_with_the_job_selector():
    """config.JOB_SELECTOR reaches every series an alert or recording rule reads
    (recorded `level:metric:op` series derive from selected ones)."""
    recorded = {r.record for r in definitions.RECORDINGS}
    exprs = [a.expr for a in definitions.ALERTS] + [r.expr for r in definitions.RECORDINGS]
    for expr in exprs:
        for name, brace in re.findall(r"(?<![\w:])([a-z_][a-z0-9_:]*)\b(\{?)", expr):
            if name.startswith("mps_") or name == "up":
                assert brace and re.search(re.escape(name) + r"\{" + re.escape(definitions.C.JOB_SELECTOR), expr), \
                    f"{name} without {definitions.C.JOB_SELECTOR} in {expr}"
            elif ":" in name:
                assert name in recorded, f"{name} is not a recording rule of ours"


def test_no_rule_reads_another_exporters_series():
    """Issue 31: names come from the exporter; no default rule reads kube-state-metrics
    (whose pods are the whole cluster's) or any series but the exporter's and `up`."""
    text = (ROOT / "alerts" / "prometheus" / "mps-exporter.rules.yml").read_text()
    assert "kube_pod_info" not in text and "kube_pod_container_info" not in text
    exprs = [a.expr for a in definitions.ALERTS] + [r.expr for r in definitions.RECORDINGS]
    for expr in exprs:
        for name in re.findall(r"(?<![\w:\"$.{])([a-z_][a-z0-9_:]*)\s*\{", expr):
            assert name.startswith("mps_") or name == "up" or ":" in name, (name, expr)


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * units[u] for n, u in parts)


def test_no_rule_reads_more_than_an_hour_of_a_raw_series():
    """Issue 19: a rule's cost per evaluation is bounded; longer windows range
    over recorded series (an hourly max), Grafana's inlined rules included."""
    recorded = {r.record for r in definitions.RECORDINGS}
    grafana = [generate.inline_recordings(a.expr) for a in definitions.ALERTS]
    exprs = [a.expr for a in definitions.ALERTS] + [r.expr for r in definitions.RECORDINGS] + grafana
    ranges = 0
    for expr in exprs:
        expr = re.sub(r'"[^"]*"', '""', expr)  # no string literal is a range
        assert ":]" not in expr.replace(" ", ""), f"subquery in {expr}"
        for name, window in re.findall(r"([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\[([^\]:]+)\]", expr):
            ranges += 1
            if name not in recorded:
                assert _seconds(window) <= 3600, f"{name}[{window}] in {expr}"
    assert ranges >= 8
    # The long window exists, and reads the hourly record.
    down = next(a for a in definitions.ALERTS if a.name == "ControlDaemonDown")
    assert f"{definitions.DAEMON_UP_MAX}[{generate.C.DAEMON_SEEN_WINDOW}]" in down.expr


def test_heavy_and_fleet_rules_have_their_own_groups():
    groups = {g["name"]: g for g in generate.rule_groups()}
    assert groups["mps-exporter.heavy"]["interval"] == "1m" == groups["mps-exporter.fleet"]["interval"]
    assert groups["mps-exporter.fleet-totals"]["interval"] == "1m"
    assert "interval" not in groups["mps-exporter.rules"]
    heavy = {r["record"] for r in groups["mps-exporter.heavy"]["rules"]}
    assert {definitions.QUEUE_WAIT_P95, definitions.DAEMON_UP_MAX} <= heavy
    fast = generate.rule_groups(interval_override="1s")
    assert {g.get("interval") for g in fast} == {None, "1s"}



def test_no_record_copies_a_served_series():
    """A record whose expression (or one branch of its `or`) is a bare selector copies a
    series the exporter serves: a write per series and round for nothing (issue 44:
    384 per node and round, each client's memory ratio). Readers select the series."""
    for r in definitions.RECORDINGS:
        branches = [b.strip() for b in re.split(r"\bor\b", r.expr)]
        assert not [b for b in branches if re.fullmatch(r"[a-z_]+\{[^{}]*\}", b)], r.record

SHIPPED_RULE_FILES = ("alerts/prometheus/mps-exporter.rules.yml", "alerts/kubernetes/prometheusrule.yaml",
                      "deploy/helm/mps-exporter/files/rules/mps-exporter.rules.yml",
                      "deploy/kubernetes/prometheusrule.yaml")


def _shipped_groups(rel: str):
    doc = yaml.safe_load((ROOT / rel).read_text())
    return (doc.get("spec") or doc)["groups"]


@pytest.mark.parametrize("rel", SHIPPED_RULE_FILES)
def test_no_record_reads_a_record_of_its_own_group(rel):
    """Issue 43: vmalert and Mimir do not promise that a recording rule sees what another
    rule of its group wrote in the same round; no shipped record relies on it. Read from
    the shipped files, not from definitions.py: what users load is what counts."""
    groups = _shipped_groups(rel)
    every_record = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    assert len(every_record) == len(definitions.RECORDINGS)
    chained = 0
    for group in groups:
        own = {r["record"] for r in group["rules"] if "record" in r}
        for rule in group["rules"]:
            if "record" not in rule:
                continue
            read = set(re.findall(r"(?<![\w:])([a-zA-Z_]\w*:[\w:]*)", rule["expr"])) & every_record
            assert not read & own, f"{group['name']}: {rule['record']} reads {sorted(read & own)} of its own group"
            chained += bool(read)
    assert chained >= 7  # the fleet totals still read the per-node records, from the group before


def test_a_record_that_reads_its_own_group_is_refused(monkeypatch):
    from alerts import recordings as R
    chained = R.Recording("fleet:x:sum", f"sum({R.NODE_CLIENTS})", "test", R.FLEET)
    monkeypatch.setattr(R, "RECORDINGS", R.RECORDINGS + (chained,))
    with pytest.raises(ValueError, match="of its own group 'fleet'"):
        R.check()


def test_new_recording_names_follow_the_convention():
    """level:metric:operations, e.g. namespace_pod:mps_clients:count."""
    for r in definitions.RECORDINGS:
        level, metric, ops = r.record.split(":")
        assert re.fullmatch(r"[a-z_]+", level) and re.fullmatch(r"[a-z0-9_]+", ops), r.record
        assert metric.startswith("mps_") or level == "mps" or metric == "up", r.record


def test_for_override_shortens_only_nonzero_durations():
    groups = generate.rule_groups(for_override="5s")
    fors = {r["alert"]: r["for"] for g in groups for r in g["rules"] if "alert" in r}
    for a in definitions.ALERTS:
        assert fors[a.alertname] == ("0m" if a.for_ == "0m" else "5s")


def test_prometheus_rule_resource():
    doc = yaml.safe_load((ROOT / generate.PROMETHEUS_RULE_CRD).read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["kind"] == "PrometheusRule"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
    file_groups = yaml.safe_load((ROOT / generate.PROMETHEUS_RULES).read_text())["groups"]
    assert doc["spec"]["groups"] == file_groups


def test_inline_recordings_replaces_every_recording():
    for a in definitions.ALERTS:
        expr = generate.inline_recordings(a.expr)
        assert not re.search(r"[a-z_]:[a-z_]", expr), a.alertname
    with pytest.raises(ValueError):
        generate.inline_recordings(definitions.GPU_MEMORY_USAGE + '{gpu="0"} > 1')


def test_inlined_grafana_queries_are_valid_promql(tmp_path):
    """Grafana queries Prometheus with the recordings inlined: promtool parses them."""
    rules = [{"alert": a.alertname, "expr": generate.inline_recordings(a.expr)} for a in definitions.ALERTS]
    path = tmp_path / "inlined.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "inlined", "rules": rules}]}))
    out = subprocess.run([require("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------- Alertmanager
AM_CONFIG = ROOT / "alerts" / "alertmanager.example.yml"


def test_alertmanager_example_is_valid():
    out = subprocess.run([require("amtool"), "check-config", str(AM_CONFIG)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("severity,receiver", [("critical", "pager"), ("warning", "ticket"), ("info", "blackhole")])
def test_alertmanager_routes(severity, receiver):
    names = [a.alertname for a in definitions.ALERTS if a.severity == severity] or ["MpsExample"]
    for name in names:
        out = subprocess.run(
            [require("amtool"), "config", "routes", "test", f"--config.file={AM_CONFIG}", f"--verify.receivers={receiver}",
             f"alertname={name}", f"severity={severity}", "instance=gpu-node-1:10138", "gpu=0"],
            capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{name}: {out.stdout}{out.stderr}"
        assert out.stdout.strip() == receiver


def test_alertmanager_groups_by_node_and_gpu():
    route = yaml.safe_load(AM_CONFIG.read_text())["route"]
    assert {"node", "instance", "gpu"} <= set(route["group_by"])
    for child in route["routes"]:
        assert "group_by" not in child, "children inherit the grouping"


# ------------------------------------------------------- Grafana alert rules
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def test_grafana_rules_are_well_formed_provisioning():
    """The checks Grafana's file provisioning (AlertRuleGroupV1 / AlertRuleV1) applies."""
    doc = json.loads((ROOT / generate.GRAFANA_RULES).read_text())
    assert doc["apiVersion"] == 1
    uids, titles = set(), set()
    for group in doc["groups"]:
        assert group["name"].strip() and group["folder"].strip()
        assert DURATION.match(group["interval"])
        assert isinstance(group["orgId"], int)
        for rule in group["rules"]:
            assert rule["title"] and rule["title"] not in titles
            titles.add(rule["title"])
            assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", rule["uid"]) and rule["uid"] not in uids
            uids.add(rule["uid"])
            assert DURATION.match(rule["for"])
            assert rule["noDataState"] in ("Alerting", "NoData", "OK", "KeepLast")
            assert rule["execErrState"] in ("Alerting", "Error", "OK", "KeepLast")
            refs = [q["refId"] for q in rule["data"]]
            assert rule["condition"] in refs and len(set(refs)) == len(refs)
            for q in rule["data"]:
                assert q["datasourceUid"] and isinstance(q["model"], dict)
                assert {"from", "to"} <= set(q["relativeTimeRange"])
                if q["datasourceUid"] == "-100":  # server-side expression
                    assert q["model"]["type"] in ("math", "reduce", "resample", "classic_conditions", "threshold")
                else:
                    assert q["model"]["expr"] and q["model"]["datasource"]["type"] == "prometheus"
            assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}
            # Grafana's $value is a string of every expression's result; only
            # $values.<ref>.Value is the number the templates format.
            assert not re.search(r"\$value\b", rule["annotations"]["description"])
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
    assert titles == ALERTNAMES
