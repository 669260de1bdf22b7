"""The pieces of issue 24's truth-check phases that need no GPU (they run in CI)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import limits_truth  # noqa: E402
from scrape import Exposition  # noqa: E402


def test_the_outside_alert_is_a_plain_selector_that_picks_the_process():
    expr = limits_truth._alert_expr("MpsProcessOutsideMps")
    e = Exposition('mps_process_outside_mps_info{gpu="0",uuid="GPU-a",pid="7100",uid="0",user="root",'
                   'command="python3",container_id="",pod_uid=""} 1\n'
                   'mps_process_outside_mps_memory_used_bytes{gpu="0",uuid="GPU-a",pid="7100"} 1.4e9\n')
    assert [x.labels["pid"] for x in limits_truth._select(e, expr)] == ["7100"]


def test_rate_from_the_clients_last_line():
    client = SimpleNamespace(text=lambda: "tv_abc pid=42 uid=0 dev=0 init=2.10s iters=1475 busy=5.00\n")
    assert limits_truth._rate(client) == 295.0
    assert limits_truth._rate(SimpleNamespace(text=lambda: "ALLOC_FAIL")) is None


def test_every_phase_is_named():
    assert set(limits_truth.PHASES) == {"limitforms", "threadvalues", "outsider", "priority", "terminate"}
