#!/usr/bin/env python3
"""Fleet benchmark: N replay exporters of an 8 GPU x 48 client node, scraped by one real
Prometheus with the project's rules, and a kube-state-metrics listing every pod of the
cluster: each node's MPS pods and NON_MPS_PODS others per node.

For each N (default 10, 50, 100) it starts N `mps-exporter replay` processes (each its
own pods: the bundle's pod UIDs, container ids and namespace renamed per node; the
exporter names the pods itself, from the recorded node's containerd specs), waits until
every rule group has been evaluated a few times, and measures:

- series per node (all, and those with a `pid` label) and recorded series per node;
- each rule group's evaluation time live (Prometheus' own `evaluationTime`, with 100
  exporters and the rules on this machine's 2 cores), and per target;
- each rule group's evaluation time on a quiet copy: scraping and rules stopped, each
  rule's expression asked at the last evaluation's moment with `stats=all`, Prometheus'
  own evaluation timer (`evalTotalTime`), the fastest of QUIET_REPEATS, summed per
  group: the rules' own cost, not the machine's load. With --baseline-rules FILE... (older
  rule files, say), their recording rules run beside the current ones (records renamed
  `baseline_...`, `baseline2_...` in the order given) and are timed the same way, and
  their alerts' expressions (reading the renamed records) are timed on the quiet copy
  too, for a before/after of every group in one run;
- every dashboard query's time at the dashboards' default selection (per-node
  dashboards: the first node; Kubernetes: the first namespace, all its pods; fleet:
  no variables) as Grafana asks (tables: an instant query; graphs: a range query over
  the last WINDOW seconds, the same data in every run, at a 15 s step), the fastest of
  REPEATS, with scraping and rule evaluation stopped (reloaded without them; the data
  stays), so that the time is the query's, not the machine's load. The `client` runs'
  Prometheus servers stay up until all of them are measured, and each query is asked
  of every run in turn, REPEATS rounds: a change in the machine's load between runs
  (this machine is shared) then slows every run alike instead of skewing the ratio.
  With --baseline-dashboards DIR, the dashboard JSON in DIR (an older version, say)
  is timed in the same rounds, query by query beside the current one, for a
  before/after in one report;
- the same at `--mps.client-granularity pod` and `server` (--pod-nodes, --server-nodes),
  and one node's series in each mode with its clients outside pods, one pod each, or
  six to a pod.

It then extrapolates series, samples/s and rule time to 1,000 and 10,000 nodes.
Prometheus evaluates the rule groups every RULE_INTERVAL here (their 1 m in production)
so that a short run sees several evaluations; the time of one evaluation does not
depend on the interval. Data spans only the run (minutes, not 3 h): query times are
what that much data costs.

    python3 bench/fleet_bench.py [--nodes 10 50 100] [--pod-nodes 10 100] [--server-nodes 10 100]
        [--baseline-dashboards DIR] [--out bench/results/fleet-....md]

Prints a Markdown report (and writes it with --out); numbers, not a pass/fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import yaml
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alerts import generate  # noqa: E402
from mps_exporter.config import GRANULARITIES  # noqa: E402
from dashboards.queries import JSON_DIR, Query, concrete, queries  # noqa: E402
from tests.support import scenarios  # noqa: E402
from tests.support.fleet import Pod, kube_state_metrics, record_bundle, renamed_bundle, running_replays  # noqa: E402
from tests.support.fleet import serving_text  # noqa: E402
from tests.support.prometheus import Prometheus, Target, running_prometheus  # noqa: E402

GPUS, CLIENTS_PER_GPU = 8, 48
SCRAPE_INTERVAL = 15.0  # Prometheus' default
RULE_INTERVAL = "20s"
EVALUATIONS = 3  # of every group, before measuring
# Range queries read the last WINDOW seconds before scraping stopped: the same data per
# series in every run (Grafana's default 3 h reads more samples per series, alike at any N).
WINDOW, STEP = 75, "15s"
# 100 exporters, two rule files and Prometheus share this machine's 2 cores with other
# jobs: an API answer (a count over the fleet, the rules list) may take longer than the
# tests' 10 s.
Prometheus.api_timeout = 120.0
REPEATS = 15
SLOWEST_RULES = 6  # listed per granularity in the report
NON_MPS_PODS = 30  # per node, listed by kube-state-metrics: the cluster's pods are not all MPS clients
QUIET_REPEATS = 10
HEAVY = "mps-exporter.heavy"  # the rule group issue 44's done-when 3 measures
BASELINE = "baseline_"  # prefix of the first --baseline-rules file's records and groups
OURS = '__name__=~".+:.+", __name__!~"baseline[0-9]*_.+"'  # the current rules' records, not baseline ones
RULE_SETS_SHOWN = (".heavy / ", ".oom / ")  # groups whose rules the report lists one by one


def baseline_prefix(i: int) -> str:
    """The prefix of the i-th (from 0) --baseline-rules file: baseline_, baseline2_, ..."""
    return BASELINE if i == 0 else f"baseline{i + 1}_"


def rule_set(group: str) -> str:
    """Which rules a group is of: its baseline prefix, or "" for the current ones."""
    found = re.match(r"baseline[0-9]*_", group)
    return found.group(0) if found else ""


def current(groups: Dict[str, float]) -> float:
    """The current rules' groups summed (not the baseline ones)."""
    return sum(t for g, t in groups.items() if not rule_set(g))


