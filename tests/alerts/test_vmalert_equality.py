"""Issue 43: the fleet rules (the `fleet` and `fleet-totals` groups, and the `rules` group's
record they read) give the same values under vmalert over VictoriaMetrics (Debian's
victoria-metrics package) as under Prometheus' rule engine, on the fleet bench's data
(tests/support/fleet_series.py: NODES copies of the bench's 8 x 48 node, one target down,
scraped every 15 s for 30 minutes, each scrape 7 s after the minute the rules run at, so no
window's edge falls on a sample).

VictoriaMetrics side: the series imported with their timestamps, then `vmalert -replay`
evaluates the groups one after another (a run each, the store flushed between them, so a
group reads what the one before it wrote) at 1 m steps over the last 20 minutes, and writes
the records back. Prometheus side: `promtool test rules` over the same series evaluates the
same groups every minute and asserts, at every step, that each series vmalert wrote has the
same value (to 1e-9 relative: VictoriaMetrics keeps 12 significant digits) and that each
record has as many series as vmalert wrote. Nothing waits on a wall clock: both evaluate
the past.

The 10 minutes before the compared range give every `rate(...[5m])` a full window: over a
counter's first 5 minutes Prometheus extrapolates its increase to the window's start (or to
the counter's zero) and divides by the window, while MetricsQL's `rate` divides the increase
it saw by the time it spans, so the two differ there by design
(https://docs.victoriametrics.com/MetricsQL.html#rate); likewise where a counter steps
inside the window. The counters here grow at a steady rate, where both give the slope (with counters that step
every 100 s instead, this test fails on the `:rate5m` records).
"""

from __future__ import annotations

import datetime
import json
import subprocess
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import yaml

from alerts import generate
from alerts.recordings import RECORDINGS
from tests.support import fleet_series
from tests.support.promtool import run_rule_tests
from tests.support.tools import require
from tests.support.victoria import running_victoria_metrics

pytestmark = pytest.mark.slow

WARMUP = 10 * 60  # data before the compared range: full rate windows
COMPARED = 20 * 60
STEP = 60  # the groups' interval (config.FLEET_RULES_INTERVAL; the `rules` group at the global 1m here)
RECORDS = sorted(r.record for r in RECORDINGS if r.group in fleet_series.GROUPS)
FLEET_RECORDS = {r.record for r in RECORDINGS if r.group.startswith("fleet")}


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selector(metric: Dict[str, str]) -> str:
    labels = ", ".join(f'{k}={json.dumps(v)}' for k, v in sorted(metric.items()) if k != "__name__")
    return f"{metric['__name__']}{{{labels}}}"


def rule_groups() -> List[dict]:
    """The shipped rule file's groups that hold the compared records, in the file's order."""
    names = {f"mps-exporter.{g}" for g in fleet_series.GROUPS}
    groups = [g for g in yaml.safe_load(generate.prometheus_rules())["groups"] if g["name"] in names]
    assert [g["name"] for g in groups] == [f"mps-exporter.{g}" for g in fleet_series.GROUPS]
    return groups


