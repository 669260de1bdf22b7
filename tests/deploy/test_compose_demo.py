"""The compose `demo` profile, minus Docker: the exporter's demo command (replay of
the shipped session) scraped by the real Prometheus with the compose stack's own
configuration and rule file. Only the addresses change (no container network here).

The shipped session (exporter/data/, recorded by tests/gpu/record_bundle.py) must show
every panel: once it has played through, every expression of every dashboard returns
data. The exceptions: the Kubernetes dashboard joins kube-state-metrics, which the demo
has not (tests/alerts/test_kubernetes_fleet.py tests it with a kube-state-metrics
exposition), and the panels for `--mps.client-granularity server` read series the
demo's default granularity does not publish (the fleet test runs an exporter in that
mode)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from dashboards.queries import concrete, queries
from mps_exporter.bundle import load
from mps_exporter.replay import shipped_bundle
from tests.deploy.helpers import DEPLOY, ROOT, load_yaml
from tests.support.prometheus import Prometheus, free_port, prometheus_binary, stop_process

pytestmark = pytest.mark.slow

COMPOSE_DIR = os.path.join(DEPLOY, "compose")
# Bundle seconds per real second, and the scrape interval: the shortest scene of the
# session (the client with CUDA_MPS_CLIENT_PRIORITY=1, about 9 s) must get several scrapes.
SPEED = 3
SCRAPE = "500ms"
NEEDS_PODS = {"kubernetes"}  # the demo's recorded node runs no pods: tests/alerts/test_kubernetes_fleet.py
# Panels of the other client granularities (`--mps.client-granularity pod` or `server`:
# sums instead of per-client series); the demo runs the default, per client.
OTHER_GRANULARITIES = ("(--mps.client-granularity pod)", "(--mps.client-granularity server)")
RULES = os.path.join(ROOT, "alerts", "prometheus", "mps-exporter.rules.yml")
# Series of the live exporter itself that the shipped session, recorded before they
# existed, cannot replay (a bundle recorded since carries them).
NOT_IN_SHIPPED_SESSION = (
    "mps_exporter_control_commands_total",
    # The session sets no default client priority, and its server predates the
    # `Server Priority set to N` line the exporter now reads.
    "mps_default_client_priority", "mps_server_priority",
    # No client's own limit is ignored and no CUDA process runs beside MPS while the
    # daemon is up (the two processes without MPS at 98-110 s run after `quit`).
    "mps_client_limit_ignored", "mps_process_outside_mps_",
    # Its daemon (driver 580) knows every command the exporter sends (issue 41), and it was
    # recorded before the Xid source existed (issue 40).
    "mps_exporter_control_commands_unknown_total", "mps_gpu_xid_",
)


def _wait_http(url: str, process: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"exporter exited: {process.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout}s")


@pytest.fixture
def demo_exporter():
    command = load_yaml(os.path.join(COMPOSE_DIR, "compose.yaml"))["services"]["exporter-demo"]["command"]
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "mps_exporter.cli", *command, "--speed", str(SPEED), f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        _wait_http(f"http://127.0.0.1:{port}/-/healthy", process)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(process)


def _has_numbers(matrix: dict) -> bool:
    return any(value != "NaN" for series in matrix["result"] for _, value in series["values"])


def test_demo_stack_scrapes_and_evaluates_the_rules(demo_exporter, tmp_path):
    prometheus_binary()
    assert os.path.exists(RULES), "alerts/prometheus/mps-exporter.rules.yml is missing: run make generate"
    config = load_yaml(os.path.join(COMPOSE_DIR, "prometheus", "prometheus.yml"))
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "mps-exporter"]
    instance = job["static_configs"][0]["labels"]["instance"]
    job["static_configs"][0]["targets"] = [demo_exporter]
    job["scrape_interval"] = job["scrape_timeout"] = SCRAPE
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["scrape_configs"] = [job]  # the self-scrape job needs Prometheus' own port
    # What compose mounts into rules/, with the groups' own 1m intervals cut to 1s
    # (Prometheus would take up to a minute to evaluate them first).
    rules = load_yaml(RULES)
    for group in rules["groups"]:
        if "interval" in group:
            group["interval"] = "1s"
    fast_rules = tmp_path / "mps-exporter.rules.yml"
    fast_rules.write_text(yaml.safe_dump(rules))
    config["rule_files"] = [str(fast_rules)]
    config.pop("alerting")  # no Alertmanager in this test
    prom = Prometheus(str(tmp_path), config)
    try:
        prom.start()
        started = time.time()
        (target,) = prom.wait_for_target_up(job="mps-exporter")
        assert target["labels"]["instance"] == instance
        up = prom.wait_for('mps_control_daemon_up{job="mps-exporter"}')
        assert {s["metric"]["instance"] for s in up} == {instance}
        prom.wait_for('mps_server_info{job="mps-exporter"}')  # a recorded MPS server
        # Every rule of the file is loaded and, after a few evaluations over the
        # replayed series, none has an error.
        expected = {g["name"]: len(g["rules"]) for g in load_yaml(RULES)["groups"]}
        deadline = time.monotonic() + 20
        while True:
            groups = prom.rules()
            rules = [r for g in groups for r in g["rules"]]
            # A rule never evaluated reports Go's zero time.
            evaluated = rules and not any(r["lastEvaluation"].startswith("0001") for r in rules)
            if evaluated or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert evaluated, "rules not evaluated within 20s"
        assert {g["name"]: len(g["rules"]) for g in groups} == expected
        assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
        # The whole session has played (plus a few scrapes): every panel has data.
        played = load(shipped_bundle()).duration / SPEED
        time.sleep(max(0.0, started + played + 4 - time.time()))
        empty = [f"{q.dashboard} / {q.panel} / {q.ref_id}: {q.expr}" for q in queries()
                 if q.dashboard not in NEEDS_PODS and not q.panel.endswith(OTHER_GRANULARITIES)
                 and not any(m in q.expr for m in NOT_IN_SHIPPED_SESSION)
                 and not _has_numbers(prom.api(
                     "query_range", query=concrete(q.expr, rate_interval="10s"), start=str(started),
                     end=str(time.time()), step="1"))]
        assert empty == []
    finally:
        prom.stop()
