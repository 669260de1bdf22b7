"""The fleet bench's data without its processes: the scrape of the bench's node (8 GPUs x 48
clients, six to a pod, a control.log with one client queued: bench/fleet_bench.py's
`scenarios.synthetic` plus tests/support/fleet.py's CONTROL_LOG) taken once through the real
collector, then copied to NODES nodes and stepped over time, every INTERVAL seconds, so that
the fleet rules have something to tell apart: GPU memory that rises and falls (some GPUs
cross the low-headroom line, some nodes' fullest GPU changes), queued clients and connected
clients that change each minute, counters that grow at each node's own steady rate, two GPU
models, four sharing modes, some nodes with a server in FAULT, and one target that is down.

Only the series the fleet rules read are kept (those of the `rules`, `fleet` and
`fleet-totals` groups' expressions), and every series is present at every scrape, as on a
steady fleet: no series appears or goes away, so Prometheus' staleness markers (which
VictoriaMetrics does not write on import) play no part. Values are exact binary fractions
or integers where they can be, so a comparison is not blurred by rounding.
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

from prometheus_client.parser import text_string_to_metric_families

from mps_exporter.wiring import build_collector

from alerts.recordings import FLEET, FLEET_TOTALS, RECORDINGS, RULES
from tests.support import scenarios
from tests.support.fleet import CONTROL_LOG
from tests.support.golden import exposition
from tests.support.replay_series import Series, _selector

JOB = "mps-exporter"
NODES = 10
INTERVAL = 15
GROUPS = (RULES, FLEET, FLEET_TOTALS)
MODELS = ("NVIDIA H200", "NVIDIA H100 80GB HBM3")
MODES = ("mps", "time_slicing", "exclusive", "idle")
OFFSET = 7  # seconds from a rule evaluation's minute to the next scrape, as on a live server
DOWN = "node-down:10138"  # a target that answers no scrape: `up` 0 and nothing else


def read_metrics() -> Set[str]:
    """The metric names the `rules`, `fleet` and `fleet-totals` records read."""
    names: Set[str] = set()
    for r in RECORDINGS:
        if r.group in GROUPS:
            names |= set(re.findall(r"(?<![\w:])(mps_\w+|up)\b(?![\w:(])", r.expr))
    return names


def node_exposition() -> str:
    """One scrape of the fleet bench's node, through the real collector."""
    with tempfile.TemporaryDirectory(prefix="fleet-series-") as tmp_name:
        tmp = Path(tmp_name)
        scen = scenarios.synthetic(tmp, gpus=8, clients_per_gpu=48, clients_per_pod=6)
        log_dir = tmp / "mps-log"
        log_dir.mkdir()
        (log_dir / "control.log").write_text(CONTROL_LOG)
        (log_dir / "server.log").write_text("")
        scen.cfg.daemons[0].log_directory = str(log_dir)
        scen.cfg.collectors["logs"] = True
        readers = scen.readers()
        try:
            return exposition(build_collector(scen.cfg, readers))
        finally:
            for reader in readers.values():
                reader.close()


def _base_samples(names: Set[str]) -> List[Tuple[str, Dict[str, str], float]]:
    out = []
    for family in text_string_to_metric_families(node_exposition()):
        for s in family.samples:
            if s.name in names:
                out.append((s.name, dict(s.labels), float(s.value)))
    return out


def _wave(t: float, phase: float, period: float = 600.0) -> float:
    """-1..1, a sine rounded to 1/64 (an exact binary fraction)."""
    return round(64 * math.sin(2 * math.pi * (t / period + phase))) / 64


def _value(name: str, labels: Dict[str, str], base: float, node: int, t: float) -> float:
    gpu = int(labels.get("gpu", "0"))
    if name == "mps_gpu_memory_used_bytes":
        total = 80 * 2**30 if node % 2 else 141 * 2**30
        return float(round(total * (0.5 + 0.46875 * _wave(t, node / 7 + gpu / 8)) / 2**20) * 2**20)
    if name == "mps_gpu_memory_total_bytes":
        return float(80 * 2**30 if node % 2 else 141 * 2**30)
    if name == "mps_queued_clients":
        return float((node + int(t // 60)) % 3)
    if name == "mps_server_clients":
        return float(base - (node * 7 + int(t // 60) * 5) % 40)
    if name.endswith("_total"):  # a steady rate per node and counter: rate() is the slope under either engine
        return base + (node + 1) * 0.25 * t
    return base


def scrapes(seconds: float, nodes: int = NODES, start: float = 0.0) -> Tuple[List[float], Series]:
    """(scrape times, series) of `nodes` copies of the bench's node scraped every INTERVAL
    for `seconds` from `start`, plus the DOWN target."""
    times = [start + i * INTERVAL for i in range(int(seconds // INTERVAL) + 1)]
    base = _base_samples(read_metrics())
    series: Series = {}
    for node in range(nodes):
        instance = f"node-{node:02d}:10138"
        rows: List[Tuple[str, Dict[str, str], float]] = [("up", {}, 1.0)]
        for name, labels, value in base:
            labels = dict(labels)
            if name == "mps_gpu_info":
                labels["name"] = MODELS[node % 2]
            elif name == "mps_gpu_sharing_mode":
                labels["mode"] = MODES[(node + int(labels["gpu"])) % len(MODES)]
            elif name == "mps_server_status" and node % 4 == 1:
                labels["status"] = "FAULT"
            rows.append((name, labels, value))
        for name, labels, value in rows:
            key = _selector(name, {**labels, "job": JOB, "instance": instance})
            series[key] = [_value(name, labels, value, node, t - start) for t in times]
    series[_selector("up", {"job": JOB, "instance": DOWN})] = [0.0] * len(times)
    return times, series


def promtool_values(values: List[Optional[float]], offset: int = OFFSET) -> str:
    """promtool's values notation at a 1 s `interval`: the first scrape `offset` seconds
    after 0, then one every INTERVAL (promtool's own series start at 0 and step by
    their interval, in step with its rule evaluations)."""
    words = [f"_x{offset}"] if offset else []
    for i, v in enumerate(values):
        if i:
            words.append(f"_x{INTERVAL - 1}")
        words.append("_" if v is None else repr(v))
    return " ".join(words)


def import_lines(times: Iterable[float], series: Series) -> str:
    """The series as VictoriaMetrics' /api/v1/import/prometheus takes them: one line per
    sample, with its timestamp in milliseconds."""
    times = list(times)
    return "\n".join(f"{key} {value!r} {round(t * 1000)}" for key, values in series.items()
                     for t, value in zip(times, values) if value is not None) + "\n"
