"""What a node pays: mps-exporter's CPU beside node_exporter's, scraped alike, same run.

mps-exporter serves the synthetic node (8 GPUs x 48 MPS clients each, tests/support/
scenarios.synthetic with NVML and the control daemon slowed as measured, as in
bench/scrape_bench.py) through the real `serve` (web server, collector, background
refresh at its defaults), its client memory and utilization samples moving every second
(a busy node: every scrape sees changed readings). node_exporter serves its default
collectors (Debian's `prometheus-node-exporter`: on PATH, or `--node-exporter PATH`, e.g.
from `apt-get download prometheus-node-exporter && dpkg -x ...deb DIR`).

Both are scraped side by side as Prometheus scrapes them (its Accept header, gzip,
`X-Prometheus-Scrape-Timeout-Seconds`: 10 at a 15 s interval, 1 at 1 s; one keep-alive
connection), at each interval for `--seconds`, after a warm-up of three scrapes and
WARM_UP_SECONDS. CPU is each process's CPU clock over that time (every thread's, those
that ended too; ns); the ratio by utime + stime from /proc is printed beside it (10 ms ticks: at
15 s scrapes node_exporter counts a few dozen in 120 s). For mps-exporter, less the CPU
of the simulated node, printed beside it: the thread that moves its readings (the whole
thread: its wake-ups too), and the calls into its fake NVML library and fake control
daemon (SimulatedCpu: on a real node the driver's library and a daemon in a process of
its own; their cost there is measured on a GPU, tests/gpu/node_cost.py). Prints one
Markdown row per interval: CPU ms per second of each, their ratio, mps-exporter's
background rounds and the load average.

    python3 bench/cost_bench.py [--intervals 15,1] [--seconds 60] [--readings still,moving] [--pacing fixed,paced] [--node-exporter PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.6,application/openmetrics-text;"
                     "version=0.0.1;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
WARM_UP_SECONDS = 5.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Threads = Dict[str, Tuple[str, int]]  # thread id -> (its name as the kernel keeps it, its CPU in ns)


def threads_cpu(pid: int) -> Optional[Threads]:
    """Each live thread's name and CPU time in ns (schedstat: exact, where utime + stime
    count 10 ms ticks); None where the kernel keeps no schedstat."""
    if not os.path.exists(f"/proc/{pid}/schedstat"):
        return None
    out: Threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                out[tid] = (name, int(f.read().split()[0]))
        except OSError:  # the thread ended meanwhile
            pass
    return out


def process_cpu_seconds(pid: int) -> Optional[float]:
    """The CPU time of every thread of process `pid`, those that ended too, exact (ns): its
    process CPU clock, as clock_getcpuclockid(3) names it (the kernel's
    MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED); Python has no wrapper). None where the
    kernel refuses it. A sum over the live threads' schedstat would miss the CPU of a
    thread that ended in the window (a read thread idle 60 s ends)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        return None


class SimulatedCpu:
    """CPU seconds spent inside the simulated node's calls, by the part of it called: each
    outermost call of a wrapped function counted once, in the thread that made it (a fake
    that calls itself is not counted twice). `clock` is the calling thread's CPU clock.

    Each thread adds to totals of its own, summed when read: a lock taken after every
    call (about 100 a round, 8 GPU threads at once) and its bookkeeping were the bench's
    CPU, counted as the exporter's."""

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        self.clock = clock
        self._parts: Dict[str, None] = {}  # the parts wrapped so far, in order
        self._inside = threading.local()  # .now: in a counted call; .totals: the thread's
        self._lock = threading.Lock()  # guards _threads
        self._threads: List[Dict[str, float]] = []

    def _totals(self) -> Dict[str, float]:
        """The calling thread's totals, made at its first call."""
        totals: Dict[str, float] = dict.fromkeys(self._parts, 0.0)
        with self._lock:
            self._threads.append(totals)
        self._inside.totals = totals
        return totals

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        self._parts[part] = None
        clock, inside = self.clock, self._inside

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(inside, "now", False):
                return fn(*args, **kwargs)
            totals = getattr(inside, "totals", None) or self._totals()
            inside.now = True
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - started
                inside.now = False
                totals[part] = totals.get(part, 0.0) + spent
        return counted

    @property
    def seconds(self) -> Dict[str, float]:
        return self.parts()

    def parts(self) -> Dict[str, float]:
        """The seconds so far by part, every thread's."""
        with self._lock:
            threads = list(self._threads)
        out = dict.fromkeys(self._parts, 0.0)
        for totals in threads:
            for part, seconds in list(totals.items()):  # one C call: atomic beside the thread's adds
                out[part] += seconds
        return out

    def total(self) -> float:
        return sum(self.parts().values())