def vmalert_records(tmp: Path, start: float) -> Dict[float, List[Tuple[Dict[str, str], float]]]:
    """seconds after the data's start -> [(labels, value)] of every record vmalert wrote."""
    times, series = fleet_series.scrapes(WARMUP + COMPARED, start=start + fleet_series.OFFSET)
    with running_victoria_metrics(tmp) as vm:
        urllib.request.urlopen(urllib.request.Request(f"{vm.url}/api/v1/import/prometheus",
                                                      data=fleet_series.import_lines(times, series).encode()),
                               timeout=60).read()
        vm.get("/internal/force_flush")
        for group in rule_groups():
            rules = tmp / f"{group['name']}.yml"
            rules.write_text(yaml.safe_dump({"groups": [group]}))
            res = subprocess.run([require("vmalert"), f"-rule={rules}", f"-datasource.url={vm.url}",
                                  f"-remoteWrite.url={vm.url}", f"-evaluationInterval={STEP}s",
                                  f"-datasource.queryStep={STEP}s", f"-replay.timeFrom={_iso(start + WARMUP)}",
                                  f"-replay.timeTo={_iso(start + WARMUP + COMPARED)}",
                                  "-replay.disableProgressBar", "-replay.rulesDelay=1s",
                                  "-remoteWrite.flushInterval=100ms", "-loggerLevel=WARN"],
                                 capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
            time.sleep(0.5)  # remote write's last flush (100 ms) reached the store before it exits; flush it
            vm.get("/internal/force_flush")
        names = "|".join(r.replace(":", "\\\\:") for r in RECORDS)
        exported = vm.get("/api/v1/export", **{"match[]": f'{{__name__=~"{names}"}}'}).decode().splitlines()
    out: Dict[float, Dict[str, Tuple[Dict[str, str], float]]] = defaultdict(dict)
    for line in exported:
        row = json.loads(line)
        for ts, value in zip(row["timestamps"], row["values"]):
            # A replay's requests overlap by their end point: the same sample twice.
            out[ts / 1000 - start][_selector(row["metric"])] = (row["metric"], value)
    return {t: list(by_key.values()) for t, by_key in sorted(out.items())}


def test_vmalert_and_prometheus_agree_on_every_fleet_record(tmp_path):
    start = (int(time.time()) // 3600 - 2) * 3600  # an hour mark inside VictoriaMetrics' 1d retention
    vm = vmalert_records(tmp_path, start)
    assert sorted(vm) == [float(t) for t in range(WARMUP, WARMUP + COMPARED + 1, STEP)], sorted(vm)

    checks = []
    compared: Dict[str, int] = defaultdict(int)
    for t, rows in vm.items():
        counts: Dict[str, int] = defaultdict(int)
        for metric, value in rows:
            counts[metric["__name__"]] += 1
            compared[metric["__name__"]] += 1
            labels = {k: v for k, v in metric.items() if k != "__name__"}
            checks.append({"expr": f"abs({_selector(metric)} - {value!r}) <= bool {abs(value) * 1e-9 + 1e-12!r}",
                           "eval_time": f"{int(t)}s",
                           "exp_samples": [{"labels": _selector({"__name__": "", **labels}), "value": 1}]})
        records = "|".join(RECORDS)
        checks.append({"expr": f'count by (__name__) ({{__name__=~"{records}"}})', "eval_time": f"{int(t)}s",
                       "exp_samples": [{"labels": f'{{__name__="{n}"}}', "value": c} for n, c in counts.items()]})

    _, series = fleet_series.scrapes(WARMUP + COMPARED)
    # vmalert ran the groups one after another; promtool evaluates them in the same order.
    res = run_rule_tests(tmp_path, yaml.safe_dump({"groups": rule_groups()}), {
        "evaluation_interval": f"{STEP}s", "tests": [{
            "interval": "1s",
            "input_series": [{"series": key, "values": fleet_series.promtool_values(values)}
                             for key, values in series.items()],
            "promql_expr_test": checks}]}, name="equality.test.yml")
    assert res.returncode == 0, (res.stdout + res.stderr)[-8000:]
    # Every fleet record had series at every step: nothing compared empty against empty.
    steps = len(vm)
    assert {r: compared.get(r, 0) >= steps for r in FLEET_RECORDS} == {r: True for r in FLEET_RECORDS}
    # The data tells records apart: several nodes, both models, a fault, queued and low-headroom GPUs.
    final = {(m["__name__"], tuple(sorted(m.items()))): v for m, v in vm[float(WARMUP + COMPARED)]}
    by_name: Dict[str, List[float]] = defaultdict(list)
    for (name, _), v in final.items():
        by_name[name].append(v)
    assert len(by_name["instance:mps_server_clients:sum"]) == fleet_series.NODES
    assert len(by_name["name:mps_gpu_memory_used_bytes:sum"]) == len(fleet_series.MODELS)
    assert by_name["fleet:mps_servers_in_fault:count"][0] > 0
    assert by_name["fleet:mps_gpus_low_memory_headroom:count"][0] > 0
    assert by_name["fleet:mps_fatal_gpu_errors:rate5m"][0] > 0
    assert by_name["job:mps_exporters:count"] == [fleet_series.NODES + 1]
    assert by_name["job:mps_exporters_up:sum"] == [fleet_series.NODES]