def node_bundles(tmp: Path, count: int) -> Tuple[List[Path], List[Pod]]:
    """One bundle per node, each with its own pods (the names the exporter serves, renamed
    with them); and kube-state-metrics' view of the cluster: those pods and NON_MPS_PODS
    others per node."""
    scen = scenarios.synthetic(tmp, gpus=GPUS, clients_per_gpu=CLIENTS_PER_GPU, clients_per_pod=1)
    base = record_bundle(tmp, scen)
    pods_of_node = sorted(set(scen.pods.values()))
    bundles, pods = [], []
    for i in range(count):
        namespace, node = f"team-{i:05d}", f"node-{i:05d}"
        renames = {scenarios.SYNTHETIC_NAMESPACE: namespace}
        for uid, cid in pods_of_node:
            new_uid, new_cid = f"{i:08x}{uid[8:]}", f"{i:08x}{cid[8:]}"
            renames[uid], renames[cid] = new_uid, new_cid
            name = scenarios.synthetic_pod_name(int(uid.rsplit("-", 1)[1], 16) - 1)
            pods.append(Pod(namespace, name, new_uid, scenarios.SYNTHETIC_CONTAINER, "containerd://" + new_cid, node))
        for k in range(NON_MPS_PODS):
            pods.append(Pod(f"web-{i:05d}", f"svc-{k:03d}", f"{i:08x}-0000-4000-9000-{k:012x}", "app",
                            f"containerd://{i:08x}{k:056x}", node))
        bundles.append(renamed_bundle(base, tmp / f"node-{i:05d}.jsonl.gz", renames))
    return bundles, pods


def baseline_renamer(path: Path, prefix: str = BASELINE) -> Callable[[str], str]:
    """A function that prefixes `prefix` to every record name of the rule file `path`
    in an expression (its rules', or its dashboards' that read them)."""
    doc = yaml.safe_load(path.read_text())
    records = sorted({r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w:])(" + "|".join(re.escape(r) for r in records) + r")(?![\w:])")
    return lambda expr: pattern.sub(lambda m: prefix + m.group(1), expr)


def baseline_rules(path: Path, prefix: str = BASELINE, kind: str = "record") -> str:
    """The recording rules (kind "record": they run beside the current ones, at
    RULE_INTERVAL) or the alerts (kind "alert": timed on the quiet copy only, never
    loaded) of an older rule file, names and groups prefixed `prefix`, reading the
    prefixed records."""
    doc = yaml.safe_load(path.read_text())
    renamed = baseline_renamer(path, prefix)
    groups = []
    for g in doc["groups"]:
        rules = [{kind: prefix + r[kind], "expr": renamed(r["expr"])} for r in g["rules"] if kind in r]
        if rules:
            groups.append({"name": prefix + g["name"], "interval": RULE_INTERVAL, "rules": rules})
    return yaml.safe_dump({"groups": groups}, sort_keys=False)