def count_fake_nvml(fake: Any, simulated: SimulatedCpu) -> None:
    """Every pynvml function of `fake` (tests/fakes/fake_pynvml.FakeNvml) and every C entry
    point it hands out, counted as the simulated node's "nvml"."""
    for name in dir(type(fake)):
        if name.startswith("nvml") and callable(getattr(fake, name)):
            setattr(fake, name, simulated.wrap("nvml", getattr(fake, name)))
    if fake.__dict__.get("entry_points", True):
        entry_point = fake._function_pointer
        fake._nvmlGetFunctionPointer = simulated.wrap("nvml", lambda name: simulated.wrap("nvml", entry_point(name)))


def serve_synthetic(port: int, rounds_file: str, moving: bool, paced: bool, exit_status: bool) -> None:
    """The child: the synthetic 8 x 48 node behind `serve`; NVML's clock (utilization
    samples, GPM) advancing each second, and with `moving` every client's memory too."""
    import logging

    from mps_exporter import service
    from mps_exporter.collector import MpsCollector
    from mps_exporter.wiring import build_readers
    from tests.support import scenarios
    from bench.scrape_bench import SETTLED_48_US

    logging.disable(logging.WARNING)
    if not paced:  # the reference: a round every refresh interval, however seldom scrapes come
        from mps_exporter import collector as collector_module

        collector_module.next_refresh = lambda started, *_: started + cfg.refresh_interval  # type: ignore[assignment]
    tmp = Path(tempfile.mkdtemp(prefix="cost-bench-"))
    scen = scenarios.synthetic(tmp, gpus=8, clients_per_gpu=48, latency=True)
    scen.nvml.latency_us.update(SETTLED_48_US)
    cfg = scen.cfg
    cfg.listen_address = f"127.0.0.1:{port}"
    cfg.control_wait = type(cfg)().control_wait  # the flag's default (scenarios set 0)
    cfg.exit_status = exit_status  # --mps.exit-status: on by default
    stop = threading.Event()
    collectors: List[MpsCollector] = []
    real_start = MpsCollector.start

    def start(self: MpsCollector) -> None:  # keep a handle on it for the round count
        collectors.append(self)
        real_start(self)

    MpsCollector.start = start  # type: ignore[method-assign]

    simulated = SimulatedCpu()
    count_fake_nvml(scen.nvml, simulated)
    backends = dataclasses.replace(scen.backends(), control_runner=simulated.wrap("control daemon", scen.daemon))

    def move() -> None:
        step = 0
        while not stop.wait(1.0):
            step += 1
            scen.nvml.advance(1.0)
            if moving:
                for gpu in scen.nvml.gpus:
                    for k, (mps, compute) in enumerate(zip(gpu.mps_processes, gpu.compute_processes[1:])):
                        used = (k + 1) * (64 << 20) + ((step + k) % 16) * (1 << 20)
                        mps.usedGpuMemory = compute.usedGpuMemory = used

    mover = threading.Thread(target=move, daemon=True)

    def report(*_: object) -> None:
        assert mover.ident is not None
        parts = {"clock": time.clock_gettime(time.pthread_getcpuclockid(mover.ident)),  # the whole thread
                 **simulated.parts()}
        with open(rounds_file, "w", encoding="ascii") as f:
            json.dump({"rounds": collectors[0].refreshes if collectors else -1, "simulated": parts}, f)

    signal.signal(signal.SIGUSR1, report)
    mover.start()
    service.serve(cfg, stop=stop, readers=build_readers(cfg, backends))


def scrape_timeout(interval: float) -> str:
    """Prometheus' default scrape timeout at `interval`, as its header says it."""
    return "10" if interval >= 15 else f"{min(interval, 10):g}"


