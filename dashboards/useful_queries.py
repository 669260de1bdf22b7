"""Useful queries: the questions users ask of the exporter's series, each answered by one
PromQL expression to paste into Prometheus' or Grafana's Explore. `docs/generate.py`
writes them into README.md ("Useful queries"); tests/dashboards/test_useful_queries.py
checks that each is valid PromQL, reads only declared metrics and the shipped records,
and answers with data in real Prometheus' engine (promtool) over the demo replay.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

from alerts import recordings as R


class UsefulQuery(NamedTuple):
    question: str
    expr: str
    note: str = ""


QUERIES: Tuple[UsefulQuery, ...] = (
    UsefulQuery("Which clients use the most GPU memory?",
                "topk(10, mps_client_memory_used_bytes * on(job, instance, daemon, pid) group_left(user, command) "
                "mps_client_info)",
                "with the user and command of each client"),
    UsefulQuery("How close is each client to its pinned memory limit?",
                "sort_desc(mps_client_pinned_memory_usage_ratio)",
                "1 is the limit; served per client and GPU"),
    UsefulQuery("Who holds each MPS server (one Linux user per server)?",
                "mps_server_info * on(job, instance, daemon, server_pid) group_left mps_server_clients",
                "value: its connected clients"),
    UsefulQuery("How many clients wait on the pending list, and why?",
                "sum by (instance, daemon, reason) (max_over_time(mps_queued_clients[15m])) > 0",
                "`user_switch`: behind another user's server; `server_starting`: for their own"),
    UsefulQuery("How long did queued clients wait (p95 over 10 minutes)?",
                R.QUEUE_WAIT_P95),
    UsefulQuery("Were clients refused in the last hour, and why?",
                "sum by (instance, daemon, reason) (increase(mps_client_rejections_total[1h])) > 0",
                "`client_limit`: the server's 48 clients"),
    UsefulQuery("Which nodes had fatal GPU errors today?",
                "sum by (instance, daemon) (increase(mps_fatal_gpu_errors_total[1d])) > 0"),
    UsefulQuery("Did a server exit under connected clients?",
                "sum by (instance, daemon) (increase(mps_server_exits_with_clients_total[1d])) > 0",
                "its clients failed with it"),
    UsefulQuery("How are the GPUs shared, over the fleet?",
                "sum by (mode) (mps_gpu_sharing_mode)",
                "mps, time_slicing, exclusive, mig or idle"),
    UsefulQuery("How full is each GPU's memory?",
                f"sort_desc({R.GPU_MEMORY_USAGE})"),
    UsefulQuery("Did every source of every exporter answer over the last hour?",
                "min by (instance, collector) (min_over_time(mps_exporter_collector_success[1h]))",
                "0: the source failed at least once; the exporter's log says why"),
)


def markdown() -> str:
    """README's "Useful queries" block: each question, its query, its note."""
    out = []
    for q in QUERIES:
        out.append(f"{q.question}" + (f" ({q.note})" if q.note else "") + "\n\n")
        out.append(f"    {q.expr}\n\n")
    return "".join(out)
