"""Scrape latency and the exporter's CPU per scrape on a simulated backend, in the format
Prometheus asks for (OpenMetrics, gzip), steady and through a recorded client storm.

The backend is the test fakes: steady, each NVML call sleeps its `us` figure from the
capture's nvml_busy.json and each control command 1.9 ms (ctl_latency.txt); /proc is a
real directory tree. Storm: each NVML call sleeps what the same call took at that
moment of a real storm, 48 clients arriving at once on an H100
(tests/data/storm/, recorded by tests/gpu/storm.py), every simulated GPU replaying
that GPU's storm; scraped once a second in real time from 10 s into it, with
Prometheus' default scrape timeout (10 s) and with the 1 s it sends for a 1 s interval.

CPU per scrape is the benchmark process's CPU time over the scrape: the exporter's work
(joins, exposition, the sources' own parsing) plus the fakes', whose calls sleep.

    python3 bench/scrape_bench.py [--scrapes 200] [--storm-seconds 20]

Prints Markdown tables; numbers, not a pass/fail.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import gzip
import json
import logging
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client.exposition import choose_encoder, generate_latest  # noqa: E402
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics  # noqa: E402

from mps_exporter.collector import build_registry, scrape_timeout  # noqa: E402
from mps_exporter.wiring import build_collector, build_readers  # noqa: E402
from tests.support import scenarios  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STORM = ROOT / "tests" / "data" / "storm" / "h100-48-clients-nvml-latency.json"
# What Prometheus 2.49+/3.x sends (scrape_protocols' default order).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.6,application/openmetrics-text;"
                     "version=0.0.1;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
STORM_FROM = 10.0  # seconds into the recorded storm where the benchmark starts scraping


def scrape(registry: Any, timeout_header: str) -> Tuple[bytes, bytes]:
    """What the web server does for a Prometheus scrape: negotiate, encode, gzip."""
    encoder, _ = choose_encoder(PROMETHEUS_ACCEPT)
    with scrape_timeout(timeout_header):
        body = encoder(registry)
    return body, gzip.compress(body, compresslevel=6)


def setup(tmp: Path, gpus: int, per_gpu: int, max_seconds: float = 5.0) -> Tuple[Any, Any]:
    scen = scenarios.synthetic(tmp, gpus=gpus, clients_per_gpu=per_gpu, latency=True)
    scen.cfg.scrape_max_seconds = max_seconds  # --scrape.max-duration
    collector = build_collector(scen.cfg, build_readers(scen.cfg, scen.backends()))
    return scen, build_registry(collector, process=False)


def steady(gpus: int, per_gpu: int, scrapes: int) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        _, registry = setup(Path(tmp), gpus, per_gpu)
        gc.freeze()  # as `mps-exporter serve` does after start-up
        walls, cpus = [], []
        for i in range(scrapes + 5):
            t0, c0 = time.perf_counter(), time.process_time()
            body, zipped = scrape(registry, "10")
            if i >= 5:  # the first scrapes also fetch cached server facts and start GPM
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
        families = list(registry.collect())
        gc.unfreeze()
    return {"walls": walls, "cpus": cpus, "bytes": len(body), "gzip": len(zipped), "families": families}


def encode_ms(families: List[Any]) -> Dict[str, float]:
    """Milliseconds to encode one collection (median of 30), per format."""
    frozen = type("Frozen", (), {"collect": lambda self: families})()
    encoders = {"OpenMetrics": generate_openmetrics, "classic text": generate_latest,
                "OpenMetrics + gzip": lambda r: gzip.compress(generate_openmetrics(r), 6)}
    times: Dict[str, List[float]] = {name: [] for name in encoders}
    for _ in range(31):  # interleaved, so that a busy moment of the machine hits all alike
        for name, fn in encoders.items():
            t0 = time.perf_counter()
            fn(frozen)
            times[name].append(time.perf_counter() - t0)
    return {name: sorted(t[1:])[len(t) // 2] * 1000 for name, t in times.items()}


class StormLatency:
    """The recorded storm, call by call: a call takes what the same function took at the
    latest recorded call at or before the same moment of the storm."""

    def __init__(self, path: Path, start: float) -> None:
        doc = json.loads(path.read_text())
        self.start = start
        self.by_fn: Dict[str, Tuple[List[float], List[float]]] = {}
        for t, _gpu, fn, seconds in doc["calls"]:
            times, secs = self.by_fn.setdefault(fn, ([], []))
            times.append(t)
            secs.append(seconds)
        self.machine, self.clients = doc.get("machine", ""), doc.get("clients")

    def __call__(self, fn: str, gpu: int) -> float:
        recorded = self.by_fn.get(fn)
        if recorded is None:
            return 0.0
        times, secs = recorded
        i = bisect.bisect_right(times, time.monotonic() - self.start + STORM_FROM) - 1
        return secs[max(i, 0)]


def storm(gpus: int, clients: int, timeout_header: str, max_seconds: float, seconds: float) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        scen, registry = setup(Path(tmp), gpus, clients // gpus, max_seconds)
        scrape(registry, "10")  # start-up (cached facts, first GPM sample) before the storm
        latency = StormLatency(STORM, time.monotonic())
        scen.nvml.latency_of = latency
        walls, cpus, late = [], [], 0
        tick = time.monotonic()
        while time.monotonic() - latency.start < seconds:
            t0, c0 = time.perf_counter(), time.process_time()
            body, _ = scrape(registry, timeout_header)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            late += b'mps_exporter_collector_success{collector="nvml"} 0.0' in body
            tick += 1.0
            time.sleep(max(0.0, tick - time.monotonic()))
        marked = b'mps_exporter_collector_last_success_timestamp_seconds{collector="nvml"}' in body
        scen.nvml.latency_of = None
        for t in threading.enumerate():  # a late read still sleeping: let it end before the next run
            if t.name.startswith("mps-read"):
                t.join(10)
    return {"walls": walls, "cpus": cpus, "late": late, "marked": marked}


def pct(values: List[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] * 1000


def main() -> None:
    logging.disable(logging.WARNING)  # the storm's late collectors would log every flip
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--storm-seconds", type=float, default=20.0, help="0: no storm")
    args = ap.parse_args()
    print("Steady: OpenMetrics and gzip, as Prometheus asks; scrape timeout 10 s\n")
    print("| scenario | scrape p50 ms | scrape p99 ms | CPU p50 ms | CPU p99 ms | OpenMetrics bytes | gzip bytes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    families: List[Any] = []
    for gpus, per_gpu in ((1, 3), (8, 6)):
        r = steady(gpus, per_gpu, args.scrapes)
        families = r["families"]
        print(f"| {gpus} GPU x {gpus * per_gpu} clients | {pct(r['walls'], 50):.2f} | {pct(r['walls'], 99):.2f} | "
              f"{pct(r['cpus'], 50):.2f} | {pct(r['cpus'], 99):.2f} | {r['bytes']} | {r['gzip']} |")
    print("\nEncoding one 8 GPU x 48 client collection (median ms): " +
          ", ".join(f"{k} {v:.2f}" for k, v in encode_ms(families).items()))
    if args.storm_seconds <= 0:
        return
    print(f"\nStorm: the recorded H100 storm (48 clients at once) from {STORM_FROM:g} s into it, "
          f"{args.storm_seconds:g} s of scrapes once a second\n")
    print("| scenario | Prometheus timeout | --scrape.max-duration | scrape p50 ms | scrape p99 ms | scrape max ms | "
          "CPU p50 ms | scrapes with NVML late (success 0, last reading served, marked) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for gpus in (2, 8):
        for timeout, ceiling in (("10", 5.0), ("10", 1.0), ("1", 5.0)):
            r = storm(gpus, 48, timeout, ceiling, args.storm_seconds)
            print(f"| {gpus} GPU x 48 clients | {timeout} s | {ceiling:g} s | {pct(r['walls'], 50):.0f} | "
                  f"{pct(r['walls'], 99):.0f} | "
                  f"{max(r['walls']) * 1000:.0f} | {pct(r['cpus'], 50):.1f} | {r['late']} of {len(r['walls'])}"
                  f"{'' if r['marked'] else ' (unmarked!)'} |")
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of the benchmark process: {rss_mb:.1f} MB")


if __name__ == "__main__":
    main()