def eval_seconds(prom: Prometheus, expr: str, at: float) -> float:
    """Prometheus' own timer of one evaluation of `expr` at `at` (stats=all: evalTotalTime)."""
    params = urllib.parse.urlencode({"query": expr, "time": at, "stats": "all"})
    with urllib.request.urlopen(f"{prom.url}/api/v1/query?{params}", timeout=120) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return float(body["data"]["stats"]["timings"]["evalTotalTime"])


def quiet_rule_times(prom: Prometheus, rule_files: Sequence[Path], at: float) -> Tuple[Dict[str, float],
                                                                                        Dict[str, float]]:
    """On a quiet copy: each group's rules' evaluation times summed, and each rule's
    ("group / record or alert": seconds). Every rule is asked once per round, QUIET_REPEATS
    rounds, its fastest kept: a burst of the machine's other load falls on one round of
    every rule (current and baseline alike), not on all of one rule's tries. Each round
    asks the rules in its own order (shuffled, seeded by the round): in one fixed order a
    rule's place weighed on it every round (the same alert, MpsClientLimitIgnored, took
    3.77 ms per node in one file and 2.37 in another; Prometheus' garbage collection,
    paced by what a round allocates, falling on the same rules, most likely)."""
    rules = [(g["name"], r.get("record") or r.get("alert"), r["expr"])
             for path in rule_files for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]
    per_rule: Dict[str, float] = {}
    for round_ in range(QUIET_REPEATS):
        for group, name, expr in random.Random(round_).sample(rules, len(rules)):
            took = eval_seconds(prom, expr, at)
            key = f"{group} / {name}"
            per_rule[key] = min(per_rule.get(key, took), took)
    per_group: Dict[str, float] = {}
    for group, name, _ in rules:
        per_group[group] = per_group.get(group, 0.0) + per_rule[f"{group} / {name}"]
    return per_group, per_rule


def wait_for_evaluations(prom: Prometheus, timeout: float) -> Tuple[Dict[str, List[float]], Dict[str, float]]:
    """Each group's evaluationTime over its last EVALUATIONS evaluations, and each rule's
    mean over them ("group / record or alert": seconds)."""
    seen: Dict[str, Dict[str, Tuple[float, Dict[str, float]]]] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for g in prom.rules():
            seen.setdefault(g["name"], {})
            if not g["lastEvaluation"].startswith("0001"):
                rules = {f"{g['name']} / {r['name']}": float(r.get("evaluationTime", 0.0)) for r in g["rules"]}
                seen[g["name"]][g["lastEvaluation"]] = (float(g["evaluationTime"]), rules)
        if seen and all(len(v) >= EVALUATIONS + 1 for v in seen.values()):
            break
        time.sleep(1.0)
    # The first evaluation also compiles and warms caches: leave it out.
    kept = {name: [t for _, t in sorted(v.items())][1:] for name, v in seen.items()}
    per_rule: Dict[str, List[float]] = {}
    for evaluations in kept.values():
        for _, rules in evaluations:
            for rule, t in rules.items():
                per_rule.setdefault(rule, []).append(t)
    return ({name: [t for t, _ in v] for name, v in kept.items()},
            {rule: statistics.mean(ts) for rule, ts in per_rule.items()})


def query_once(prom: Prometheus, expr: str, instant: bool, end: float) -> float:
    """As Grafana asks: tables an instant query at `end`, graphs a range query up to it."""
    if instant:
        path, params = "query", urllib.parse.urlencode({"query": expr, "time": end})
    else:
        path, params = "query_range", urllib.parse.urlencode(
            {"query": expr, "start": end - WINDOW, "end": end, "step": STEP})
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"{prom.url}/api/v1/{path}?{params}", timeout=60) as resp:
        body = json.load(resp)
    elapsed = time.perf_counter() - t0
    assert body["status"] == "success", body
    return elapsed


class QuietRun(NamedTuple):
    """A measured run's Prometheus, kept for the dashboard queries (quiet() it first)."""

    prom: Prometheus
    end: float  # the last moment with data
    first_node: str


