"""Scrape latency and the exporter's CPU on a simulated backend, in the format Prometheus
asks for (OpenMetrics, gzip), steady and through a recorded client storm, with the
background refresh (--collector.refresh-interval 1, the default) and without it (0).

The backend is the test fakes: steady, each NVML call sleeps its `us` figure from the
capture's nvml_busy.json, the three process calls what they took settled with 48
clients on an H100 (issue 29), and each control command 1.9 ms (ctl_latency.txt); /proc
is a real directory tree. Storm: each NVML call sleeps what the same call took at that
moment of a real storm, 48 clients arriving at once on an H100 (tests/data/storm/,
recorded by tests/gpu/storm.py), every simulated GPU (48 clients each) replaying that
GPU's storm; scraped once a second in real time from 10 s into it, with Prometheus'
default scrape timeout (10 s) and with the 1 s it sends for a 1 s interval.

CPU is the benchmark process's CPU time (per scrape, or per second of the storm, the
refresher's reads included): the exporter's work (joins, exposition, the sources' own
parsing) plus the fakes', whose calls sleep. Every row prints the machine's load average
beside it: other work on the machine skews the times.

    python3 bench/scrape_bench.py [--scrapes 200] [--storm-seconds 20] [--storm-gpus 2,8]

`--scrapes 0 --storm-gpus 2` runs the two-GPU storm alone (96 clients, issue 30's synthetic
part: the live run on two GPUs is tests/gpu/multi_gpu_phase.py).

Prints Markdown tables; numbers, not a pass/fail.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import gzip
import json
import logging
import os
import re
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

from mps_exporter.collector import build_registry  # noqa: E402
from mps_exporter.config import Config  # noqa: E402
from mps_exporter.scrape_timeout import scrape_timeout  # noqa: E402
from mps_exporter.wiring import build_collector, build_readers  # noqa: E402
from tests.support import scenarios  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STORM = ROOT / "tests" / "data" / "storm" / "h100-48-clients-nvml-latency.json"
# What Prometheus 2.49+/3.x sends (scrape_protocols' default order).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.6,application/openmetrics-text;"
                     "version=0.0.1;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
STORM_FROM = 10.0  # seconds into the recorded storm where the benchmark starts scraping
# Microseconds a call, settled, 8 rounds with 48 clients on the H100 of issue 29.
SETTLED_48_US = {"nvmlDeviceGetMPSComputeRunningProcesses": 4800.0, "nvmlDeviceGetProcessUtilization": 3300.0,
                 "nvmlDeviceGetComputeRunningProcesses": 2900.0}


def scrape(registry: Any, timeout_header: str) -> bytes:
    """What the web server does for a Prometheus scrape: negotiate, then encode and gzip
    (the readings' part reused while the readings stay the same)."""
    encoder, content_type = choose_encoder(PROMETHEUS_ACCEPT)
    with scrape_timeout(timeout_header):
        body: bytes = registry.encode(encoder, content_type, True)
    return body


def setup(tmp: Path, gpus: int, per_gpu: int, max_seconds: float = 5.0,
          refresh: float = 0.0, every_gpu: bool = False) -> Tuple[Any, Any, Any]:
    """The scenario over the fakes, NVML slowed as measured: the capture's per-call times,
    and the three process calls as a 48-client GPU took them once settled (issue 29's
    H100: MPS list 4.8 ms, process utilization 3.3 ms, compute list 2.9 ms a call)."""
    scen = scenarios.synthetic(tmp, gpus=gpus, clients_per_gpu=per_gpu, latency=True)
    scen.nvml.latency_us.update(SETTLED_48_US)
    scen.cfg.scrape_max_seconds = max_seconds  # --scrape.max-duration
    scen.cfg.refresh_interval = refresh  # --collector.refresh-interval
    scen.cfg.control_wait = Config.control_wait  # --collector.control-wait at its default (scenarios: 0)
    readers = build_readers(scen.cfg, scen.backends())
    if every_gpu:  # the reference: a read of every GPU waits for each (nvml.PerGpuReads)
        readers["nvml"].source.gpus.wait_seconds = None
    collector = build_collector(scen.cfg, readers)
    collector.start()
    stop_collector = collector.close

    def close() -> None:  # as service.serve ends: the readers' own threads (NVML's per GPU) too
        stop_collector()
        for reader in readers.values():
            reader.close()

    collector.close = close
    return scen, collector, build_registry(collector, process=False)


def steady(gpus: int, per_gpu: int, scrapes: int, refresh: float) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        _, collector, registry = setup(Path(tmp), gpus, per_gpu, refresh=refresh)
        gc.freeze()  # as `mps-exporter serve` does after start-up
        walls, cpus = [], []
        for i in range(scrapes + 5):
            t0, c0 = time.perf_counter(), time.process_time()
            zipped = scrape(registry, "10")
            if i >= 5:  # the first scrapes also fetch cached server facts and start GPM
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
        families = list(registry.collect())
        collector.close()
        gc.unfreeze()
    return {"walls": walls, "cpus": cpus, "bytes": len(gzip.decompress(zipped)), "gzip": len(zipped),
            "families": families}


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


NVML_TIME = re.compile(rb'^mps_exporter_collector_last_success_timestamp_seconds\{collector="nvml"\} (\S+)$', re.M)


def storm(gpus: int, per_gpu: int, timeout_header: str, max_seconds: float, seconds: float,
          refresh: float, every_gpu: bool = False) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        scen, collector, registry = setup(Path(tmp), gpus, per_gpu, max_seconds, refresh, every_gpu)
        scrape(registry, "10")  # start-up (cached facts, first GPM sample) before the storm
        latency = StormLatency(STORM, time.monotonic())
        scen.nvml.latency_of = latency
        walls, ages, late = [], [], 0
        tick = time.monotonic()
        c0 = time.process_time()
        while time.monotonic() - latency.start < seconds:
            t0 = time.perf_counter()
            at = time.time()
            zipped = scrape(registry, timeout_header)
            walls.append(time.perf_counter() - t0)
            body = gzip.decompress(zipped)
            late += b'mps_exporter_collector_success{collector="nvml"} 0.0' in body
            taken = NVML_TIME.search(body)
            ages.append(max(0.0, at - float(taken.group(1))) if taken else float("inf"))
            tick += 1.0
            time.sleep(max(0.0, tick - time.monotonic()))
        cpu_per_second = (time.process_time() - c0) / (time.monotonic() - latency.start)
        scen.nvml.latency_of = None
        collector.close()
        for t in threading.enumerate():  # a late read still sleeping: let it end before the next run
            if t.name.startswith("mps-read"):
                t.join(10)
    return {"walls": walls, "ages": ages, "late": late, "cpu_per_second": cpu_per_second}


def paused(seconds: float) -> Dict[str, Any]:
    """An exporter nobody scrapes: after --collector.pause-after, CPU and control commands."""
    with tempfile.TemporaryDirectory() as tmp:
        scen, collector, registry = setup(Path(tmp), 8, 48, refresh=1.0)
        collector.pause_after = 1.0
        scrape(registry, "10")
        time.sleep(2.5)  # the pause begins
        commands, rounds, c0, t0 = len(scen.daemon.received), collector.refreshes, time.process_time(), time.monotonic()
        time.sleep(seconds)
        cpu_ms = (time.process_time() - c0) / (time.monotonic() - t0) * 1000
        result = {"cpu_ms_per_second": cpu_ms, "commands": len(scen.daemon.received) - commands,
                  "rounds": collector.refreshes - rounds}
        collector.close()
    return result


def pct(values: List[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] * 1000


def load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def main() -> None:
    logging.disable(logging.WARNING)  # the storm's late collectors would log every flip
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--storm-seconds", type=float, default=20.0, help="0: no storm")
    ap.add_argument("--storm-gpus", default="2,8", help="GPU counts of the storm runs, comma-separated")
    args = ap.parse_args()
    if args.scrapes > 0:
        steady_part(args.scrapes)
    if args.storm_seconds > 0:
        storm_part([int(n) for n in args.storm_gpus.split(",")], args.storm_seconds)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of the benchmark process: {rss_mb:.1f} MB")


def steady_part(scrapes: int) -> None:
    print(f"Steady: OpenMetrics and gzip, as Prometheus asks; scrape timeout 10 s ({os.cpu_count()} CPUs)\n")
    print("| scenario | --collector.refresh-interval | scrape p50 ms | scrape p99 ms | CPU p50 ms | CPU p99 ms | "
          "OpenMetrics bytes | gzip bytes | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    families: List[Any] = []
    for gpus, per_gpu in ((1, 3), (8, 48)):
        for refresh in (1.0, 0.0):
            r = steady(gpus, per_gpu, scrapes, refresh)
            families = r["families"]
            print(f"| {gpus} GPU x {per_gpu} clients each | {refresh:g} s | {pct(r['walls'], 50):.2f} | "
                  f"{pct(r['walls'], 99):.2f} | {pct(r['cpus'], 50):.2f} | {pct(r['cpus'], 99):.2f} | {r['bytes']} | "
                  f"{r['gzip']} | {load()} |")
    print("\nEncoding one 8 GPU x 48 clients each (384 clients) collection, without reuse (median ms): " +
          ", ".join(f"{k} {v:.2f}" for k, v in encode_ms(families).items()))
    r = paused(5.0)
    print(f"\nNobody scraping, after --collector.pause-after (8 GPU x 48 clients each): "
          f"{r['cpu_ms_per_second']:.3f} ms CPU per second, {r['commands']} control commands, "
          f"{r['rounds']} background rounds in 5 s ({load()})")


def storm_part(gpu_counts: List[int], seconds: float) -> None:
    print(f"\nStorm: the recorded H100 storm (48 clients at once, single NVML calls up to 0.49 s) on every GPU, "
          f"from {STORM_FROM:g} s into it, {seconds:g} s of scrapes once a second. Age: of the NVML "
          f"reading served, at the scrape\n")
    print("A GPU's read waits at most 0.25 s (nvml.GPU_WAIT_SECONDS), then its last reading stands in; the "
          "reference row waits for every GPU, as before issue 45.\n")
    print("| scenario | --collector.refresh-interval | Prometheus timeout | --scrape.max-duration | scrape p50 ms | "
          "scrape p99 ms | scrape max ms | CPU ms per second | NVML age p50 / max s | scrapes with NVML late | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for gpus in gpu_counts:
        for refresh, timeout, ceiling, every_gpu in ((1.0, "1", 5.0, False), (1.0, "1", 5.0, True),
                                                     (1.0, "10", 5.0, False), (0.0, "10", 5.0, False),
                                                     (0.0, "1", 5.0, False)):
            r = storm(gpus, 48, timeout, ceiling, seconds, refresh, every_gpu)
            scenario = f"{gpus} GPU x 48 clients each" + (", every GPU waited for (reference)" if every_gpu else "")
            print(f"| {scenario} | {refresh:g} s | {timeout} s | {ceiling:g} s | "
                  f"{pct(r['walls'], 50):.0f} | {pct(r['walls'], 99):.0f} | {max(r['walls']) * 1000:.0f} | "
                  f"{r['cpu_per_second'] * 1000:.1f} | {pct(r['ages'], 50) / 1000:.2f} / {max(r['ages']):.2f} | "
                  f"{r['late']} of {len(r['walls'])} | {load()} |")


if __name__ == "__main__":
    main()
