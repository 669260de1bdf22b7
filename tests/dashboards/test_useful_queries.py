"""README's "Useful queries" (dashboards/useful_queries.py, issue 43): valid PromQL, only
declared metrics and shipped records, and each answers with data in Prometheus' own engine
(`promtool test rules`) over 15 minutes of the demo replay (tests/support/replay_series.py),
with the shipped rule file loaded, as the dashboards' queries are checked."""

from __future__ import annotations

import re
import subprocess

import yaml

from alerts import generate
from alerts.recordings import RECORDINGS
from dashboards.useful_queries import QUERIES
from mps_exporter.catalog import METRICS
from tests.support.replay_series import promtool_values, scrapes
from tests.support.promtool import run_rule_tests
from tests.support.tools import require

FUNCTIONS_AND_WORDS = {"topk", "sort_desc", "sum", "by", "on", "group_left", "max_over_time", "increase",
                       "user", "command", "instance", "daemon", "reason", "mode", "job", "pid", "server_pid",
                       "min", "min_over_time", "collector"}
MINUTES = 15
INTERVAL = 15


def _names(expr: str):
    return set(re.findall(r"(?<![\w:])([a-z_][a-z0-9_:]*)(?![\w:]*\()", re.sub(r"\[[^]]*\]", "", expr)))


def test_useful_queries_read_declared_metrics_and_shipped_records():
    records = {r.record for r in RECORDINGS}
    for q in QUERIES:
        read = _names(q.expr) - FUNCTIONS_AND_WORDS
        assert read, q
        assert read <= set(METRICS) | records, (q.question, read - set(METRICS) - records)


def test_useful_queries_are_valid_promql(tmp_path):
    rules = [{"record": f"useful:query_{i}:check", "expr": q.expr} for i, q in enumerate(QUERIES)]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "useful-queries", "rules": rules}]}))
    out = subprocess.run([require("promtool"), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_useful_query_has_data_over_the_demo_replay(tmp_path):
    """At the end of 15 minutes of the demo, each query answered with at least one series
    at some minute of them (a 15 s subquery over the whole run)."""
    _, series = scrapes(MINUTES * 60, INTERVAL)
    checks = [{"expr": f"count(count_over_time(({q.expr})[{MINUTES}m:{INTERVAL}s])) >= bool 1",
               "eval_time": f"{MINUTES}m", "exp_samples": [{"labels": "{}", "value": 1}]} for q in QUERIES]
    res = run_rule_tests(tmp_path, generate.prometheus_rules(), {"evaluation_interval": "15s", "tests": [{
        "interval": f"{INTERVAL}s",
        "input_series": [{"series": key, "values": promtool_values(values)} for key, values in series.items()],
        "promql_expr_test": checks}]}, name="useful.test.yml")
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
