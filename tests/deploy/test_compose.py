"""deploy/compose: the compose file parses, references only files that exist, and the
Prometheus and Alertmanager configurations it mounts pass their own tools' checks."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import jsonschema
import pytest
import yaml

from tests.deploy.helpers import DEPLOY, ROOT, load_yaml
from tests.support.tools import require

COMPOSE_DIR = os.path.join(DEPLOY, "compose")
COMPOSE = load_yaml(os.path.join(COMPOSE_DIR, "compose.yaml"))
SERVICES = COMPOSE["services"]
# Paths other parts of the project generate; until they exist the checks that need
# them skip (with a reason) rather than fail.
GENERATED = ("alerts/prometheus/", "alerts/grafana", "dashboards/json")

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interpolate(text: str) -> str:
    """Compose's ${VAR:-default} with an empty environment: the default."""
    return _VAR.sub(lambda m: m.group(2) or "", text)


def _bind_mounts():
    """(service, host path, container path) of every bind mount, host path resolved."""
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source, target = _interpolate(volume).split(":")[:2]
            if source.startswith((".", "/")):
                host = os.path.normpath(os.path.join(COMPOSE_DIR, source))
                yield name, host, target


def _mount_target(service: str, host_path: str) -> str:
    for name, host, target in _bind_mounts():
        if name == service and host == os.path.normpath(host_path):
            return target
    raise AssertionError(f"{service} does not mount {host_path}")


def _needs(path: str):
    assert os.path.exists(path), f"{os.path.relpath(path, ROOT)} is missing: run make generate"
    return path


def test_compose_file_parses_with_the_expected_services():
    assert set(SERVICES) == {"exporter", "exporter-demo", "prometheus", "alertmanager", "grafana"}
    assert SERVICES["exporter"]["profiles"] == ["gpu"]
    assert SERVICES["exporter-demo"]["profiles"] == ["demo"]
    # Both exporter variants answer to the name Prometheus scrapes.
    for name in ("exporter", "exporter-demo"):
        assert "mps-exporter" in SERVICES[name]["networks"]["default"]["aliases"]
    assert set(COMPOSE["volumes"]) >= {v.split(":")[0] for s in SERVICES.values()
                                       for v in s.get("volumes", []) if not v.startswith((".", "/", "$"))}


def test_compose_file_matches_the_compose_schema():
    """The Compose Specification schema shipped with docker-compose 1.29.2 (no Docker
    Compose here to run `docker compose config`)."""
    schema_path = os.path.join(os.path.dirname(__file__), "schemas", "compose_spec.docker-compose-1.29.2.json")
    with open(schema_path, encoding="utf-8") as f:
        validator = jsonschema.Draft201909Validator(json.load(f))
    with open(os.path.join(COMPOSE_DIR, "compose.yaml"), encoding="utf-8") as f:
        document = yaml.safe_load(_interpolate(f.read()))
    # Issue 43: docker-compose 1.29.2 (Debian 12's) refused the top-level `name:`.
    assert "name" not in document and "version" not in document
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
    assert errors == []
    document["services"]["grafana"]["profile"] = ["demo"]  # a misspelt key is caught
    assert any("profile" in e.message for e in validator.iter_errors(document))


