"""docs/deploy.md: its configuration examples pass the tools they are written for."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.helpers import ROOT
from tests.support.tools import require

with open(os.path.join(ROOT, "docs", "deploy.md"), encoding="utf-8") as _f:
    DOC = _f.read()
YAML_BLOCKS = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC, re.S)]


def _blocks_with(key):
    return [b for b in YAML_BLOCKS if isinstance(b, dict) and key in b]


@pytest.mark.parametrize("index", range(len(_blocks_with("scrape_configs"))))
def test_scrape_config_examples_pass_promtool(index, tmp_path):
    require("promtool")
    example = dict(_blocks_with("scrape_configs")[index])
    # The documented rule file is the generated one: check it for real.
    rules = os.path.join(ROOT, "alerts", "prometheus", "mps-exporter.rules.yml")
    if example.get("rule_files"):
        assert [os.path.basename(r) for r in example["rule_files"]] == [os.path.basename(rules)]
        assert os.path.exists(rules), "alerts/prometheus/mps-exporter.rules.yml is missing: run make generate"
        example["rule_files"] = [rules]
    for job in example["scrape_configs"]:
        # Debian's promtool is built without Kubernetes service discovery: check the pod
        # discovery's shape here and the rest of the job (relabelling included) with promtool.
        for sd in job.pop("kubernetes_sd_configs", []):
            assert sd["role"] in {"node", "pod", "service", "endpoints", "endpointslice", "ingress"}, sd
            job.setdefault("static_configs", [{"targets": ["127.0.0.1:10138"]}])
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(example))
    result = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    (job,) = _blocks_with("scrape_configs")[index]["scrape_configs"]
    assert job["job_name"] == "mps-exporter"  # what the alert rules select


def test_alertmanager_routing_points_at_the_one_example():
    # One Alertmanager example (alerts/alertmanager.example.yml, checked by amtool in
    # tests/alerts/test_rules.py), not a second tree here that groups and inhibits otherwise.
    assert _blocks_with("route") == [] and _blocks_with("inhibit_rules") == []
    section = DOC.split("## Alertmanager routing", 1)[1].split("\n## ", 1)[0]
    assert "alerts/alertmanager.example.yml" in section


def test_helm_values_example_is_accepted_by_the_chart():
    pytest.importorskip("helm_python")
    from tests.deploy.helpers import find, render

    (text,) = re.findall(r"cat > mps-values.yaml <<'EOF'\n(.*?)\nEOF\n", DOC, re.S)
    values = yaml.safe_load(text)
    objects = render(values, namespace="mps-exporter")
    assert find(objects, "ServiceMonitor") and find(objects, "PrometheusRule")
    dashboards = [o for o in find(objects, "ConfigMap") if o["metadata"]["namespace"] == "monitoring"]
    if os.listdir(os.path.join(ROOT, "deploy", "helm", "mps-exporter", "files", "dashboards")):
        assert dashboards


def _set_values(command: str) -> dict:
    """`--set a.b=c` flags of a helm command as nested values."""
    values: dict = {}
    for key, value in re.findall(r"--set ([\w.]+)=(\S+)", command):
        *parents, leaf = key.split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = {"true": True, "false": False}.get(value, value)
    return values


def _leaves(values: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in values.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_chart_readme_quick_start_works_with_kube_prometheus_stack():
    # The chart's own quick start sets what docs/deploy.md step 4 sets for kube-prometheus-
    # stack's defaults: the release label on the ServiceMonitor and PrometheusRule, and the
    # dashboards in Grafana's namespace; rendered, the objects carry them.
    pytest.importorskip("helm_python")
    from tests.deploy.helpers import find, render

    with open(os.path.join(ROOT, "deploy", "helm", "mps-exporter", "README.md"), encoding="utf-8") as f:
        readme = f.read()
    (command,) = re.findall(r"^helm install .*?(?<!\\)\n", readme.replace("\\\n", " "), re.M | re.S)
    quick = _set_values(command)
    (text,) = re.findall(r"cat > mps-values.yaml <<'EOF'\n(.*?)\nEOF\n", DOC, re.S)
    documented = _leaves(yaml.safe_load(text))
    assert {k: v for k, v in _leaves(quick).items() if k in documented} == documented
    objects = render(quick, namespace="mps-exporter")
    for kind in ("ServiceMonitor", "PrometheusRule"):
        (obj,) = find(objects, kind)
        assert obj["metadata"]["labels"].get("release") == "kube-prometheus-stack", kind
    dashboards = [o for o in find(objects, "ConfigMap") if o["metadata"].get("labels", {}).get("grafana_dashboard")]
    assert dashboards and {o["metadata"]["namespace"] for o in dashboards} == {"monitoring"}


def test_documented_paths_exist():
    for path in re.findall(r"`((?:deploy|alerts|dashboards|docs)/[\w./-]+)`", DOC):
        if "<" in path or "*" in path:
            continue
        assert os.path.exists(os.path.join(ROOT, path)), path


def test_internal_links_resolve():
    def slug(title):  # GitHub's heading anchors
        return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")

    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", DOC, re.M)}
    links = set(re.findall(r"\]\(#([^)]+)\)", DOC))
    assert links and links <= anchors, links - anchors


def test_the_demo_is_described_as_the_session_it_plays():
    # The compose demo replays the shipped session: its GPU and length, as recorded.
    from mps_exporter.bundle import load
    from mps_exporter.replay import shipped_bundle

    bundle = load(shipped_bundle())
    demo = DOC.split("- **demo** runs", 1)[1].split("\n- **", 1)[0]
    (gpu,) = {g["name"] for g in bundle.end["gpus"]}
    assert re.sub(r"\s+", " ", demo).count(gpu) == 1, demo
    assert f"{bundle.duration:.1f}-second loop" in demo
