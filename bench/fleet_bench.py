#!/usr/bin/env python3
"""Fleet benchmark: N replay exporters of an 8 GPU x 48 client node, scraped by one real
Prometheus with the project's rules, and kube-state-metrics' pods for all of them.

For each N (default 10, 50, 100) it starts N `mps-exporter replay` processes (each its
own pods: the bundle's pod UIDs and container ids renamed per node, one namespace per
node), waits until every rule group has been evaluated a few times, and measures:

- series per node (all, and those with a `pid` label) and recorded series per node;
- each rule group's evaluation time (Prometheus' own `evaluationTime`), and per target;
- every dashboard query's time at the dashboards' default selection (per-node
  dashboards: the first node; Kubernetes: the first namespace, all its pods; fleet:
  no variables) as a range query over the default 3 h at a 15 s step;
- `--granularity` modes: one exporter per mode, its series count.

It then extrapolates series, samples/s and rule time to 1,000 and 10,000 nodes.
Prometheus evaluates the rule groups every RULE_INTERVAL here (their 1 m in production)
so that a short run sees several evaluations; the time of one evaluation does not
depend on the interval. Data spans only the run (minutes, not 3 h): query times are
what that much data costs.

    python3 bench/fleet_bench.py [--nodes 10 50 100] [--out bench/results/fleet-....md]

Prints a Markdown report (and writes it with --out); numbers, not a pass/fail.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alerts import generate  # noqa: E402
from dashboards.queries import Query, concrete, queries  # noqa: E402
from tests.support import scenarios  # noqa: E402
from tests.support.fleet import Pod, kube_state_metrics, record_bundle, renamed_bundle, running_replays  # noqa: E402
from tests.support.fleet import serving_text  # noqa: E402
from tests.support.prometheus import Prometheus, Target, running_prometheus  # noqa: E402

GPUS, CLIENTS_PER_GPU = 8, 48
SCRAPE_INTERVAL = 15.0  # Prometheus' default
RULE_INTERVAL = "10s"
EVALUATIONS = 3  # of every group, before measuring
RANGE_SECONDS, STEP = 3 * 3600, "15s"  # Grafana's default time range for these dashboards
REPEATS = 3


def node_bundles(tmp: Path, count: int) -> Tuple[List[Path], List[Pod]]:
    """One bundle per node, each with its own pods; and kube-state-metrics' view of them."""
    scen = scenarios.synthetic(tmp, gpus=GPUS, clients_per_gpu=CLIENTS_PER_GPU, clients_per_pod=1)
    base = record_bundle(tmp, scen)
    pods_of_node = sorted(set(scen.pods.values()))
    bundles, pods = [], []
    for i in range(count):
        renames = {}
        for k, (uid, cid) in enumerate(pods_of_node):
            new_uid, new_cid = f"{i:08x}{uid[8:]}", f"{i:08x}{cid[8:]}"
            renames[uid], renames[cid] = new_uid, new_cid
            pods.append(Pod(f"team-{i:05d}", f"job-{k:03d}", new_uid, "worker", "containerd://" + new_cid,
                            f"node-{i:05d}"))
        bundles.append(renamed_bundle(base, tmp / f"node-{i:05d}.jsonl.gz", renames))
    return bundles, pods


def wait_for_evaluations(prom: Prometheus, timeout: float) -> Dict[str, List[float]]:
    """Each group's evaluationTime over its last EVALUATIONS evaluations."""
    seen: Dict[str, Dict[str, float]] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for g in prom.rules():
            seen.setdefault(g["name"], {})
            if not g["lastEvaluation"].startswith("0001"):
                seen[g["name"]][g["lastEvaluation"]] = float(g["evaluationTime"])
        if seen and all(len(v) >= EVALUATIONS + 1 for v in seen.values()):
            break
        time.sleep(1.0)
    # The first evaluation also compiles and warms caches: leave it out.
    return {name: [t for _, t in sorted(v.items())][1:] for name, v in seen.items()}


def timed_query(prom: Prometheus, expr: str) -> float:
    now = time.time()
    params = urllib.parse.urlencode({"query": expr, "start": now - RANGE_SECONDS, "end": now, "step": STEP})
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"{prom.url}/api/v1/query_range?{params}", timeout=60) as resp:
            body = json.load(resp)
        times.append(time.perf_counter() - t0)
        assert body["status"] == "success", body
    return statistics.median(times)


