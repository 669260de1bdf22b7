"""The plain manifests of deploy/kubernetes: rendered from the chart, committed, in sync."""

from __future__ import annotations

import os

import pytest
import yaml

from tests.deploy.helpers import DEPLOY, generator, validate_object

pytest.importorskip("helm_python", reason="helm-python-sdk (test extra) bundles Helm's engine")

KUBERNETES = os.path.join(DEPLOY, "kubernetes")


def test_committed_manifests_match_the_chart():
    generated = generator().generate()
    stale = []
    for name, text in generated.items():
        path = os.path.join(KUBERNETES, name)
        if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
            stale.append(name)
    assert stale == [], f"run python3 deploy/kubernetes/generate.py ({', '.join(stale)} differ)"


def test_manifests_are_valid_and_free_of_helm():
    objects = []
    for name in generator().OUTPUTS:
        with open(os.path.join(KUBERNETES, name), encoding="utf-8") as f:
            objects.extend(doc for doc in yaml.safe_load_all(f) if doc)
    kinds = [o["kind"] for o in objects]
    assert kinds[:5] == ["Namespace", "ServiceAccount", "ConfigMap", "Service", "DaemonSet"]
    assert [p for o in objects for p in validate_object(o)] == []
    text = "".join(open(os.path.join(KUBERNETES, n), encoding="utf-8").read() for n in generator().OUTPUTS)
    assert "helm.sh/chart" not in text and "managed-by: Helm" not in text
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"mps-exporter"}