class Scraper:
    """Prometheus' scrapes of one target: every `interval` s on one keep-alive connection."""

    def __init__(self, port: int, interval: float, timeout: str) -> None:
        self.port, self.interval, self.timeout = port, interval, timeout
        self.latencies: List[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip",
                   "X-Prometheus-Scrape-Timeout-Seconds": self.timeout}
        tick = time.monotonic()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/metrics", headers=headers)
                resp = conn.getresponse()
                resp.read()
                self.latencies.append(time.perf_counter() - t0)
                self.failures += resp.status != 200
            except OSError:
                self.failures += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            tick += self.interval
            self._stop.wait(max(0.0, tick - time.monotonic()))
        conn.close()

    def start(self) -> "Scraper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def serves_metrics(port: int, seconds: float, running: Callable[[], bool] = lambda: True) -> bool:
    """Whether /metrics on `port` answers within `seconds`, asked every 0.2 s while `running`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/metrics")
            conn.getresponse().read()
            conn.close()
            return True
        except OSError:
            if not running() or time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def wait_up(port: int, proc: subprocess.Popen, what: str) -> None:
    if not serves_metrics(port, 60, lambda: proc.poll() is None):
        from tests.support.prometheus import stop_process  # here: Scraper needs no test support

        stop_process(proc)
        sys.exit(f"{what} did not start")


def rounds(proc: subprocess.Popen, rounds_file: str) -> Tuple[int, Dict[str, float]]:
    """The child's background rounds so far, and the CPU seconds its simulated node took,
    by part (SimulatedCpu's, and its clock's thread)."""
    os.unlink(rounds_file) if os.path.exists(rounds_file) else None
    proc.send_signal(signal.SIGUSR1)
    for _ in range(100):
        if os.path.exists(rounds_file) and os.path.getsize(rounds_file):
            report = json.loads(Path(rounds_file).read_text())
            return int(report["rounds"]), {k: float(v) for k, v in report["simulated"].items()}
        time.sleep(0.05)
    return -1, {}


def _between(before: Optional[float], after: Optional[float]) -> Optional[float]:
    return None if before is None or after is None else after - before


def measure(interval: float, seconds: float, node_exporter: str, readings: str, pacing: str,
            exit_status: bool) -> Dict[str, float]:
    from tests.support.prometheus import free_port, stop_process

    timeout = scrape_timeout(interval)
    with tempfile.TemporaryDirectory() as tmp:
        rounds_file = os.path.join(tmp, "rounds")
        mps_port, node_port = free_port(), free_port()
        mps = subprocess.Popen([sys.executable, __file__, "--serve", str(mps_port), "--rounds-file", rounds_file,
                                "--readings", readings, "--pacing", pacing]
                               + ([] if exit_status else ["--no-exit-status"]),
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        node = subprocess.Popen([node_exporter, f"--web.listen-address=127.0.0.1:{node_port}", "--log.level=warn"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_up(mps_port, mps, "mps-exporter")
            wait_up(node_port, node, "node_exporter")
            scrapers = [Scraper(mps_port, interval, timeout).start(), Scraper(node_port, interval, timeout).start()]
            time.sleep(WARM_UP_SECONDS + 3 * interval)  # the refresher knows the spacing after three scrapes
            c_mps, c_node, (r0, h0), t0 = (cpu_seconds(mps.pid), cpu_seconds(node.pid), rounds(mps, rounds_file),
                                           time.monotonic())
            n_mps, n_node = process_cpu_seconds(mps.pid), process_cpu_seconds(node.pid)
            time.sleep(seconds)
            n_mps_s = _between(n_mps, process_cpu_seconds(mps.pid))
            n_node_s = _between(n_node, process_cpu_seconds(node.pid))
            c_mps, c_node = cpu_seconds(mps.pid) - c_mps, cpu_seconds(node.pid) - c_node
            elapsed = time.monotonic() - t0
            r1, h1 = rounds(mps, rounds_file)
            for s in scrapers:
                s.stop()
        finally:
            stop_process(mps)
            stop_process(node)
    # The simulated node (NVML's clock and the clients' memory in a thread of their own, the
    # fake NVML and control daemon in the threads calling them) runs in the exporter's
    # process: its CPU is the simulation's, left out of the exporter's.
    simulated_ms = {part: (h1[part] - h0.get(part, 0.0)) / elapsed * 1000 for part in h1}
    harness_ms = sum(simulated_ms.values())
    tick_mps_ms, tick_node_ms = c_mps / elapsed * 1000 - harness_ms, c_node / elapsed * 1000
    exact = n_mps_s is not None and n_node_s is not None
    mps_ms = n_mps_s / elapsed * 1000 - harness_ms if n_mps_s is not None else tick_mps_ms
    node_ms = n_node_s / elapsed * 1000 if n_node_s is not None else tick_node_ms
    lat = sorted(scrapers[0].latencies)
    return {"mps": mps_ms, "harness": harness_ms, "simulated": simulated_ms, "node": node_ms, "ratio": mps_ms / node_ms if node_ms else float("inf"),
            "tick_ratio": tick_mps_ms / tick_node_ms if tick_node_ms else float("inf"), "exact": exact,
            "rounds": r1 - r0, "scrapes": len(scrapers[0].latencies),
            "p50": lat[len(lat) // 2] * 1000 if lat else float("nan"),
            "failures": scrapers[0].failures + scrapers[1].failures, "elapsed": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals", default="15,1", help="scrape intervals in seconds, comma-separated")
    ap.add_argument("--seconds", type=float, default=60.0, help="measured seconds per interval (default 60; CPU is counted in 10 ms ticks)")
    ap.add_argument("--node-exporter", default=shutil.which("prometheus-node-exporter") or shutil.which("node_exporter"))
    ap.add_argument("--readings", default="still",
                    help="still (memory steady), moving (every client's memory changes each second), or both")
    ap.add_argument("--pacing", default="fixed,paced",
                    help="fixed (the reference: a background round every --collector.refresh-interval, as before "
                         "issue 44), paced (no faster than scrapes come), or both")
    ap.add_argument("--no-exit-status", action="store_true",
                    help="serve with --no-mps.exit-status: without the proc connector's listener, whose cost "
                         "follows how many processes the whole machine starts and ends")
    ap.add_argument("--record", action="store_true",
                    help="write the 15 s and 1 s rows (still, paced) as issue 44's figures (bench/figures.py)")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rounds-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve_synthetic(args.serve, args.rounds_file, args.readings == "moving", args.pacing == "paced",
                        not args.no_exit_status)
        return
    if not args.node_exporter:
        sys.exit("node_exporter not found: apt-get download prometheus-node-exporter, dpkg -x it, --node-exporter PATH")
    print(f"CPU of mps-exporter (synthetic 8 GPU x 48 clients{', --no-mps.exit-status' if args.no_exit_status else ''}) and node_exporter (default "
          f"collectors), scraped side by side, {args.seconds:g} s each after three scrapes and {WARM_UP_SECONDS:g} s ({os.cpu_count()} CPUs)\n")
    print("| readings | scrape interval | background rounds | mps-exporter CPU ms/s | simulated node ms/s (left out: its parts) | "
          "node_exporter CPU ms/s | ratio | ratio by ticks | mps rounds | scrapes | mps scrape p50 ms | failures | load |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for readings in args.readings.split(","):
        for interval in [float(x) for x in args.intervals.split(",")]:
            for pacing in args.pacing.split(","):
                r = measure(interval, args.seconds, args.node_exporter, readings, pacing, not args.no_exit_status)
                parts = ", ".join(f"{part} {ms:.2f}" for part, ms in r["simulated"].items())
                print(f"| {readings} | {interval:g} s | {pacing} | {r['mps']:.2f} | {r['harness']:.2f} ({parts}) | {r['node']:.2f} | "
                      f"{r['ratio']:.2f}{'' if r['exact'] else ' (ticks)'} | {r['tick_ratio']:.2f} | "
                      f"{r['rounds']} | {r['scrapes']} | {r['p50']:.1f} | {r['failures']} | "
                      "load average %.2f %.2f %.2f |" % os.getloadavg(), flush=True)
                if args.record and readings == "still" and pacing == "paced" and interval in (15, 1):
                    from bench.figures import record

                    record(f"cpu-{interval:g}s", r["mps"], r["node"], seconds=args.seconds, scrapes=r["scrapes"],
                           ratio_by_ticks=round(r["tick_ratio"], 3), exact=r["exact"],
                           simulated_node_ms_per_s={k: round(v, 3) for k, v in r["simulated"].items()})


if __name__ == "__main__":
    main()
