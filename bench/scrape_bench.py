"""Scrape latency and the exporter's own overhead, on a simulated backend.

The backend is the test fakes with the capture's measured call latencies: each
NVML call sleeps its `us` figure from nvml_busy.json, each control command
1.9 ms (ctl_latency.txt); /proc is a real directory tree. Overhead = scrape
time minus time inside backend calls (NVML, control commands, /proc file
reads): what the exporter itself adds (parsing, joins, exposition).

    python3 bench/scrape_bench.py [--scrapes 200]

Prints a Markdown table; numbers, not a pass/fail.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mps_exporter.exposition import generate_text  # noqa: E402

from mps_exporter.collector import build_registry  # noqa: E402
from mps_exporter.sources.base import Backends  # noqa: E402
from mps_exporter.wiring import build_collector, build_readers  # noqa: E402
from tests.gpu.rawcost import TimedModule, TimedRunner  # noqa: E402
from tests.support import scenarios  # noqa: E402


def run(gpus: int, clients_per_gpu: int, scrapes: int):
    with tempfile.TemporaryDirectory() as tmp:
        scen = scenarios.synthetic(Path(tmp), gpus=gpus, clients_per_gpu=clients_per_gpu, latency=True)
        # The same timing wrappers the GPU truth check uses for its raw cost.
        nvml, runner = TimedModule(scen.nvml), TimedRunner(scen.daemon)
        readers = build_readers(scen.cfg, Backends(nvml_module=nvml, control_runner=runner))
        proc = readers["proc"].source
        proc_reads = TimedRunner(proc._read)  # /proc file reads are backend I/O too
        proc._read = proc_reads
        collector = build_collector(scen.cfg, readers)
        registry = build_registry(collector)
        gc.freeze()  # as `mps-exporter serve` does after start-up

        def spent() -> float:
            return nvml.seconds + runner.seconds + proc_reads.seconds

        totals, overheads = [], []
        for i in range(scrapes + 5):
            before = spent()
            t0 = time.perf_counter()
            body = generate_text(registry)  # what /metrics serves in the text format
            total = time.perf_counter() - t0
            backend = spent() - before
            if i >= 5:  # the first scrapes also fetch cached server facts and start GPM
                totals.append(total)
                overheads.append(total - backend)
        return totals, overheads, len(body)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=200)
    args = ap.parse_args()
    print("| scenario | scrape p50 ms | scrape p99 ms | overhead p50 ms | overhead p99 ms | exposition bytes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for gpus, per_gpu in ((1, 3), (8, 6)):
        totals, overheads, size = run(gpus, per_gpu, args.scrapes)
        print(f"| {gpus} GPU x {gpus * per_gpu} clients | {pct(totals, 50):.2f} | {pct(totals, 99):.2f} | "
              f"{pct(overheads, 50):.2f} | {pct(overheads, 99):.2f} | {size} |")
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of the benchmark process (exporter code, fakes, {args.scrapes} scrapes x 2): {rss_mb:.1f} MB")
    print(f"mean overhead check: {statistics.mean(overheads) * 1000:.2f} ms at 8x48")


if __name__ == "__main__":
    main()