def default_selection(q: Query, first_node: str) -> Dict[str, str]:
    if q.dashboard == "kubernetes":
        return {"namespace": "team-00000"}
    return {"node": first_node}


def own_series(prom: Prometheus) -> float:
    with urllib.request.urlopen(f"{prom.url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("prometheus_tsdb_head_series "):
                return float(line.split()[1])
    raise AssertionError("no prometheus_tsdb_head_series")


def measure(n: int, tmp: Path) -> dict:
    bundles, pods = node_bundles(tmp, n)
    rules = tmp / "rules.yml"
    rules.write_text(generate.prometheus_rules(interval_override=RULE_INTERVAL))
    with running_replays(bundles, tmp, timeout=60 + n) as addresses, \
            serving_text(kube_state_metrics(pods)) as ksm, \
            running_prometheus(tmp, [*(Target(a, job="mps-exporter") for a in addresses),
                                     Target(ksm, job="kube-state-metrics")],
                               rule_files=[str(rules)], scrape_interval=SCRAPE_INTERVAL,
                               evaluation_interval=SCRAPE_INTERVAL) as prom:
        prom.wait_for_target_up(timeout=120)
        groups = wait_for_evaluations(prom, timeout=180)

        def per_node(expr: str) -> float:
            return statistics.median(float(r["value"][1]) for r in prom.query(f"count by (instance) ({expr})"))

        result = {
            "n": n,
            "series_per_node": per_node('{job="mps-exporter", __name__!~".+:.+"}'),
            "pid_series_per_node": per_node('{job="mps-exporter", pid!="", __name__!~".+:.+"}'),
            "recorded_per_node": per_node('{__name__=~".+:.+", instance!=""}'),
            "recorded_fleet": float(prom.query('count({__name__=~".+:.+", instance=""})')[0]["value"][1]),
            "head_series": own_series(prom),
            "samples_per_scrape": statistics.median(
                float(r["value"][1]) for r in prom.query('scrape_samples_scraped{job="mps-exporter"}')),
            "groups": {name: statistics.mean(t) for name, t in groups.items() if t},
            "queries": {},
        }
        first = sorted(addresses)[0]
        for q in queries():
            expr = concrete(q.expr, "1m", default_selection(q, first))
            result["queries"][f"{q.dashboard}|{q.panel}|{q.ref_id}"] = timed_query(prom, expr)
        return result


def granularity_series(tmp: Path, mode: str) -> Optional[float]:
    """Series of one 8 x 48 node served with --mps.client-granularity MODE (None: no such flag)."""
    from mps_exporter import config as exporter_config

    if "client_granularity" not in {f.name for f in __import__("dataclasses").fields(exporter_config.Config)}:
        return None
    scen = scenarios.synthetic(tmp, gpus=GPUS, clients_per_gpu=CLIENTS_PER_GPU, clients_per_pod=1)
    scen.cfg.client_granularity = mode
    collector = scen.collector()
    return float(sum(len(f.samples) for f in collector.collect()))


def fit(xs: List[float], ys: List[float]) -> Tuple[float, float]:
    """Least squares a + b x."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def report(results: List[dict], modes: Dict[str, Optional[float]], started: str) -> str:
    ns = [r["n"] for r in results]
    big = results[-1]
    lines = [f"# Fleet benchmark ({started})", "",
             f"`python3 bench/fleet_bench.py --nodes {' '.join(map(str, ns))}`: N replay exporters of one "
             f"{GPUS} GPU x {CLIENTS_PER_GPU} client node (every client in its own pod, one namespace per node), "
             f"kube-state-metrics' pods for all of them, one Prometheus "
             f"({SCRAPE_INTERVAL:g} s scrapes, rule groups every {RULE_INTERVAL} for the run) with "
             "alerts/prometheus/mps-exporter.rules.yml. Machine: shared 2-core VM (other jobs running).", "",
             "## Series", "",
             "| exporters | series per node | with `pid` | samples per scrape | recorded per node | "
             "recorded fleet-wide | Prometheus head series |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['n']} | {r['series_per_node']:.0f} | {r['pid_series_per_node']:.0f} | "
                     f"{r['samples_per_scrape']:.0f} | {r['recorded_per_node']:.0f} | {r['recorded_fleet']:.0f} | "
                     f"{r['head_series']:.0f} |")
    if any(v is not None for v in modes.values()):
        c, s = modes.get("client"), modes.get("server")
        lines += ["", f"`--mps.client-granularity` on one {GPUS} x {CLIENTS_PER_GPU} node: client {c:.0f} series, "
                      f"server {s:.0f} series ({c / s:.1f}x fewer)." if c and s else ""]

    lines += ["", "## Rule groups (one evaluation, mean of the last evaluations)", "",
              "| group | " + " | ".join(f"{n} exporters" for n in ns) + f" | per target at {ns[-1]} |",
              "| --- | " + " | ".join("---" for _ in ns) + " | --- |"]
    names = sorted(big["groups"])
    for g in names:
        row = [f"{r['groups'].get(g, float('nan')) * 1000:.1f} ms" for r in results]
        lines.append(f"| {g} | " + " | ".join(row) + f" | {big['groups'][g] / big['n'] * 1000:.3f} ms |")
    total = [sum(r["groups"].values()) for r in results]
    lines.append("| **all** | " + " | ".join(f"{t * 1000:.1f} ms" for t in total) +
                 f" | {total[-1] / big['n'] * 1000:.3f} ms |")

    lines += ["", "## Dashboard queries at the default selection", "",
              "Sum over each dashboard's queries (range query, 3 h at 15 s, median of "
              f"{REPEATS}); ratio = largest N / smallest N.", "",
              "| dashboard | queries | " + " | ".join(f"{n} exporters" for n in ns) + " | ratio |",
              "| --- | --- | " + " | ".join("---" for _ in ns) + " | --- |"]
    dashboards = sorted({k.split("|")[0] for k in big["queries"]})
    for d in dashboards:
        sums = [sum(t for k, t in r["queries"].items() if k.startswith(d + "|")) for r in results]
        count = sum(1 for k in big["queries"] if k.startswith(d + "|"))
        lines.append(f"| {d} | {count} | " + " | ".join(f"{s * 1000:.0f} ms" for s in sums) +
                     f" | {sums[-1] / sums[0]:.2f}x |")
    slow = sorted(big["queries"].items(), key=lambda kv: -kv[1])[:8]
    lines += ["", f"Slowest queries at {big['n']} exporters:", ""]
    lines += [f"- {t * 1000:.1f} ms: {k.replace('|', ' / ')}" for k, t in slow]

    # Extrapolation.
    per_node = big["series_per_node"] + big["recorded_per_node"]
    a, b = fit([float(r["n"]) for r in results], total)
    lines += ["", "## Extrapolation", "",
              f"Series grow with nodes ({per_node:.0f} per node: {big['series_per_node']:.0f} scraped + "
              f"{big['recorded_per_node']:.0f} recorded); rule time as fitted over the runs "
              f"({a * 1000:.1f} ms + {b * 1000:.3f} ms per node per round of all groups).", "",
              "| nodes | active series | samples/s at 15 s | samples/s at 5 s | rule time per round | "
              "share of a 1 m interval |", "| --- | --- | --- | --- | --- | --- |"]
    for nodes in (1_000, 10_000):
        series = nodes * per_node + big["recorded_fleet"]
        rule_time = a + b * nodes
        lines.append(f"| {nodes:,} | {series / 1e6:.2f} M | {nodes * big['series_per_node'] / 15 / 1e3:.0f} k | "
                     f"{nodes * big['series_per_node'] / 5 / 1e3:.0f} k | {rule_time:.1f} s | "
                     f"{rule_time / 60:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for n in sorted(args.nodes):
        with tempfile.TemporaryDirectory(prefix=f"fleet-bench-{n}-") as tmp:
            t0 = time.monotonic()
            results.append(measure(n, Path(tmp)))
            print(f"{n} exporters measured in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    modes = {}
    for mode in ("client", "server"):
        with tempfile.TemporaryDirectory() as tmp:
            modes[mode] = granularity_series(Path(tmp), mode)
    text = report(results, modes, started)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
