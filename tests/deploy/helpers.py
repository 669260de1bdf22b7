"""Shared pieces of the deploy checks: paths, the chart renderer, schema validation."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
from typing import List, Optional

import jsonschema
import yaml

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEPLOY = os.path.join(ROOT, "deploy")
CHART = os.path.join(DEPLOY, "helm", "mps-exporter")
SCHEMAS = os.path.join(os.path.dirname(__file__), "schemas")

# Kubernetes version every rendered object is validated against: the oldest minor
# release still supported upstream when this was written (1.33, 1.34 and 1.35 are).
KUBERNETES_VERSION = "1.33.0"

# CRD kinds -> the vendored openAPIV3Schema (see the header of each file for its source).
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.v0.84.1.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.v0.82.2.yaml",
}


def ci_values_files() -> List[str]:
    return sorted(glob.glob(os.path.join(CHART, "ci", "*-values.yaml")))


def load_yaml(path: str):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


@functools.lru_cache(maxsize=1)
def generator():
    """deploy/kubernetes/generate.py as a module: the one place that renders the chart."""
    spec = importlib.util.spec_from_file_location("deploy_generate", os.path.join(DEPLOY, "kubernetes", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render(values: Optional[dict] = None, namespace: str = "monitoring") -> List[dict]:
    gen = generator()
    return gen.objects(gen.render_chart(values, release="mps-exporter", namespace=namespace))


def find(objects: List[dict], kind: str) -> List[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: List[dict], kind: str) -> dict:
    found = find(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def _strict(schema):
    """Reject unknown fields, as the API server does under kubectl's default
    server-side field validation (Strict): every object with declared properties
    and no additionalProperties becomes closed."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.lru_cache(maxsize=None)
def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = load_yaml(os.path.join(SCHEMAS, CRD_SCHEMAS[(api_version, kind)]))
    schema.pop("x-definitions", None)  # anchors only; already expanded by the YAML parser
    return jsonschema.Draft7Validator(_strict(schema))


def validate_object(obj: dict) -> List[str]:
    """Problems with one rendered object: Kubernetes' schemas for built-in kinds,
    the vendored CRD schemas for the operator's kinds. Empty when it is valid."""
    import kubernetes_validate

    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_SCHEMAS:
        errors = [f"{name}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in crd_validator(*key).iter_errors(obj)]
        # The CRD leaves metadata to the API server: check it as ObjectMeta by
        # validating it on a ConfigMap, the smallest object that has one.
        errors += validate_object({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})})
        return errors
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{name}: {'/'.join(map(str, e.path))}: {e.message}"]
    return []
