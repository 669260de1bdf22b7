"""A restart on a node with 5 million lines of MPS logs, end to end (slow).

The exporter runs as a program; a real Prometheus scrapes it every 0.2 s with the
shipped rule file loaded. While the exporter reads the logs' history, no scrape may
show a log counter below the value it has once caught up (the counters would climb
from 0: a reset, then months of events as news), and no rule may fire on the series
served. With `--mps.log-start end` the history is skipped and the first scrape is
already complete.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

from tests.support.prometheus import Target, free_port, running_prometheus

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from steady_log import write_steady_logs  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "alerts" / "prometheus" / "mps-exporter.rules.yml"
LINES = 5_000_000
EXPORTER = [sys.executable, "-m", "mps_exporter.cli", "--no-collector.nvml", "--no-collector.dcgm",
            "--no-collector.control", "--no-collector.proc", "--mps.log-timezone", "UTC"]
# The log counters the shipped rules' increase() alerts read, and the lines read.
WATCHED = ("mps_fatal_gpu_errors_total", "mps_client_rejections_total", "mps_client_connections_total",
           "mps_log_lines_total")


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    """A busy node's logs after months of 15 s scrapes, with a fatal GPU error and a refused
    client every 50 minutes."""
    directory = tmp_path_factory.mktemp("mps-logs")
    written = write_steady_logs(directory, LINES, incidents_every=200)
    assert written >= LINES
    return directory


def exporter(log_directory: Path, port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(EXPORTER + ["--mps.log-directory", str(log_directory),
                                        "--web.listen-address", f"127.0.0.1:{port}", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def series_key(name: str, labels: Dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def scrape(port: int) -> Dict[str, float]:
    """`name{labels in name order}` -> value, of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            name, _, rest = key.partition("{")
            labels = dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if pair)
            out[series_key(name, {k: v.strip('"') for k, v in labels.items()})] = float(value)
    return out


def ready(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def scrapes_until_caught_up(port: int, proc: subprocess.Popen, limit: float) -> Iterator[Tuple[float, Dict[str, float], int]]:
    """(seconds since now, the scrape, /-/ready's status) every 0.2 s until the logs are served.
    /-/ready is asked first: a scrape that still shows a backlog then proves that the
    catch-up had not ended when /-/ready answered (asked after it, the catch-up could end
    between the two: 5 M lines now take about 5 s)."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            status = ready(port)
            sample = scrape(port)
        except OSError:  # not listening yet
            time.sleep(0.05)
            continue
        yield time.monotonic() - start, sample, status
        if sample.get('mps_log_backlog_bytes{daemon="default"}') == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"not caught up within {limit} s")


def test_catching_up_on_5m_lines_serves_no_partial_count_and_fires_no_rule(history, tmp_path):
    port = free_port()
    with running_prometheus(tmp_path, [Target(f"127.0.0.1:{port}", job="mps-exporter")],
                            rule_files=[str(RULES)], scrape_interval=0.2, evaluation_interval=0.2) as prom:
        started = time.time()
        proc = exporter(history, port)
        try:
            seen: List[Tuple[float, Dict[str, float], int]] = list(scrapes_until_caught_up(port, proc, limit=600))
            time.sleep(3)  # a few more scrapes and rule evaluations on the served series
            final = scrape(port)
            prometheus_saw = prom.api("query_range", query='{__name__=~"mps_.*_total|mps_log_backlog_bytes"}',
                                      start=str(started), end=str(time.time()), step="0.2")
            fired = prom.api("query_range", query='ALERTS{alertstate="firing"}', start=str(started),
                             end=str(time.time()), step="0.2")
        finally:
            stop(proc)
    catching_up = [(t, s, r) for t, s, r in seen if s.get('mps_log_backlog_bytes{daemon="default"}', 0) > 0]
    print(f"\ncaught up on {LINES:,} lines {seen[-1][0]:.1f} s after the first answer; {len(catching_up)} scrapes "
          f"while catching up (load average {os.getloadavg()[0]:.1f})")
    assert len(catching_up) >= 3, f"the catch-up lasted {seen[-1][0]:.1f} s: too short to watch"
    counters = {k: v for k, v in final.items() if k.startswith(WATCHED)}
    assert counters['mps_fatal_gpu_errors_total{daemon="default"}'] > 50
    assert counters['mps_log_lines_total{daemon="default",file="control"}'] > 0.99 * LINES
    for t, sample, status in catching_up:
        assert status == 503, f"/-/ready answered {status} at {t:.1f} s, while catching up"
        assert sample['mps_exporter_collector_success{collector="logs"}'] == 0
        shown = {k: v for k, v in sample.items() if k.startswith(WATCHED)}
        assert all(v >= counters[k] for k, v in shown.items()), f"a partial count at {t:.1f} s: {shown}"
    # What Prometheus stored: each log counter only ever at its final value.
    for series in prometheus_saw["result"]:
        name = series["metric"]["__name__"]
        if name.startswith(WATCHED):
            key = series_key(name, {k: v for k, v in series["metric"].items() if k not in ("__name__", "job", "instance")})
            values = {float(v) for _, v in series["values"]}
            assert values == {counters[key]}, (key, sorted(values)[:5])
    assert fired["result"] == [], [s["metric"] for s in fired["result"]]


def test_log_start_end_serves_the_first_complete_scrape_without_the_history(history):
    """The time it takes is bench/log_start_bench.py's to print; here, what the scrape holds."""
    port = free_port()
    launched = time.monotonic()
    proc = exporter(history, port, "--mps.log-start", "end")
    try:
        complete = None
        while complete is None and time.monotonic() - launched < 60:
            try:
                sample = scrape(port)
            except OSError:
                time.sleep(0.02)
                continue
            if sample['mps_exporter_collector_success{collector="logs"}'] == 1:
                complete = sample
        status = ready(port)
    finally:
        stop(proc)
    assert complete is not None and status == 200
    print(f"\nfirst complete scrape {time.monotonic() - launched:.2f} s after start, on {LINES:,} lines of "
          f"history (load average {os.getloadavg()[0]:.1f})")
    assert complete['mps_log_backlog_bytes{daemon="default"}'] == 0
    assert complete['mps_log_lines_total{daemon="default",file="control"}'] == 0  # none of the history
    assert 'mps_fatal_gpu_errors_total{daemon="default"}' in complete  # served, from 0
