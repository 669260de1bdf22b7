"""CPU of one scrape's encoding where some readings changed (issue 29): OpenMetrics and
gzip as Prometheus asks, over the fakes with no NVML latency and no background refresh
(every scrape collects), the exporter's process_* included as `serve` has them.

Cases, between two scrapes: nothing changed; 5 clients' memory changed; 2 clients
arrived and the 2 oldest left (the client count stays). Per scrape: the whole scrape's
CPU (process time: the sources' reads in their threads included) and the encoding's
(process time from the collection's end to the body: render, encode, gzip, the
exporter's own series and process_*). Medians and p90 of `--scrapes` scrapes, with the
machine's load average beside each row.

    python3 bench/encode_bench.py [--scrapes 200] [--gpus 1,8] [--profile CASE]

`--profile memory` prints a cProfile of that case instead (on the first of `--gpus`).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import logging
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scrape_bench import scrape, setup  # noqa: E402
from mps_exporter.collector import build_registry  # noqa: E402
from tests.fakes.fake_control import FakeClient  # noqa: E402
from tests.fakes.fake_procfs import FakeProcess, write_proc  # noqa: E402
from tests.fakes.fake_pynvml import FakeProcess as NvmlProcess  # noqa: E402


def nothing(scen: Any, i: int) -> None:
    pass


def memory(scen: Any, i: int) -> None:
    gpu = scen.nvml.gpus[0]
    for k in range(5):
        gpu.mps_processes[(5 * i + k) % len(gpu.mps_processes)].usedGpuMemory += 1 << 20


def churn(scen: Any, i: int) -> None:
    """Two clients arrive on GPU 0, its two oldest leave."""
    gpu = scen.nvml.gpus[0]
    new = [50000 + 2 * i, 50001 + 2 * i]
    write_proc(scen.proc_root, [FakeProcess(pid, uid=1000 + pid % 7) for pid in new])
    gone = {p.pid for p in gpu.mps_processes[:2]}
    gpu.mps_processes = gpu.mps_processes[2:] + [NvmlProcess(pid, 256 << 20) for pid in new]
    gpu.compute_processes = [p for p in gpu.compute_processes if p.pid not in gone] + \
        [NvmlProcess(pid, 256 << 20) for pid in new]
    scen.daemon.clients = [c for c in scen.daemon.clients if c.pid not in gone] + \
        [FakeClient(pid, 4000, gpu.uuid, 1000 + 2 * i + k) for k, pid in enumerate(new)]


CASES: Dict[str, Callable[[Any, int], None]] = {"nothing": nothing, "memory": memory, "churn": churn}


def run(gpus: int, case: str, scrapes: int, profile: bool = False) -> Dict[str, List[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        scen, collector, _ = setup(Path(tmp), gpus, 48, refresh=0.0)
        scen.nvml.latency_us.clear()
        registry = build_registry(collector, process=True)
        collection = collector.collection
        marks: List[float] = []

        def timed() -> Any:
            snap = collection()
            marks.append(time.process_time())
            return snap

        collector.collection = timed  # type: ignore[method-assign]
        mutate = CASES[case]
        for i in range(5):  # start-up: cached facts, GPM's first sample, the first encodings
            mutate(scen, -5 + i + 10**6)
            scen.nvml.advance(1.0)
            scrape(registry, "10")
        gc.collect()
        gc.freeze()
        totals, encodes = [], []
        prof = cProfile.Profile() if profile else None
        for i in range(scrapes):
            mutate(scen, i)
            scen.nvml.advance(1.0)
            marks.clear()
            if prof:
                prof.enable()
            c0 = time.process_time()
            scrape(registry, "10")
            c1 = time.process_time()
            if prof:
                prof.disable()
            totals.append(c1 - c0)
            encodes.append(c1 - marks[-1])
        collector.close()
        gc.unfreeze()
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return {"total": totals, "encode": encodes}


def pct(values: List[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))] * 1000


def main() -> None:
    logging.disable(logging.WARNING)
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--gpus", default="1,8")
    ap.add_argument("--profile", choices=sorted(CASES))
    args = ap.parse_args()
    if args.profile:
        run(int(args.gpus.split(",")[0]), args.profile, args.scrapes, profile=True)
        return
    print(f"CPU per scrape, ms: OpenMetrics + gzip, 48 clients a GPU, refresh 0 ({os.cpu_count()} CPUs)\n")
    print("| GPUs | between scrapes | scrape p50 | scrape p90 | encode p50 | encode p90 | load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gpus in (int(n) for n in args.gpus.split(",")):
        for case in CASES:
            r = run(gpus, case, args.scrapes)
            print(f"| {gpus} | {case} | {pct(r['total'], 50):.2f} | {pct(r['total'], 90):.2f} | "
                  f"{pct(r['encode'], 50):.2f} | {pct(r['encode'], 90):.2f} | "
                  "load average %.2f %.2f %.2f |" % os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
