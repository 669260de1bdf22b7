"""Issue 43: the demo (`mps-exporter replay`, the shipped session in a loop on the present
clock, as deploy/compose's demo profile runs it) behind Prometheus for 15 minutes fires
no alert but those the recorded session itself should fire, first at the moment it
recorded them, and the demo stack's Alertmanager pages nobody.

How, and why not a live 15-minute run: the replay's player, collector and log pipeline
run for real, stepped on a clock this test sets (tests/support/replay_series.py), one
exposition every 15 s (the compose stack's scrape and evaluation interval) over 15
minutes; those series are `promtool test rules` input series, and promtool evaluates the
shipped rule file over them with Prometheus' own rule engine (groups at their own
intervals, `for:` as written, staleness as a scrape marks it). It takes seconds, not 15
minutes, and gives the same answer on every run and machine: no scrape or evaluation
phase, no loaded CI box can move an alert by one evaluation. The path through a running
Prometheus and Alertmanager is covered by tests/alerts/test_end_to_end.py; here amtool
routes each alert the demo fires through the compose stack's alertmanager.yml.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from alerts import generate
from tests.support.promtool import run_rule_tests
from tests.support.replay_alerts import BY_NAME, EVENTS, INTERVAL, MINUTES, expected_firing, recorded_moments, replayed
from tests.support.replay_series import promtool_values
from tests.support.tools import require

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_ALERTMANAGER = ROOT / "deploy/compose/alertmanager/alertmanager.yml"


def test_event_alerts_read_their_counters():
    for name, counter in EVENTS.items():
        assert f"increase({counter}{{" in BY_NAME[name].expr and BY_NAME[name].for_ == "0m", name


def test_the_session_records_each_event_in_the_first_lap():
    for counter in EVENTS.values():
        moments = recorded_moments(counter)
        assert moments and moments[0] < 180, (counter, moments)


def test_fifteen_minutes_of_the_demo_fire_only_the_recorded_events(tmp_path):
    times, series = replayed(MINUTES * 60)
    checks = []
    for t in times:
        checks.append({
            "expr": 'group by (alertname) (ALERTS{alertstate="firing"})',
            "eval_time": f"{int(t)}s",
            "exp_samples": [{"labels": f'{{alertname="{name}"}}', "value": 1} for name in expected_firing(t)],
        })
    res = run_rule_tests(tmp_path, generate.prometheus_rules(), {"evaluation_interval": f"{INTERVAL}s", "tests": [{
        "interval": f"{INTERVAL}s",
        "input_series": [{"series": key, "values": promtool_values(values)} for key, values in series.items()],
        "promql_expr_test": checks,
    }]}, name="replay.test.yml")
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    # The test asserted something: each event alert is expected from its recorded moment on.
    firing = {name for t in times for name in expected_firing(t)}
    assert firing == set(EVENTS) and expected_firing(times[0]) == []


@pytest.mark.parametrize("name", sorted(EVENTS))
def test_the_demo_stack_pages_nobody(name):
    """Whatever the demo fires goes to a receiver of the compose Alertmanager with no
    notifier: the demo stack shows alerts and sends none."""
    res = subprocess.run([require("amtool"), "config", "routes", "test", f"--config.file={COMPOSE_ALERTMANAGER}",
                          f"alertname={name}", f"severity={BY_NAME[name].severity}", "instance=demo:10138"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    receivers = {r["name"]: r for r in yaml.safe_load(COMPOSE_ALERTMANAGER.read_text())["receivers"]}
    routed = res.stdout.split()
    assert routed and all(set(receivers[r]) == {"name"} for r in routed), (routed, receivers)
