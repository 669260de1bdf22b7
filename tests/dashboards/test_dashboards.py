"""The generated dashboards: in sync with their .dashboard.py, shaped like
Grafana's dashboard JSON model, every query valid PromQL on contract metrics."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from alerts.generate import write_or_check
from dashboards import common, generate
from dashboards.queries import concrete, queries
from alerts import config as C
from alerts import definitions
from alerts.expressions import client_memory_ratio
from alerts.recordings import FLEET_GROUPS, RECORDINGS
from mps_exporter.catalog import METRICS
from mps_exporter.contract import HISTOGRAM
from tests.support.tools import require

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / generate.JSON_DIR).glob("*.json"))}
PANEL_TYPES = {"row", "timeseries", "stat", "table"}
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}

# A panel's unit and what each of its queries must then be about.
UNIT_EVIDENCE = {
    "bytes": ("_bytes",),
    "percentunit": ("_ratio", " / ", ":ratio"),
    "s": ("_seconds",),
    "watt": ("_watts",),
    "celsius": ("_celsius",),
    "cps": ("rate(", ":rate"),
}


def _panels():
    for name, dash in DASHBOARDS.items():
        for panel in dash["panels"]:
            yield name, panel


RECORDED = {r.record: r for r in RECORDINGS}
# Dashboards by their variables: per node, by pod, the whole fleet.
VARIABLES = {"kubernetes": {"namespace", "pod"}, "fleet": set()}
NODE_VARIABLES = {"job", "node", "gpu", "daemon"}


def _metric_names(expr: str):
    """(series, metric) for every raw series with a selector (recorded ones skipped)."""
    for name in re.findall(r"(?<![\w:])([a-z_]+)(?=\{)", expr):
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        yield name, base if base in METRICS and METRICS[base].type == HISTOGRAM else name


def _recorded_names(expr: str):
    return [n for n in re.findall(r"(?<![\w:])([a-z_]+:[a-z0-9_:]+)", expr)]


def test_generated_json_is_in_sync():
    assert write_or_check(generate.outputs(), check_only=True) == [], "run `make generate` and commit"


def test_helm_copies_match():
    for name in DASHBOARDS:
        assert (ROOT / generate.HELM_DIR / f"{name}.json").read_text() == \
               (ROOT / generate.JSON_DIR / f"{name}.json").read_text()


def test_one_json_per_dashboard_source():
    assert set(DASHBOARDS) == set(generate.sources()) and len(DASHBOARDS) >= 5


def test_json_keys_are_sorted():
    for name in DASHBOARDS:
        text = (ROOT / generate.JSON_DIR / f"{name}.json").read_text()
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


def test_json_matches_grafanas_dashboard_model():
    schema = json.loads((Path(__file__).parent / "dashboard.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for name, dash in DASHBOARDS.items():
        errors = [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(dash)]
        assert errors == [], name


def test_no_nulls_in_the_model():
    """Grafana's model has optional fields, not nullable ones (a threshold's value excepted)."""
    def nulls(value, path=""):
        if isinstance(value, dict):
            for k, v in value.items():
                if v is None and k != "value":
                    yield f"{path}.{k}"
                yield from nulls(v, f"{path}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from nulls(v, f"{path}[{i}]")
    for name, dash in DASHBOARDS.items():
        assert list(nulls(dash)) == [], name


def test_dashboard_level_model():
    uids = set()
    for name, dash in DASHBOARDS.items():
        assert dash["title"].startswith("MPS / ")
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dash["uid"]) and dash["uid"] not in uids, name
        uids.add(dash["uid"])
        assert dash.get("id") is None, "provisioned dashboards carry no database id"
        assert dash["schemaVersion"] == common.SCHEMA_VERSION >= 36
        assert "mps-exporter" in dash["tags"]
        assert dash["description"]


def test_the_default_range_shows_a_new_node_s_data():
    # A node (or the demo stack) that started a few minutes ago must fill a good part of
    # each time series panel, not a sliver at its right edge: at most 30 minutes by default.
    units = {"m": 60, "h": 3600, "d": 86400}
    for name, dash in DASHBOARDS.items():
        found = re.fullmatch(r"now-(\d+)([mhd])", dash["time"]["from"])
        assert found and dash["time"]["to"] == "now", (name, dash["time"])
        assert int(found.group(1)) * units[found.group(2)] <= 1800, (name, dash["time"])


def _stat_colour(panel: dict, value: float) -> str:
    """The colour Grafana gives the stat's value: the last threshold step at or below it."""
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    return [s["color"] for s in steps if s["value"] is None or s["value"] <= value][-1]