def time_dashboards(runs: Sequence[QuietRun], dashboards: Sequence[Path],
                    renamed: Optional[Callable[[str], str]] = None) -> List[Dict[str, Dict[str, float]]]:
    """Per run, per dashboard JSON directory: every query's fastest of REPEATS. One
    dashboard at a time, each round asks every query of every directory of every run in
    turn, so that the machine's load at any moment falls on all runs and both sets alike
    (the fastest is the query's own cost)."""
    sets = {str(d): list(queries(d)) for d in dashboards}
    if renamed is not None:  # the baseline dashboards read the baseline rules' records
        for d in dashboards[1:]:
            sets[str(d)] = [q._replace(expr=renamed(q.expr)) for q in sets[str(d)]]
    timings: List[Dict[str, Dict[str, float]]] = [{d: {} for d in sets} for _ in runs]
    for name in sorted({q.dashboard for qs in sets.values() for q in qs}):
        work = [(d, f"{q.dashboard}|{q.panel}|{q.ref_id}", q.instant,
                 [concrete(q.expr, "1m", default_selection(q, run.first_node)) for run in runs])
                for d, qs in sets.items() for q in qs if q.dashboard == name]
        for _ in range(REPEATS):
            for d, key, instant, exprs in work:
                for i, run in enumerate(runs):
                    took = query_once(run.prom, exprs[i], instant, run.end)
                    timings[i][d][key] = min(timings[i][d].get(key, took), took)
    return timings


def quiet(prom: Prometheus) -> None:
    """Stop scraping and rule evaluation (the data stays): dashboard queries are then
    timed on their own, not against the rules' and 100 exporters' CPU on this machine."""
    config = yaml.safe_load(Path(prom.config_file).read_text())
    config["scrape_configs"], config["rule_files"] = [], []
    Path(prom.config_file).write_text(yaml.safe_dump(config))
    assert prom.process is not None
    prom.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while prom.rules() or prom.targets():
        assert time.monotonic() < deadline, "Prometheus did not reload"
        time.sleep(0.5)
    time.sleep(2)


def default_selection(q: Query, first_node: str) -> Dict[str, str]:
    if q.dashboard == "kubernetes":
        return {"namespace": "team-00000"}
    return {"node": first_node}


