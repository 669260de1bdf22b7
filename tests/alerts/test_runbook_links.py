"""The runbook link of a firing alert resolves in every shipped and documented scrape
set-up: compose (deploy/compose/prometheus/prometheus.yml), static targets and
Kubernetes pods (docs/deploy.md) and kube-prometheus-stack (the chart's ServiceMonitor,
as the Prometheus Operator turns it into a scrape job).

Each set-up's own scrape job runs in the real Prometheus with the real rule file; only
the target changes: a closed local port, so that `MpsExporterTargetDown` fires through
the set-up's relabeling, and the service-discovery labels Kubernetes would give the
target are set on a static one. The alert's rendered `runbook_url` must name a section
of alerts/runbook.md at the project's documented Source URL."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Dict, List

import pytest
import yaml

from alerts import generate
from tests.support.prometheus import Prometheus, free_port, prometheus_binary

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent
ALERT = "MpsExporterTargetDown"
NODE = "gpu-node-07"
# What Kubernetes service discovery says of the exporter's pod (role pod, and role endpoints
# for a ServiceMonitor), as labels of a static target.
POD_META = {
    "__meta_kubernetes_namespace": "mps-exporter",
    "__meta_kubernetes_pod_name": "mps-exporter-x7k2q",
    "__meta_kubernetes_pod_node_name": NODE,
    "__meta_kubernetes_pod_label_app_kubernetes_io_name": "mps-exporter",
    "__meta_kubernetes_pod_container_name": "mps-exporter",
    "__meta_kubernetes_pod_container_port_name": "metrics",
}
SERVICE_META = {
    "__meta_kubernetes_service_name": "mps-exporter",
    "__meta_kubernetes_service_label_app_kubernetes_io_name": "mps-exporter",
    "__meta_kubernetes_endpoint_port_name": "metrics",
}


def _yaml_blocks(markdown: str) -> List[dict]:
    return [yaml.safe_load(b) for b in re.findall(r"^```yaml\n(.*?)^```$", markdown, re.MULTILINE | re.DOTALL)]


def _documented_jobs() -> Dict[str, dict]:
    section = (ROOT / "docs" / "deploy.md").read_text().split("## Prometheus scrape configuration", 1)[1]
    section = section.split("\n## ", 1)[0]
    jobs = [job for block in _yaml_blocks(section) for job in block.get("scrape_configs", [])]
    static = [j for j in jobs if "static_configs" in j]
    pods = [j for j in jobs if "kubernetes_sd_configs" in j]
    assert len(static) == 1 and len(pods) == 1, jobs
    return {"static": static[0], "kubernetes": pods[0]}


def _operator_job(monitor: dict) -> dict:
    """The scrape job the Prometheus Operator makes of the ServiceMonitor's endpoint (the
    labels it sets for every endpoint, then the endpoint's own relabelings)."""
    spec = monitor["spec"]
    (endpoint,) = spec["endpoints"]
    job_label = re.sub(r"[^A-Za-z0-9_]", "_", spec["jobLabel"])
    relabel = [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
        {"source_labels": [f"__meta_kubernetes_service_label_{job_label}"], "target_label": "job", "regex": "(.+)"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
    ]
    for r in endpoint.get("relabelings", []):
        relabel.append({{"sourceLabels": "source_labels", "targetLabel": "target_label"}.get(k, k): v
                        for k, v in r.items()})
    return {"job_name": f"serviceMonitor/{monitor['metadata']['namespace']}/{monitor['metadata']['name']}/0",
            "relabel_configs": relabel}


def _setups() -> Dict[str, dict]:
    """Set-up -> (its scrape job, the labels its service discovery gives the target)."""
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "prometheus" / "prometheus.yml").read_text())
    (compose_job,) = [j for j in compose["scrape_configs"] if j["job_name"] == "mps-exporter"]
    documented = _documented_jobs()
    monitor = next(d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "servicemonitor.yaml").read_text())
                   if d and d.get("kind") == "ServiceMonitor")
    return {
        "compose": {"job": compose_job, "meta": {}},
        "static": {"job": documented["static"], "meta": {}},
        "kubernetes": {"job": documented["kubernetes"], "meta": POD_META},
        "kube-prometheus-stack": {"job": _operator_job(monitor), "meta": {**POD_META, **SERVICE_META}},
    }


def _on_a_closed_port(setup: dict, port: int) -> dict:
    """The set-up's job with one target, nobody listening, carrying the discovery labels;
    each configured target's own labels are kept."""
    job = {k: v for k, v in setup["job"].items() if k not in ("kubernetes_sd_configs", "static_configs")}
    labels = dict(setup["meta"])
    for static in setup["job"].get("static_configs", []):
        labels.update(static.get("labels", {}))
    job.update(scrape_interval="1s", scrape_timeout="500ms",
               static_configs=[{"targets": [f"127.0.0.1:{port}"], "labels": labels}])
    return job


def _resolves(url: str) -> None:
    """The documented external runbook: alerts/runbook.md at the project's Source URL, and
    the anchor one of its sections."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    source = re.search(r'^Source = "([^"]+)"$', pyproject, re.MULTILINE)
    assert source is not None
    documented = f"{source.group(1)}/blob/main/alerts/runbook.md"
    assert documented in (ROOT / "docs" / "deploy.md").read_text()  # where users are told the links go
    page, _, anchor = url.partition("#")
    assert page == documented, url
    sections = {h.lower() for h in re.findall(r"^## (\w+)$", (ROOT / "alerts" / "runbook.md").read_text(), re.M)}
    assert anchor in sections, url


@pytest.mark.parametrize("name", ["compose", "static", "kubernetes", "kube-prometheus-stack"])
def test_a_firing_alert_s_runbook_link_resolves(name, tmp_path):
    prometheus_binary()
    setup = _setups()[name]
    rules = tmp_path / "rules.yml"
    rules.write_text(generate.prometheus_rules(for_override="1s", interval_override="1s"))
    job = _on_a_closed_port(setup, free_port())
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
              "scrape_configs": [job]}
    prom = Prometheus(str(tmp_path), config)
    prom.start()
    try:
        deadline = time.monotonic() + 60
        firing: List[dict] = []
        while not firing and time.monotonic() < deadline:
            firing = [a for a in prom.alerts() if a["labels"]["alertname"] == ALERT and a["state"] == "firing"]
            time.sleep(0.5)
        assert firing, f"{ALERT} did not fire through the {name} scrape job; targets: {prom.targets()}"
    finally:
        prom.stop()
    (alert,) = firing
    # The set-up's relabeling is in force (what broke the link built from `instance`) ...
    expected_instance = {"compose": "mps-host", "static": "127.0.0.1", "kubernetes": NODE,
                         "kube-prometheus-stack": NODE}[name]
    assert alert["labels"]["instance"] == expected_instance, alert["labels"]
    # ... and the link still leads to the alert's section.
    assert alert["annotations"]["runbook_url"].endswith(f"#{ALERT.lower()}")
    _resolves(alert["annotations"]["runbook_url"])