# Stat panels that say something is wrong, and their colour at 0 and at 1.
TROUBLE_STATS = {
    ("fleet", "Exporters down"): ("green", "red"),
    ("fleet", "Servers in FAULT"): ("green", "red"),
    ("fleet", "GPUs low on memory"): ("green", "orange"),
    ("fleet", "Nodes with queued clients"): ("green", "orange"),
    ("mps-servers-clients", "Daemons up"): ("red", "green"),
}


def test_stat_panels_turn_colour_when_something_is_wrong():
    stats = {(name, p["title"]): p for name, p in _panels() if p["type"] == "stat"}
    for key, colours in TROUBLE_STATS.items():
        assert (_stat_colour(stats[key], 0), _stat_colour(stats[key], 1)) == colours, key
    for key, panel in stats.items():
        # Green says "all is well" only on a panel that can also say otherwise; a plain count
        # (clients, servers) is in the text colour.
        colours = {_stat_colour(panel, v) for v in (0, 1, 10, 1e9)}
        assert colours == {"text"} or len(colours) > 1, (key, colours)


def test_variables():
    for name, dash in DASHBOARDS.items():
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert set(variables) == {"datasource"} | VARIABLES.get(name, NODE_VARIABLES), name
        ds = variables.pop("datasource")
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        for v in variables.values():
            assert v["type"] == "query" and v["datasource"] == common.DATASOURCE
            assert v["query"].startswith("label_values(") and v["multi"]
        # A fleet's dashboards open on one node (one namespace), Grafana selects the first, never All.
        first = variables.pop("node" if "node" in variables else "namespace", None)
        if first:
            assert not first["includeAll"] and "value" not in first["current"], name
        if name not in VARIABLES:
            assert first["query"].endswith(f", {common.C.NODE_LABEL})")
        for v in variables.values():
            assert v["includeAll"] and v["current"]["value"] == "$__all"


def test_panel_ids_unique_and_grid_without_overlap():
    for name, dash in DASHBOARDS.items():
        ids = [p["id"] for p in dash["panels"]]
        assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), name
        cells = set()
        for p in dash["panels"]:
            g = p["gridPos"]
            assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24, (name, p["title"])
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, f"{name}: {p['title']} overlaps another panel"
            cells |= mine


def test_panels_have_datasource_description_unit_and_targets():
    for name, panel in _panels():
        assert panel["type"] in PANEL_TYPES, (name, panel["type"])
        if panel["type"] == "row":
            continue
        where = f"{name}: {panel['title']}"
        assert panel["datasource"] == common.DATASOURCE, where
        assert panel["description"] and len(panel["description"]) > 20, where
        assert panel["targets"], where
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), where
        for t in panel["targets"]:
            assert t["datasource"] == common.DATASOURCE and t["expr"], where
        unit = panel["fieldConfig"]["defaults"]["unit"]
        assert unit, where
        if panel["type"] == "table":
            # Tables: each visible value column has its own unit.
            hidden = next(t for t in panel["transformations"] if t["id"] == "organize")["options"]["excludeByName"]
            columns = ["Value"] if len(refs) == 1 else [f"Value #{r}" for r in refs]
            units = {o["matcher"]["options"] for o in panel["fieldConfig"]["overrides"]
                     if any(p["id"] == "unit" for p in o["properties"])}
            assert {c for c in columns if not hidden.get(c)} <= units, where
        elif unit in UNIT_EVIDENCE:
            for t in panel["targets"]:
                assert any(s in t["expr"] for s in UNIT_EVIDENCE[unit]), f"{where}: unit {unit} for {t['expr']}"


def _pod_selected(q) -> bool:
    """Every raw series of the query selected by the namespace and pod variables."""
    return all(re.search(re.escape(series) + r'\{[^}]*namespace=~"\$namespace", pod=~"\$pod"', q.expr)
               for series, _ in _metric_names(q.expr))


def test_fleet_and_kubernetes_dashboards_read_recorded_series_only():
    """Issue 19: the fleet view stays fast at 10,000 nodes because it reads only the
    fleet group's aggregates; the Kubernetes one reads the per-pod records, and (issue 31)
    the exporter's client series of the selected pods only, by their own labels."""
    for q in queries(ROOT / generate.JSON_DIR):
        if q.dashboard not in VARIABLES:
            continue
        if q.dashboard == "fleet":
            assert list(_metric_names(q.expr)) == [], q
        else:
            assert _pod_selected(q), q
        names = _recorded_names(q.expr)
        assert all(n in RECORDED for n in names) and (names or q.dashboard == "kubernetes"), q
        if q.dashboard == "fleet":
            assert {RECORDED[n].group for n in names} <= set(FLEET_GROUPS), q
        else:  # every pod-level record is selected by the namespace and pod variables
            for n in names:
                if n.startswith("namespace_pod"):
                    assert re.search(re.escape(n) + r'\{namespace=~"\$namespace", pod=~"\$pod"\}', q.expr), q