def own_series(prom: Prometheus) -> float:
    with urllib.request.urlopen(f"{prom.url}/metrics", timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("prometheus_tsdb_head_series "):
                return float(line.split()[1])
    raise AssertionError("no prometheus_tsdb_head_series")


def measure(n: int, tmp: Path, mode: str, keep: contextlib.ExitStack,
            baselines: Sequence[Path]) -> Tuple[dict, QuietRun]:
    """One run's numbers, and its Prometheus, left running in `keep` (the exporters
    stop on return) for the caller to time dashboards on, or stop. Quiet (scraping and
    rules stopped) before returning: the rules are timed on that copy here."""
    bundles, pods = node_bundles(tmp, n)
    rules = tmp / "rules.yml"
    rules.write_text(generate.prometheus_rules(interval_override=RULE_INTERVAL))
    rule_files, quiet_only = [rules], []
    for i, baseline in enumerate(baselines):
        prefix = baseline_prefix(i)
        rule_files.append(tmp / f"{prefix}rules.yml")
        rule_files[-1].write_text(baseline_rules(baseline, prefix))
        quiet_only.append(tmp / f"{prefix}alerts.yml")
        quiet_only[-1].write_text(baseline_rules(baseline, prefix, "alert"))
    with contextlib.ExitStack() as scraped:
        addresses = scraped.enter_context(
            running_replays(bundles, tmp, timeout=60 + n, flags=[f"--mps.client-granularity={mode}"]))
        ksm = scraped.enter_context(serving_text(kube_state_metrics(pods)))
        prom = keep.enter_context(
            running_prometheus(tmp, [*(Target(a, job="mps-exporter") for a in addresses),
                                     Target(ksm, job="kube-state-metrics")],
                               rule_files=[str(f) for f in rule_files], scrape_interval=SCRAPE_INTERVAL,
                               evaluation_interval=SCRAPE_INTERVAL))
        prom.wait_for_target_up(timeout=120)
        groups, rules_time = wait_for_evaluations(prom, timeout=180)

        def count(expr: str) -> float:
            rows = prom.query(f"count({expr})")
            return float(rows[0]["value"][1]) if rows else 0.0

        def per_node(expr: str) -> float:
            counts = [float(r["value"][1]) for r in prom.query(f"count by (instance) ({expr})")]
            return statistics.median(counts) if counts else 0.0

        result = {
            "n": n,
            "mode": mode,
            "series_per_node": per_node('{job="mps-exporter", __name__!~".+:.+"}'),
            "pid_series_per_node": per_node('{job="mps-exporter", pid!="", __name__!~".+:.+"}'),
            # Records keyed by pod or container (kube-state-metrics' names) have no instance
            # but grow with the nodes: per node, with the per-instance ones.
            # The current rules' records (not --baseline-rules' BASELINE ones).
            "recorded_per_node": per_node(f'{{{OURS}, instance!=""}}') + count(
                f'{{{OURS}, instance="", pod_uid!=""}} or {{{OURS}, instance="", container_id!=""}}') / n,
            "recorded_fleet": count(f'{{{OURS}, instance="", pod_uid="", container_id=""}}'),
            "head_series": own_series(prom),
            "samples_per_scrape": statistics.median(
                float(r["value"][1]) for r in prom.query('scrape_samples_scraped{job="mps-exporter"}')),
            "groups": {name: statistics.mean(t) for name, t in groups.items() if t},
            "rules": rules_time,
        }
        end = time.time() - 5  # a moment before the last scrape
        last_round = max(time.time() - 1, end)  # the rules' records exist up to here
    quiet(prom)
    result["quiet_groups"], result["quiet_rules"] = quiet_rule_times(prom, rule_files + quiet_only, last_round)
    return result, QuietRun(prom, end, sorted(addresses)[0])


def granularity_series(tmp: Path, mode: str, clients_per_pod: int) -> int:
    """Series of one 8 x 48 node (no logs) served with --mps.client-granularity MODE."""
    scen = scenarios.synthetic(tmp, gpus=GPUS, clients_per_gpu=CLIENTS_PER_GPU, clients_per_pod=clients_per_pod)
    scen.cfg.client_granularity = mode
    return sum(len(f.samples) for f in scen.collector().collect())


def fit(xs: List[float], ys: List[float]) -> Tuple[float, float]:
    """Least squares a + b x."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _rule_table(results: List[dict]) -> List[str]:
    ns = [r["n"] for r in results]
    big = results[-1]
    lines = ["| group | " + " | ".join(f"{n} exporters" for n in ns) + f" | per target at {ns[-1]} |",
             "| --- | " + " | ".join("---" for _ in ns) + " | --- |"]
    for g in sorted(big["groups"]):
        row = [f"{r['groups'].get(g, float('nan')) * 1000:.1f} ms" for r in results]
        lines.append(f"| {g} | " + " | ".join(row) + f" | {big['groups'][g] / big['n'] * 1000:.3f} ms |")
    total = [current(r["groups"]) for r in results]
    lines.append("| **all current** | " + " | ".join(f"{t * 1000:.1f} ms" for t in total) +
                 f" | {total[-1] / big['n'] * 1000:.3f} ms |")
    return lines


def _quiet_table(results: List[dict]) -> List[str]:
    """Per group: one evaluation on the quiet copy, per run and per node."""
    ns = [r["n"] for r in results]
    lines = ["| group | " + " | ".join(f"{n} exporters (per node)" for n in ns) + " |",
             "| --- | " + " | ".join("---" for _ in ns) + " |"]
    for g in sorted(results[-1]["quiet_groups"]):
        cells = [f"{r['quiet_groups'].get(g, float('nan')) * 1000:.1f} ms "
                 f"({r['quiet_groups'].get(g, float('nan')) / r['n'] * 1000:.2f} ms)" for r in results]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    for prefix in sorted({rule_set(g) for g in results[-1]["quiet_groups"]}):
        totals = [sum(t for g, t in r["quiet_groups"].items() if rule_set(g) == prefix) for r in results]
        lines.append(f"| **all {prefix + '...' if prefix else 'current'}** | " +
                     " | ".join(f"{t * 1000:.1f} ms ({t / r['n'] * 1000:.2f} ms)" for t, r in zip(totals, results)) +
                     " |")
    return lines


def _extrapolation(results: List[dict]) -> List[str]:
    big = results[-1]
    per_node = big["series_per_node"] + big["recorded_per_node"]
    total = [current(r["groups"]) for r in results]
    a, b = fit([float(r["n"]) for r in results], total) if len(results) > 1 else (0.0, 0.0)
    if b > 0 and a >= 0:
        model = (f"all rule groups take {a * 1000:.0f} ms + {b * 1000:.1f} ms per node per round (least squares "
                 "over the runs)")
    else:
        # Runs too close in size (CI's 2 and 3 nodes) leave the slope in the noise, and a
        # negative one extrapolates to negative seconds: charge the largest run's whole
        # time to its nodes instead, an upper bound (the fixed cost counted per node).
        a, b = 0.0, total[-1] / big["n"]
        model = (f"all rule groups take at most {b * 1000:.1f} ms per node per round (the largest run's time over "
                 "its nodes: the runs' sizes are too close for a fit)")
    lines = [f"`{big['mode']}` granularity: {per_node:.0f} series per node ({big['series_per_node']:.0f} scraped + "
             f"{big['recorded_per_node']:.0f} recorded) plus {big['recorded_fleet']:.0f} fleet-wide; {model}.",
             "", "| nodes | active series | samples/s at 15 s | samples/s at 5 s | all rule groups per round | "
             "of a 1 m interval |", "| --- | --- | --- | --- | --- | --- |"]
    for nodes in (1_000, 10_000):
        series = nodes * per_node + big["recorded_fleet"]
        scraped = nodes * big["series_per_node"]
        rule_time = a + b * nodes
        lines.append(f"| {nodes:,} | {series / 1e6:.2f} M | {scraped / 15 / 1e3:,.0f} k | {scraped / 5 / 1e3:,.0f} k"
                     f" | {rule_time:,.1f} s | {rule_time / 60:.0%} |")
    return lines


def _dashboard_table(results: List[dict], key: str) -> List[str]:
    """Per dashboard: its queries' times summed, per run, and the largest run's over the smallest's."""
    ns = [r["n"] for r in results]
    lines = ["| dashboard | queries | " + " | ".join(f"{n} exporters" for n in ns) + " | ratio |",
             "| --- | --- | " + " | ".join("---" for _ in ns) + " | --- |"]
    for d in sorted({k.split("|")[0] for k in results[-1][key]}):
        sums = [sum(t for k, t in r[key].items() if k.startswith(d + "|")) for r in results]
        count = sum(1 for k in results[-1][key] if k.startswith(d + "|"))
        lines.append(f"| {d} | {count} | " + " | ".join(f"{x * 1000:.0f} ms" for x in sums) +
                     f" | {sums[-1] / sums[0]:.2f}x |")
    return lines


LAYOUTS = (("outside pods", 0), ("one pod each", 1), ("six to a pod", 6))


def report(results: List[dict], others: Dict[str, List[dict]], one_node: Dict[str, int], started: str,
           argv: str) -> str:
    """`results`: the `client` granularity runs; `others`: the runs of the other granularities."""
    ns = [r["n"] for r in results]
    big = results[-1]
    lines = [f"# Fleet benchmark ({started})", "",
             f"`python3 bench/fleet_bench.py {argv}`: N replay exporters of one {GPUS} GPU x {CLIENTS_PER_GPU} "
             "client node (every client in its own pod, one namespace per node, named by the exporter; MPS "
             f"logs on), a kube-state-metrics listing those pods and {NON_MPS_PODS} others per node, one Prometheus "
             f"({SCRAPE_INTERVAL:g} s scrapes; rule groups every {RULE_INTERVAL} for the run, 1 m in production) "
             "with alerts/prometheus/mps-exporter.rules.yml. Machine: a shared 2-core VM with other jobs "
             "running: absolute times are pessimistic, ratios between runs are the point.", "",
             "## Series per node", "",
             "| granularity | exporters | series per node | with `pid` | samples per scrape | recorded per node | "
             "recorded fleet-wide | Prometheus head series |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results + [r for runs in others.values() for r in runs]:
        lines.append(f"| {r['mode']} | {r['n']} | {r['series_per_node']:.0f} | {r['pid_series_per_node']:.0f} | "
                     f"{r['samples_per_scrape']:.0f} | {r['recorded_per_node']:.0f} | {r['recorded_fleet']:.0f} | "
                     f"{r['head_series']:.0f} |")
    lines += ["", f"One {GPUS} x {CLIENTS_PER_GPU} node without logs (`dump`-like, one collection), by "
                  "`--mps.client-granularity`:", "",
              "| clients | " + " | ".join(GRANULARITIES) + " | cut by `pod` | cut by `server` |",
              "| --- | " + " | ".join("---" for _ in GRANULARITIES) + " | --- | --- |"]
    for layout, _ in LAYOUTS:
        counts = [one_node[f"{mode} {layout}"] for mode in GRANULARITIES]
        lines.append(f"| {layout} | " + " | ".join(str(c) for c in counts) +
                     f" | {counts[0] / one_node[f'pod {layout}']:.1f}x | {counts[0] / one_node[f'server {layout}']:.1f}x |")

    lines += ["", "## Rule groups on a quiet copy: Prometheus' own evaluation timer", "",
              "Scraping and rules stopped, the data kept; each rule's expression asked at the last round's moment "
              f"with `stats=all` (`evalTotalTime`), every rule once per round, the fastest of {QUIET_REPEATS} rounds, "
              "summed per group: one round's "
              "cost of each group, and per node (in parentheses). Groups named `" + BASELINE + "...` "
              "(`baseline2_...`: the second) are the --baseline-rules files' rules: their records run beside the "
              "current ones on the same data, their alerts read those records.", "",
              "`client` granularity:", ""]
    lines += _quiet_table(results)
    for mode, runs in others.items():
        if runs:
            lines += ["", f"`{mode}` granularity:", ""] + _quiet_table(runs)
    for r in [results[-1]] + [runs[-1] for runs in others.values() if runs]:
        for shown in RULE_SETS_SHOWN:
            rules = sorted(((k, t) for k, t in r["quiet_rules"].items() if shown in k), key=lambda kv: -kv[1])
            lines += ["", f"Rules of the {shown.strip(' ./')} groups at `{r['mode']}` granularity, {r['n']} exporters, "
                          "quiet copy (per node):", ""]
            lines += [f"- {t * 1000:.1f} ms ({t / r['n'] * 1000:.2f} ms): {rule}" for rule, t in rules]

    lines += ["", "## Rule groups live: one evaluation (mean of the last evaluations)", "",
              "Under load: the exporters, Prometheus' scrapes and every group (baseline ones included) on the "
              "same 2 cores.", "", "`client` granularity:", ""]
    lines += _rule_table(results)
    for mode, runs in others.items():
        if runs:
            lines += ["", f"`{mode}` granularity:", ""] + _rule_table(runs)
    for r in [results[-1]] + [runs[-1] for runs in others.values() if runs]:
        slowest = sorted(r["rules"].items(), key=lambda kv: -kv[1])[:SLOWEST_RULES]
        lines += ["", f"Slowest rules at `{r['mode']}` granularity, {r['n']} exporters (one evaluation):", ""]
        lines += [f"- {t * 1000:.1f} ms ({t / r['n'] * 1000:.2f} ms per target): {rule}" for rule, t in slowest]

    lines += ["", "## Dashboard queries at the default selection", "",
              "Sum over each dashboard's queries (`client` granularity; tables an instant query, graphs a range "
              f"query over the last {WINDOW} s of data at a 15 s step; scraping and rules stopped; each query "
              f"asked of every run in turn, {REPEATS} rounds, the fastest kept); ratio = {ns[-1]} / {ns[0]} "
              "exporters.", ""]
    lines += _dashboard_table(results, "queries")
    if "baseline_queries" in big:
        lines += ["", f"The same for the dashboards in `{big['baseline']}` (--baseline-dashboards), timed in the "
                      "same rounds:", ""] + _dashboard_table(results, "baseline_queries")
    slow = sorted(big["queries"].items(), key=lambda kv: -kv[1])[:8]
    lines += ["", f"Slowest queries at {big['n']} exporters:", ""]
    lines += [f"- {t * 1000:.1f} ms: {k.replace('|', ' / ')}" for k, t in slow]

    lines += ["", "## Extrapolation to 1,000 and 10,000 nodes", ""] + _extrapolation(results)
    for runs in others.values():
        if runs:
            lines += [""] + _extrapolation(runs)
    return "\n".join(lines) + "\n"


def _time_dashboards(results: List[dict], quiet_runs: List[QuietRun], baseline: Optional[Path],
                     baseline_rules_file: Optional[Path]) -> None:
    t0 = time.monotonic()
    dirs = [JSON_DIR] + ([baseline] if baseline else [])
    renamed = baseline_renamer(baseline_rules_file) if baseline_rules_file else None
    for result, timings in zip(results, time_dashboards(quiet_runs, dirs, renamed)):
        result["queries"] = timings[str(JSON_DIR)]
        if baseline:
            result["baseline"], result["baseline_queries"] = str(baseline), timings[str(baseline)]
    print(f"dashboards timed in {time.monotonic() - t0:.0f} s", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--pod-nodes", type=int, nargs="*", default=[10, 100],
                        help="also run these with --mps.client-granularity pod")
    parser.add_argument("--server-nodes", type=int, nargs="*", default=[10, 100],
                        help="also run these with --mps.client-granularity server")
    parser.add_argument("--baseline-dashboards", type=Path, metavar="DIR",
                        help="also time the dashboard JSON in DIR (e.g. an older commit's dashboards/json; with "
                             "--baseline-rules, reading that file's records)")
    parser.add_argument("--baseline-rules", type=Path, metavar="FILE", nargs="+", default=[],
                        help="also run the recording rules of each FILE (e.g. an older commit's "
                             "alerts/prometheus/mps-exporter.rules.yml) beside the current ones, and time them "
                             "and its alerts on the quiet copy (records and groups prefixed baseline_, "
                             "baseline2_, ... in this order)")
    parser.add_argument("--out", help="also write the report here")
    parser.add_argument("--raw", help="append each run's measurements to this JSON Lines file")
    parser.add_argument("--record", action="store_true",
                        help="write the heavy group's quiet time per node at 100 exporters beside the first "
                             "--baseline-rules file's (c5fc7fc's rules) as issue 44's figure (bench/figures.py)")
    args = parser.parse_args()
    if args.record and (100 not in args.nodes or not args.baseline_rules):
        parser.error("--record: the figure is 100 exporters (--nodes 100) beside c5fc7fc's rules (--baseline-rules)")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs: Dict[str, List[dict]] = {mode: [] for mode in GRANULARITIES}
    for mode, nodes in (("client", args.nodes), ("pod", args.pod_nodes), ("server", args.server_nodes)):
        # Only the `client` runs' dashboards are timed: their Prometheus servers stay up
        # until every run is measured, then answer the dashboards' queries side by side.
        with contextlib.ExitStack() as keep:
            quiet_runs = []
            for n in sorted(nodes):
                t0 = time.monotonic()
                with contextlib.ExitStack() as this_run:
                    tmp = Path(this_run.enter_context(tempfile.TemporaryDirectory(prefix=f"fleet-bench-{n}-")))
                    result, kept = measure(n, tmp, mode, this_run, args.baseline_rules)
                    if mode == "client":
                        keep.enter_context(this_run.pop_all())  # Prometheus and its data stay
                        quiet_runs.append(kept)
                runs[mode].append(result)
                print(f"{mode}: {n} exporters measured in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            if mode == "client" and quiet_runs:
                _time_dashboards(runs[mode], quiet_runs, args.baseline_dashboards,
                                 args.baseline_rules[0] if args.baseline_rules else None)
        if args.raw:
            with open(args.raw, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in runs[mode])
    one_node = {}
    for mode in GRANULARITIES:
        for layout, per_pod in LAYOUTS:
            with tempfile.TemporaryDirectory() as tmp:
                one_node[f"{mode} {layout}"] = granularity_series(Path(tmp), mode, per_pod)
    if args.record:
        from bench.figures import record

        [big] = [r for r in runs["client"] if r["n"] == 100]
        groups = big["quiet_groups"]
        record("heavy-group", groups[HEAVY] / 100 * 1000, groups[BASELINE + HEAVY] / 100 * 1000,
               baseline_rules=str(args.baseline_rules[0]))
    text = report(runs["client"], {m: runs[m] for m in GRANULARITIES[1:]}, one_node, started, " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
