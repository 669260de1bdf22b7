#!/usr/bin/env python3
"""Issue 43, done-when 2, live: the compose stack's demo profile behind real Prometheus and
Alertmanager for --minutes (15), and which alerts it fired, when, and whom it notified.

It runs what deploy/compose/compose.yaml's demo profile runs, from that directory's files:
`mps-exporter replay` with the exporter-demo service's command (on a free 127.0.0.1 port
instead of 10138); Prometheus with prometheus/prometheus.yml (15 s scrape and evaluation,
the exporter's job and `instance` label) and the rule file compose.yaml mounts (its
self-scrape job left out: no rule reads it); Alertmanager with alertmanager/alertmanager.yml,
each receiver replaced by a webhook to a sink in this process (nothing leaves the machine),
route and timings as shipped. Then it reads ALERTS over the run (query_range at 15 s from
the replay's start, the grid tests/alerts/test_replay_quiet.py steps on) and compares it
step by step with `expected_firing` (tests/support/replay_alerts.py).

Exit 0 only if no alert fired that the recording should not fire, each expected alert
fired, and every step where live and expected differ lies within TOLERANCE of a change
of the expected set (a late start or a late end); and every notification named an
expected alert, sent to a receiver that the shipped alertmanager.yml gives no notifier
(the demo pages nobody). The tolerance is a scrape interval plus an evaluation interval
plus the rule's `for:`: the stepped test scrapes and evaluates at the very step an event
becomes visible; live, the first scrape after the event and the first evaluation after
that scrape each come up to an interval later, their phases Prometheus' own.

    python3 bench/live_replay_alerts.py [--minutes 15] [--raw FILE.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.alertmanager import Webhook, running_alertmanager, wait_http, with_webhooks  # noqa: E402
from tests.support.prometheus import Prometheus, free_port, stop_process  # noqa: E402
from tests.support.replay_alerts import BY_NAME, EVENTS, INTERVAL, expected_firing, rule_seconds  # noqa: E402

COMPOSE = ROOT / "deploy/compose"
STACK = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
Note = Tuple[str, float, str, str]  # receiver, received (unix time), alertname, status
ALERTMANAGER = yaml.safe_load((COMPOSE / "alertmanager/alertmanager.yml").read_text())


def tolerance(name: str) -> int:
    return 2 * INTERVAL + rule_seconds(BY_NAME[name].for_) if name in BY_NAME else 2 * INTERVAL


def prometheus_config(exporter: str, alertmanager: str) -> Dict[str, Any]:
    config: Dict[str, Any] = yaml.safe_load((COMPOSE / "prometheus/prometheus.yml").read_text())
    config["rule_files"] = [str((COMPOSE / v.split(":")[0]).resolve()) for v in STACK["services"]["prometheus"]["volumes"]
                            if ":/etc/prometheus/rules/" in v]
    config["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [alertmanager.split("//")[1]]}]}]
    config["scrape_configs"] = [job for job in config["scrape_configs"] if job["job_name"] == "mps-exporter"]
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [exporter]
    return config


def replay_start(log: Path) -> float:
    """The replay's present (the player starts as it logs `replaying`), unix time."""
    m = re.search(r'^ts=(\S+) .*msg="replaying', log.read_text(), re.M)
    assert m, log.read_text()[-2000:]
    return datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()


def steps(alerts: Dict[str, Any], start: float, state: str) -> Dict[str, Set[float]]:
    """Alert name -> the steps (seconds after `start`) at which any of its series was in
    `state`, from the query_range matrix of ALERTS."""
    out: Dict[str, Set[float]] = {}
    for series in alerts["result"]:
        if series["metric"]["alertstate"] == state:
            out.setdefault(series["metric"]["alertname"], set()).update(
                round(float(t) - start) for t, _ in series["values"])
    return out


def longest_run(steps: Set[float]) -> int:
    """The most consecutive steps in `steps`."""
    best = 0
    for t in steps:
        if t - INTERVAL not in steps:
            n = 1
            while t + n * INTERVAL in steps:
                n += 1
            best = max(best, n)
    return best


def raw_times(prom: Prometheus, selector: str, start: float, seconds: int, grew: bool = False) -> List[float]:
    """The times (seconds after `start`) of the raw samples of `selector` over the run, or of
    those where a series grew (a counter's scrapes that saw an event)."""
    data = prom.api("query", query=f"{selector}[{seconds + INTERVAL}s]", time=f"{start + seconds + INTERVAL:.3f}")
    return sorted({round(float(b[0]) - start, 1) for series in data["result"]  # type: ignore[index]
                   for a, b in zip([[0, "inf"], *series["values"]], series["values"])
                   if not grew or float(b[1]) > float(a[1])})