def test_per_node_dashboards_select_recorded_series_by_node():
    """A per-node dashboard that reads a record selects it by job and node like a raw
    series: one node's panel never reads the fleet's records."""
    recorded = [(q, name) for q in queries(ROOT / generate.JSON_DIR) if q.dashboard not in VARIABLES
                for name in _recorded_names(q.expr)]
    for q, name in recorded:
        assert name in RECORDED and RECORDED[name].group not in FLEET_GROUPS, q
        selector = re.search(re.escape(name) + r"\{([^}]*)\}", q.expr)
        assert selector and 'job=~"$job"' in selector.group(1) and 'instance=~"$node"' in selector.group(1), q



def test_client_memory_panels_read_the_series_the_alert_reads():
    """The memory and Kubernetes dashboards show each client's memory against its limit as
    the exporter serves it, the series MpsClientNearMemoryLimit reads (issue 44: no record
    copies it), with the pod granularity's ratio beside it; the Kubernetes one by pod."""
    alert = next(a for a in definitions.ALERTS if a.name == "ClientNearMemoryLimit")
    assert "mps_client_pinned_memory_usage_ratio{" in alert.expr and not _recorded_names(alert.expr)
    exprs = {(q.dashboard, q.expr) for q in queries(ROOT / generate.JSON_DIR)}
    assert ("memory", client_memory_ratio(common.m)) in exprs
    pods = [e for d, e in exprs if d == "kubernetes" and "mps_client_pinned_memory_usage_ratio" in e]
    assert pods and all('namespace=~"$namespace", pod=~"$pod"' in e and "mps_pod_client_memory_used_bytes" in e
                        for e in pods)

def test_queries_use_contract_metrics_and_the_variables():
    for q in queries(ROOT / generate.JSON_DIR):
        for series, metric in _metric_names(q.expr):
            assert metric in METRICS or metric in SCRAPE_SERIES, f"{q.dashboard}/{q.panel}: {metric}"
            selector = re.search(re.escape(series) + r"\{([^}]*)\}", q.expr).group(1)
            if q.dashboard == "kubernetes":  # by pod, over every node: the job, namespace and pod
                assert selector.startswith(C.JOB_SELECTOR) and _pod_selected(q), q
                continue
            assert 'instance=~"$node"' in selector and 'job=~"$job"' in selector, q
            labels = METRICS[metric].labels if metric in METRICS else ()
            for label, var in (("gpu", "$gpu"), ("daemon", "$daemon")):
                assert (f'{label}=~"{var}"' in selector) == (label in labels), (q, label)


def test_every_contract_metric_is_on_a_dashboard():
    shown = {metric for q in queries(ROOT / generate.JSON_DIR) for _, metric in _metric_names(q.expr)}
    assert set(METRICS) - shown == set()


def test_every_query_is_valid_promql(tmp_path):
    rules = [{"record": f"dashboard:query_{i}:check", "expr": concrete(q.expr)}
             for i, q in enumerate(queries(ROOT / generate.JSON_DIR))]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}))
    out = subprocess.run([require("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout


def test_selector_helper_refuses_unknown_metrics():
    with pytest.raises(KeyError):
        common.m("mps_gpu_made_up_metric")
    assert common.m("mps_server_clients") == 'mps_server_clients{job=~"$job", instance=~"$node", daemon=~"$daemon"}'


def test_runbook_links_name_dashboards_and_panels_that_exist():
    """`Dashboard *X*` / `dashboard *X*, panel *Y*` in the runbook: X is a dashboard's
    title (without "MPS / ") and Y a panel of it."""
    panels = {}
    for path in (ROOT / generate.JSON_DIR).glob("*.json"):
        dash = json.loads(path.read_text())
        panels[dash["title"].split(" / ", 1)[-1]] = {p["title"] for p in dash["panels"]}
    text = re.sub(r"\s+", " ", (ROOT / "alerts" / "runbook.md").read_text())
    refs = re.findall(r"[Dd]ashboard \*([^*]+)\*(?:, panels? \*([^*]+)\*)?", text)
    assert len(refs) >= 10 and sum(1 for _, panel in refs if panel) >= 4
    for dashboard, panel in refs:
        assert dashboard in panels, f"runbook names a dashboard that does not exist: {dashboard}"
        assert not panel or panel in panels[dashboard], f"dashboard {dashboard} has no panel {panel}"
