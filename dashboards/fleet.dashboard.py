"""The fleet: every node at once, from recorded aggregates only (alerts/recordings.py,
groups mps-exporter.fleet and mps-exporter.fleet-totals), so it answers as fast at 10,000 nodes as at 10."""

from alerts import config as C
from alerts import recordings as R
from dashboards.common import build, rec, row, row_query, stat, table, target, timeseries

DOWN = f"{R.EXPORTERS} - {R.EXPORTERS_UP}"
TOP = 20

dashboard = build(
    title="MPS / Fleet",
    uid="mps-fleet",
    description="Every node with mps-exporter: GPUs by sharing mode, nodes with queued clients, faults, fatal GPU "
                "errors, memory headroom and exporters down. Reads recorded series only; open a node in the "
                "per-node dashboards.",
    variables=[],
    panels=[
        row("Now"),
        stat("Exporters", "mps-exporter targets Prometheus scrapes.", "none", [target(rec(R.EXPORTERS))], w=4),
        stat("Exporters down", "Targets whose last scrape failed: no MPS alert fires for those nodes.", "none",
             [target(DOWN)], w=4, bad_from=1),
        stat("MPS clients", "MPS client processes connected, over the fleet.", "none",
             [target(rec(R.FLEET_CLIENTS))], w=4),
        stat("Nodes with queued clients", "Nodes where clients wait on the MPS pending list.", "none",
             [target(rec(R.FLEET_QUEUED_NODES))], w=4, warn_from=1),
        stat("Servers in FAULT", "MPS servers refusing new clients until theirs have exited.", "none",
             [target(rec(R.FLEET_FAULTS))], w=4, bad_from=1),
        stat("GPUs low on memory",
             f"GPUs with less than {C.LOW_MEMORY_HEADROOM_RATIO:.0%} of their memory free.", "none",
             [target(rec(R.FLEET_LOW_HEADROOM))], w=4, warn_from=1),
        row("Sharing"),
        timeseries("GPUs by sharing mode", "GPUs over the fleet by how they are shared now.", "none",
                   [target(rec(R.FLEET_MODES), "{{mode}}")], stacked=True),
        table("GPUs by model and sharing mode", "One row per GPU model and sharing mode, with the GPU count.",
              [row_query(rec(R.MODEL_MODES))], units={"Value": "none"}, rename={"Value": "GPUs"}, h=8, w=12),
        timeseries("Memory in use by GPU model", "Device memory used over total, per GPU model.", "percentunit",
                   [target(f"{R.MODEL_MEMORY_USED} / {R.MODEL_MEMORY_TOTAL}", "{{name}}")], max_one=True),
        timeseries("MPS clients", "MPS client processes connected, over the fleet.", "none",
                   [target(rec(R.FLEET_CLIENTS), "clients")]),
        row("Trouble"),
        timeseries("Nodes with queued clients", "Nodes where clients wait on the MPS pending list.", "none",
                   [target(rec(R.FLEET_QUEUED_NODES), "nodes")], w=8),
        timeseries("Servers in FAULT and fatal GPU errors",
                   "MPS servers in FAULT, and fatal GPU errors per second, over the fleet.", "none",
                   [target(rec(R.FLEET_FAULTS), "servers in FAULT"),
                    target(rec(R.FLEET_FATAL), "fatal GPU errors per second")], w=8),
        timeseries("Refused clients and servers dying with clients",
                   "Client connections MPS servers refused (client limit reached), and servers that exited under "
                   "connected clients, per second over the fleet.", "cps",
                   [target(rec(R.FLEET_REFUSALS), "refused clients"),
                    target(rec(R.FLEET_DEATHS), "servers dying with clients")], w=8),
        timeseries("Exporters down", "mps-exporter targets whose last scrape failed.", "none",
                   [target(DOWN, "down {{job}}")], w=8),
        table(f"Nodes with the most queued clients (top {TOP})", "Clients on each node's pending lists now.",
              [row_query(f"topk({TOP}, {R.NODE_QUEUED})")], units={"Value": "none"},
              rename={"instance": "node", "Value": "queued clients"}, w=8, h=8),
        table(f"Nodes with the most trouble (top {TOP})",
              "Per node, last 5 minutes: fatal GPU errors, refused clients and servers dying with clients, per "
              "second; the nodes with the most fatal errors first.",
              [row_query(f"topk({TOP}, {R.NODE_FATAL})"), row_query(f"topk({TOP}, {R.NODE_REFUSALS})"),
               row_query(f"topk({TOP}, {R.NODE_DEATHS})")],
              units={"Value #A": "cps", "Value #B": "cps", "Value #C": "cps"},
              rename={"instance": "node", "Value #A": "fatal errors/s", "Value #B": "refused/s",
                      "Value #C": "deaths/s"}, w=8, h=8),
        table(f"Nodes with the least GPU memory free (bottom {TOP})",
              "Share of memory free on each node's fullest GPU.",
              [row_query(f"bottomk({TOP}, {R.NODE_HEADROOM})")], units={"Value": "percentunit"},
              rename={"instance": "node", "Value": "free on fullest GPU"}, w=8, h=8),
    ],
)
