"""The scale-out setup of docs/deploy.md, with Debian's victoria-metrics package: two
vmagent scrapers split six replay exporters between them
(-promscrape.cluster.membersCount=2, memberNum 0 and 1) and remote-write to one
VictoriaMetrics; vmalert evaluates the project's rule file against it (groups' own
intervals cut to 1 s in a copy) and writes the recorded series back.

Passes when every rule evaluated without a failure, each scraper took a share of
the exporters and together all of them, and every query of the fleet dashboard
answers through VictoriaMetrics' Prometheus API, the per-node records for every
exporter.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from alerts import generate
from alerts import recordings as R
from dashboards.queries import concrete, queries
from tests.support import scenarios
from tests.support.fleet import record_bundle, running_replays
from tests.support.victoria import running_victoria_metrics, running_vmagents, running_vmalert

pytestmark = pytest.mark.slow

EXPORTERS = 6
WAIT = 60.0


def test_vmagent_pair_victoria_metrics_and_vmalert_run_the_rules_and_the_fleet_dashboard(tmp_path):
    # vmagent shares targets by a hash of their labels, the exporters' random ports among
    # them: one time in 32 all six fall to one scraper. Then once more, on other ports.
    if not _scale_out(tmp_path / "first", last=False):
        assert _scale_out(tmp_path / "again", last=True)


def _scale_out(tmp_path: Path, last: bool) -> bool:
    """Everything checked (True); False where not `last` and one scraper took every exporter."""
    tmp_path.mkdir()
    bundle = record_bundle(tmp_path, scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=2))
    rules = tmp_path / "rules.yml"
    rules.write_text(generate.prometheus_rules(interval_override="1s"))
    with running_replays([bundle] * EXPORTERS, tmp_path) as addresses, running_victoria_metrics(tmp_path) as vm, \
            running_vmagents(tmp_path, vm, addresses, members=2) as agents, \
            running_vmalert(tmp_path, vm, [str(rules)]) as alert:
        everyone = set(addresses)
        # Both scrapers write `up` for their share; together every exporter, each once.
        deadline = time.monotonic() + WAIT
        while {r["metric"]["instance"] for r in vm.query('up{job="mps-exporter"} == 1')} != everyone:
            assert time.monotonic() < deadline, f"up: {vm.query('up')}\n{agents[0].log_tail()}"
            time.sleep(0.5)
        shares = [agent.metric("vm_promscrape_targets") for agent in agents]
        if not last and sum(shares) == EXPORTERS and EXPORTERS in shares:
            return False
        assert all(0 < s < EXPORTERS for s in shares) and sum(shares) == EXPORTERS, shares

        # Every per-node record the fleet dashboard reads, for every exporter.
        for record in (R.NODE_QUEUED, R.NODE_HEADROOM, R.NODE_CLIENTS, R.NODE_MODES, R.NODE_FATAL):
            while {r["metric"]["instance"] for r in vm.query(record)} != everyone:
                assert time.monotonic() < deadline, f"{record}: {vm.query(record)}\n{alert.log_tail()}"
                time.sleep(0.5)
        assert vm.query(R.EXPORTERS_UP)[0]["value"][1] == str(EXPORTERS)
        # Summed from the per-node records in the next group (issue 43): a round later.
        while [r["value"][1] for r in vm.query(R.FLEET_QUEUED_NODES)] != [str(EXPORTERS)]:
            assert time.monotonic() < deadline, f"{R.FLEET_QUEUED_NODES}: {vm.query(R.FLEET_QUEUED_NODES)}"
            time.sleep(0.5)

        # Every fleet dashboard query answers through VictoriaMetrics' Prometheus API.
        empty = []
        for q in queries():
            if q.dashboard == "fleet":
                data = vm.api("query_range", query=concrete(q.expr, "10s"), start=str(time.time() - 60),
                              end=str(time.time()), step="1s")
                if not data["result"]:
                    empty.append(f"{q.panel} / {q.ref_id}: {q.expr}")
        assert empty == []

        # All rules of every group evaluated, none failed.
        groups = alert.api("rules")["groups"]
        assert {g["name"] for g in groups} == {g["name"] for g in generate.rule_groups()}
        # This vmalert (1.79) counts every failed evaluation in vmalert_execution_errors_total
        # and has a 0/1 gauge per rule for its last one.
        page = alert.get("/metrics").decode()
        rules_total = sum(len(g["rules"]) for g in generate.rule_groups())
        per_rule = [line for line in page.splitlines()
                    if line.startswith(("vmalert_recording_rules_error{", "vmalert_alerting_rules_error{"))]
        assert len(per_rule) == rules_total and all(line.endswith(" 0") for line in per_rule), per_rule
        assert alert.metric("vmalert_execution_total") >= 5 * rules_total
        assert "vmalert_execution_errors_total" in page and alert.metric("vmalert_execution_errors_total") == 0, \
            alert.log_tail()
        errors = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r.get("lastError")]
        assert errors == []
    return True