def timeline(prom: Prometheus, start: float, seconds: int) -> List[str]:
    """Where the delay of each event alert comes from: the first scrape that saw its
    counter grow, the first evaluation that fired it (raw sample times, not the grid)."""
    scrapes = raw_times(prom, 'up{job="mps-exporter"}', start, seconds)
    lines = [f"first scrape {scrapes[0]:.1f} s after the replay's start (scrape phase {scrapes[0] % INTERVAL:.1f} s)"]
    for name, counter in EVENTS.items():
        seen = raw_times(prom, counter, start, seconds, grew=True)
        fired = raw_times(prom, f'ALERTS{{alertstate="firing", alertname="{name}"}}', start, seconds)
        lines.append(f"{name:30} counter grew at scrape {seen[0] if seen else 'never'} s, "
                     f"fired at evaluation {fired[0] if fired else 'never'} s")
    return lines


def changes(steps: Set[float], grid: List[float]) -> List[float]:
    """The steps at which membership in `steps` changes."""
    return [t for prev, t in zip(grid, grid[1:]) if (prev in steps) != (t in steps)]


def report(alerts: Dict[str, Any], grid: List[float], seconds: int, notes: List[Note], start: float) -> bool:
    fired, pending = steps(alerts, start, "firing"), steps(alerts, start, "pending")
    expected: Dict[str, Set[float]] = {}
    for t in grid:
        for name in expected_firing(t, seconds):
            expected.setdefault(name, set()).add(t)
    ok = True
    print(f"{'alert':30} {'fired at':>9} {'expected':>9} {'diff':>6} {'tolerance':>9}  steps live/expected, off")
    for name in sorted(set(fired) | set(expected)):
        live, want = fired.get(name, set()), expected.get(name, set())
        off = [t for t in sorted(live ^ want) if not any(c <= t < c + tolerance(name) for c in changes(want, grid))]
        first = f"{min(live):9.0f}" if live else "    never"
        moment = f"{min(want):9.0f}" if want else "    never"
        diff = f"{min(live) - min(want):+6.0f}" if live and want else "     -"
        verdict = "unexpected" if not want else "missing" if not live else f"{len(off)} off" + (f" {off[:5]}" if off else "")
        print(f"{name:30} {first} {moment} {diff} {tolerance(name):9d}  {len(live)}/{len(want)}, {verdict}")
        ok = ok and bool(live) and bool(want) and not off
    print("\nPending, never fired (the longest run of 15 s steps pending, against the rule's for:):")
    for name in sorted(set(pending) - set(fired)):
        print(f"  {name:30} {longest_run(pending[name]):3d} steps pending, for: {BY_NAME[name].for_}")
    print(f"\nNotifications (webhook per receiver; seconds after the replay's start), {len(notes)} alerts in all:")
    quiet = {r["name"] for r in ALERTMANAGER["receivers"] if set(r) == {"name"}}
    for receiver in sorted({n[0] for n in notes}):
        mine = [n for n in notes if n[0] == receiver]
        print(f"  {receiver} ({'no notifier in the shipped file' if receiver in quiet else 'NOTIFIES'}): {len(mine)}")
        for name, status in sorted({(n[2], n[3]) for n in mine}):
            times = [n[1] - start for n in mine if (n[2], n[3]) == (name, status)]
            print(f"    {name:30} {status:8} x{len(times)}  first {min(times):.0f} s, last {max(times):.0f} s")
            ok = ok and name in EVENTS and receiver in quiet
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=15)
    parser.add_argument("--raw", type=Path, help="write the ALERTS matrix and the notifications here (JSON)")
    args = parser.parse_args()
    seconds = args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="live-replay-alerts-") as tmp:
        work, webhook = Path(tmp), Webhook()
        exporter = f"127.0.0.1:{free_port()}"
        with running_alertmanager(work, with_webhooks(ALERTMANAGER, webhook.url)) as am, \
                open(work / "replay.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "mps_exporter.cli", *STACK["services"]["exporter-demo"]["command"],
                                     f"--web.listen-address={exporter}"], stdout=log, stderr=subprocess.STDOUT)
            prom = Prometheus(str(work), prometheus_config(exporter, am))
            try:
                wait_http(f"http://{exporter}/-/healthy", proc, work / "replay.log")
                prom.start()
                start = replay_start(work / "replay.log")
                print(f"replay {exporter} started {time.strftime('%H:%M:%S', time.localtime(start))}; "
                      f"Prometheus {prom.url}, Alertmanager {am}; waiting {args.minutes} min", flush=True)
                time.sleep(max(0.0, start + seconds + INTERVAL - time.time()))
                print("\n".join(timeline(prom, start, seconds)) + "\n")
                alerts = prom.api("query_range", query="ALERTS", start=f"{start:.3f}", end=f"{start + seconds:.3f}",
                                  step=str(INTERVAL))
            finally:
                prom.stop()
                stop_process(proc)
        webhook.close()
    notes = [(n.receiver, n.received, n.alert["labels"]["alertname"], n.alert["status"]) for n in webhook.received()]
    if args.raw:
        args.raw.write_text(json.dumps({"replay_start": start, "alerts": alerts, "notifications": [
            n._asdict() for n in webhook.received()]}, indent=1, sort_keys=True))
    grid = [float(i * INTERVAL) for i in range(seconds // INTERVAL + 1)]
    ok = report(alerts, grid, seconds, notes, start)  # type: ignore[arg-type]
    print("\nPASS" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