@pytest.mark.slow
def test_debian_docker_compose_loads_the_file(tmp_path):
    """Issue 43: Debian 12's own docker-compose (1.29.2) rejected the file's top-level
    `name:`. Its `config` parses and validates the file with no Docker daemon, both
    profiles' services included; the project name comes from .env, which it reads too."""
    program = require("docker-compose")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "MPS_", "GRAFANA_"))}
    for profile in ("demo", "gpu"):
        out = subprocess.run([program, "--project-directory", COMPOSE_DIR, "-f", os.path.join(COMPOSE_DIR, "compose.yaml"),
                              "--profile", profile, "config", "--services"],
                             capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert set(out.stdout.split()) == set(SERVICES), out.stdout
    with open(os.path.join(COMPOSE_DIR, ".env"), encoding="utf-8") as f:
        settings = dict(line.strip().split("=", 1) for line in f if line.strip() and not line.startswith("#"))
    assert settings == {"COMPOSE_PROJECT_NAME": "mps-exporter"}


def test_compose_references_only_existing_files():
    host_only = []  # paths on the GPU host (pipe and log directories), not in the repo
    for service, host, _ in _bind_mounts():
        if not host.startswith(ROOT):
            host_only.append(host)
            continue
        rel = os.path.relpath(host, ROOT)
        if rel.startswith(GENERATED) and not os.path.exists(host):
            continue  # checked by the tests that skip until it is generated
        assert os.path.exists(host), f"{service} mounts {rel}, which does not exist"
    assert sorted(host_only) == ["/run/nvidia-mps", "/var/log/nvidia-mps"]
    build = SERVICES["exporter"]["build"]
    assert os.path.isfile(os.path.join(COMPOSE_DIR, build["context"], build["dockerfile"]))
    for generated in ("alerts/prometheus/mps-exporter.rules.yml", "alerts/grafana", "dashboards/json"):
        _needs(os.path.join(ROOT, generated))


def test_images_are_pinned():
    for name, service in SERVICES.items():
        if "build" in service:
            continue  # built here from the repository's Dockerfile
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and re.search(r"\d", tag), f"{name}: {image} is not pinned"


def test_gpu_exporter_least_privilege():
    exporter = SERVICES["exporter"]
    assert exporter["runtime"] == "nvidia" and exporter["pid"] == "host"
    assert exporter["cap_drop"] == ["ALL"]
    assert exporter["cap_add"] == ["SYS_PTRACE", "DAC_READ_SEARCH"]
    assert exporter["read_only"] is True
    assert "no-new-privileges:true" in exporter["security_opt"]
    for volume in exporter["volumes"]:
        if _interpolate(volume).startswith("/"):
            assert volume.endswith(":ro"), volume


def test_gpu_exporter_flags_parse():
    from mps_exporter import cli as exporter_config

    command, cfg = exporter_config.parse_args([_interpolate(a) for a in SERVICES["exporter"]["command"]])
    assert command == "serve"
    assert [(d.pipe_directory, d.log_directory) for d in cfg.daemons] == [("/run/nvidia-mps", "/var/log/nvidia-mps")]
    # The mounts follow the flags.
    mounted = {target for _, _, target in _bind_mounts()}
    assert {"/run/nvidia-mps", "/var/log/nvidia-mps"} <= mounted


def test_demo_runs_replay():
    command = SERVICES["exporter-demo"]["command"]
    assert command[0] == "replay"
    result = subprocess.run([sys.executable, "-m", "mps_exporter.cli", command[0], "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for flag in command[1:]:
        assert flag.split("=")[0] in result.stdout, f"replay has no {flag}"


def test_prometheus_config_passes_promtool(tmp_path):
    promtool = require("promtool")
    # Lay the files out as the container sees them, rules included, so that
    # promtool also checks the rule files the config names.
    config = os.path.join(COMPOSE_DIR, "prometheus", "prometheus.yml")
    rules = _needs(os.path.join(ROOT, "alerts", "prometheus", "mps-exporter.rules.yml"))
    etc = tmp_path / "etc-prometheus"
    (etc / "rules").mkdir(parents=True)
    shutil.copy(config, etc / "prometheus.yml")
    assert _mount_target("prometheus", config) == "/etc/prometheus/prometheus.yml"
    target = _mount_target("prometheus", rules)
    assert os.path.dirname(target) == "/etc/prometheus/rules"
    shutil.copy(rules, etc / "rules" / os.path.basename(target))
    result = subprocess.run([promtool, "check", "config", str(etc / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rules found" not in result.stdout  # the real file has many
    assert re.search(r"SUCCESS: \d+ rules found", result.stdout), result.stdout


def test_prometheus_scrapes_the_exporter_as_the_rules_expect():
    config = load_yaml(os.path.join(COMPOSE_DIR, "prometheus", "prometheus.yml"))
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "mps-exporter"]
    assert job["static_configs"][0]["targets"] == ["mps-exporter:10138"]
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    assert "alertmanager" in SERVICES and "9093:9093" in SERVICES["alertmanager"]["ports"]


def test_alertmanager_config_passes_amtool():
    amtool = require("amtool")
    config = os.path.join(COMPOSE_DIR, "alertmanager", "alertmanager.yml")
    assert _mount_target("alertmanager", config) == "/etc/alertmanager/alertmanager.yml"
    result = subprocess.run([amtool, "check-config", config], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alertmanager_config_routes_and_inhibits_as_the_example():
    # The compose stack's Alertmanager is the one example without notifiers: the same
    # route tree and inhibitions, the same receiver names.
    compose = load_yaml(os.path.join(COMPOSE_DIR, "alertmanager", "alertmanager.yml"))
    example = load_yaml(os.path.join(ROOT, "alerts", "alertmanager.example.yml"))
    assert compose["route"] == example["route"]
    assert compose["inhibit_rules"] == example["inhibit_rules"]
    assert [r["name"] for r in compose["receivers"]] == [r["name"] for r in example["receivers"]]
    assert all(set(r) == {"name"} for r in compose["receivers"])  # notifies nobody


def test_grafana_provisioning_matches_what_it_loads():
    datasources = load_yaml(os.path.join(COMPOSE_DIR, "grafana", "provisioning", "datasources", "prometheus.yml"))
    (datasource,) = datasources["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    providers = load_yaml(os.path.join(COMPOSE_DIR, "grafana", "provisioning", "dashboards", "mps-exporter.yml"))
    (provider,) = providers["providers"]
    dashboards = _needs(os.path.join(ROOT, "dashboards", "json"))
    assert provider["options"]["path"] == _mount_target("grafana", dashboards)
    # Issue 43: the stack evaluates each alert once, in Prometheus (routed to Alertmanager);
    # Grafana-managed copies would evaluate all of them again and notify no one.
    grafana_mounts = [(host, target) for name, host, target in _bind_mounts() if name == "grafana"]
    assert all("alerting" not in target and os.path.join("alerts", "grafana") not in host
               for host, target in grafana_mounts), grafana_mounts
    assert glob.glob(os.path.join(dashboards, "*.json")), "dashboards/json holds no dashboard"
    # Every Grafana alert query names the provisioned data source.
    used = set()
    for path in glob.glob(os.path.join(ROOT, "alerts", "grafana", "*.json")):
        with open(path, encoding="utf-8") as f:
            for group in json.load(f)["groups"]:
                for rule in group["rules"]:
                    used |= {q["datasourceUid"] for q in rule["data"] if q["datasourceUid"] != "-100"}
    assert used, "alerts/grafana holds no Grafana alert rule: run make generate"
    assert used == {datasource["uid"]}
