"""What a real MPS node pays (issue 44): this tree's exporter and another revision's
(--old-package, e.g. the tree issue 44 was filed on) side by side on one MPS daemon with
--clients clients, beside node_exporter, each scraped alike: not at all, every 15 s,
every second. CPU is the sum of the threads' schedstat (exact; utime + stime in 10 ms ticks beside
in the JSON, and per thread: the exporters' threads name themselves), the control
processes each exporter starts apart (reaped children, in ticks); RSS from /proc/PID/status.

    python3 tests/gpu/node_cost.py --work /tmp/mps-cost --out DIR --old-package DIR \
        --node-exporter PATH [--clients 8] [--busy 4]

Writes DIR/node_cost.json and DIR/node_cost.md. The MPS daemon it starts is told to quit
whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from bench.cost_bench import Scraper, Threads, scrape_timeout, serves_metrics, threads_cpu  # noqa: E402 (Prometheus' scrapes, as cost_bench makes them)

TICK = os.sysconf("SC_CLK_TCK")
# (phase, scrape interval in s or None, seconds measured, seconds before: the pacing learns
# the spacing from three scrapes)
PHASES = (("unscraped", None, 60.0, 0.0), ("15 s", 15.0, 60.0, 46.0), ("1 s", 1.0, 45.0, 5.0))


def cpu(pid: int) -> Dict[str, float]:
    """CPU seconds of the process itself and of its reaped children."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {"own": (int(fields[11]) + int(fields[12])) / TICK, "children": (int(fields[13]) + int(fields[14])) / TICK}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# `mps-exporter serve` with each thread naming itself (its Python name, cut to 15 characters,
# as the kernel keeps it) for the per-thread schedstat: CPython names no OS thread.
NAMED_THREADS = ("import ctypes, sys, threading\nlibc = ctypes.CDLL(None)\nboot = threading.Thread._bootstrap_inner\n"
                 "def named(self):\n    libc.prctl(15, self.name.encode()[:15], 0, 0, 0)\n    boot(self)\n"
                 "threading.Thread._bootstrap_inner = named\nfrom mps_exporter.cli import main\n"
                 "sys.exit(main(sys.argv[1:]))\n")


# NAMED_THREADS with every thread profiled by yappi (carried in .whl/: CPython 3.12's
# cProfile is one profiler for all threads), CPU clock: on SIGUSR2 each thread's counts so
# far go to $MPS_PROFILE_OUT.<n> (marshal: (thread, function) -> (own s, with callees s,
# calls)); two of them bound the window (--profile).
PROFILED_THREADS = NAMED_THREADS.replace("    boot(self)\n", (
    "    thread_names[threading.get_ident()] = self.name\n    boot(self)\n")).replace(
    "from mps_exporter.cli import main\n", (
    "import marshal, os, signal, yappi\nthread_names = {}  # ident -> name, the ended threads' too\n"
    "def dump(*_):\n    names = {**thread_names, threading.main_thread().ident: 'MainThread'}\n    out = {}\n"
    "    for t in yappi.get_thread_stats():\n"
    "        for f in yappi.get_func_stats(filter={'ctx_id': t.id}):\n"
    "            key = (names.get(t.tid, t.name), f.full_name)\n            o = out.get(key, (0.0, 0.0, 0))\n"
    "            out[key] = (o[0] + f.tsub, o[1] + f.ttot, o[2] + f.ncall)\n"
    "    with open(os.environ['MPS_PROFILE_OUT'] + f'.{dump.n}', 'wb') as f:\n        marshal.dump(out, f)\n"
    "    dump.n += 1\ndump.n = 0\nsignal.signal(signal.SIGUSR2, dump)\n"
    "yappi.set_clock_type('cpu')\nyappi.start(builtins=True, profile_threads=True)\n"
    "from mps_exporter.cli import main\n"))


def exporter(package: Path, port: int, pipe: Path, logs: Path, out: Path, name: str,
             bootstrap: str = NAMED_THREADS) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{package}:/tmp/site", "MPS_PROFILE_OUT": str(out / f"{name}.profile")}
    return subprocess.Popen(
        [sys.executable, "-c", bootstrap, "serve", "--mps.pipe-directory", str(pipe),
         "--mps.log-directory", str(logs), "--no-collector.dcgm", "--web.listen-address", f"127.0.0.1:{port}"],
        env=env, stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT)


PER_GPU_THREAD = "mps-read-nvml-"  # nvml.PerGpuReads names its threads this and the GPU's index


def thread_group(name: str) -> str:
    """A thread's name as reported: the per-GPU NVML reads as one."""
    return PER_GPU_THREAD + "N" if name.startswith(PER_GPU_THREAD) and name[len(PER_GPU_THREAD):].isdigit() else name


def by_thread(before: Threads, after: Threads, seconds: float) -> Dict[str, float]:
    """CPU ms/s per thread name (the per-GPU NVML reads as one) of the threads alive at the end."""
    out: Dict[str, float] = {}
    for tid, (comm, ns) in after.items():
        name = thread_group(comm)
        out[name] = out.get(name, 0.0) + (ns - before.get(tid, (comm, 0))[1]) / 1e6 / seconds
    return {k: round(v, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--new-package", type=Path, default=Path("/tmp/pkg"), help="a directory holding mps_exporter")
    ap.add_argument("--old-package", type=Path, required=True, help="a directory holding the other mps_exporter")
    ap.add_argument("--old-name", default="c5fc7fc")
    ap.add_argument("--node-exporter", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--busy", type=int, default=4)
    ap.add_argument("--scale", type=float, default=1.0, help="the phases' seconds times this (a dry run off the GPU)")
    ap.add_argument("--profile", type=float, metavar="SECONDS",
                    help="instead: this tree alone, every thread profiled (yappi, from .whl/), scraped every 15 s for "
                         "SECONDS; writes DIR/profile.md, where each function's time goes per scrape")
    args = ap.parse_args()
    phases = (("15 s profiled", 15.0, args.profile, 46.0),) if args.profile else PHASES
    pipe, logs, clients_dir = args.work / "pipe", args.work / "log", args.work / "clients"
    for d in (pipe, logs, clients_dir, args.out):
        d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    procs: List[subprocess.Popen] = []
    report: Dict[str, Any] = {"clients": args.clients, "busy": args.busy, "phases": []}
    stop_file = clients_dir / "stop"
    try:
        report["machine"] = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        report["cpus"] = os.cpu_count()
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
        for i in range(args.clients):
            busy = i < args.busy
            cmd = [sys.executable, str(HERE / "workloads" / "gpu_client.py"), "1.0", "--ready", str(clients_dir / f"ready-{i}"),
                   "--stop", str(stop_file), "--max-seconds", "500", "--n", "2048"] + ([] if busy else ["--idle"])
            procs.append(subprocess.Popen(cmd, env={**env, "TAG": f"c{i}"}, stdout=open(clients_dir / f"c{i}.out", "w"),
                                          stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sum((clients_dir / f"ready-{i}").exists() for i in range(args.clients)) \
                + sum(p.poll() is not None for p in procs) < args.clients:
            time.sleep(0.5)
        report["clients_ready"] = sum((clients_dir / f"ready-{i}").exists() for i in range(args.clients))
        targets = {"mps-exporter (this tree)": 10138, f"mps-exporter ({args.old_name})": 10148, "node_exporter": 9100}
        if args.profile:
            targets = {"mps-exporter (this tree)": 10138}
        pids: Dict[str, int] = {}
        for name, port in targets.items():
            if name == "node_exporter":
                p = subprocess.Popen([args.node_exporter, "--web.listen-address=127.0.0.1:9100", "--log.level=warn"],
                                     stdout=open(args.out / "node_exporter.log", "w"), stderr=subprocess.STDOUT)
            else:
                package = args.new_package if "this tree" in name else args.old_package
                p = exporter(package, port, pipe, logs, args.out, f"exporter-{port}",
                             PROFILED_THREADS if args.profile else NAMED_THREADS)
            procs.append(p)
            pids[name] = p.pid
        for port in targets.values():
            if not serves_metrics(port, 90):
                raise RuntimeError(f"nothing serves /metrics on port {port}")
        time.sleep(10 * args.scale)  # start-up done: the first scrape above read everything once
        for phase, interval, seconds, before in phases:
            scrapers = ({name: Scraper(port, interval, scrape_timeout(interval)).start()
                         for name, port in targets.items()} if interval else {})
            time.sleep(before * args.scale)
            if args.profile:
                os.kill(pids["mps-exporter (this tree)"], signal.SIGUSR2)
            c0, t0 = {name: cpu(pid) for name, pid in pids.items()}, time.monotonic()
            th0 = {name: threads_cpu(pid) or {} for name, pid in pids.items()}
            n0 = {name: len(s.latencies) for name, s in scrapers.items()}
            time.sleep(seconds * args.scale)
            c1, elapsed = {name: cpu(pid) for name, pid in pids.items()}, time.monotonic() - t0
            if args.profile:
                os.kill(pids["mps-exporter (this tree)"], signal.SIGUSR2)
                time.sleep(2)  # the profile written
            th1 = {name: threads_cpu(pid) or {} for name, pid in pids.items()}
            for s in scrapers.values():
                s.stop()
            row: Dict[str, Any] = {"phase": phase, "seconds": round(elapsed, 1), "load": os.getloadavg()}
            for name, pid in pids.items():
                lat = sorted(scrapers[name].latencies[n0[name]:]) if scrapers else []
                threads = by_thread(th0[name], th1[name], elapsed)
                row[name] = {"cpu_ms_per_s": round((c1[name]["own"] - c0[name]["own"]) / elapsed * 1000, 3),
                             "exact_cpu_ms_per_s": round(sum(threads.values()), 3), "threads": threads,
                             "children_cpu_ms_per_s": round((c1[name]["children"] - c0[name]["children"]) / elapsed
                                                            * 1000, 3),
                             "rss_mib": round(rss_mib(pid), 1), "scrapes": len(lat),
                             "p50_ms": round(lat[len(lat) // 2] * 1000, 2) if lat else None,
                             "failures": scrapers[name].failures if scrapers else 0}
            report["phases"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        stop_file.touch()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env, timeout=20,
                       capture_output=True)
        (args.out / "node_cost.json").write_text(json.dumps(report, indent=1))
        (args.out / "node_cost.md").write_text(markdown(report))
        if args.profile and report["phases"]:
            (args.out / "profile.md").write_text(profile_markdown(
                args.out / "exporter-10138.profile", report["phases"][0]["mps-exporter (this tree)"]["scrapes"]))
    return 0


def profile_markdown(stem: Path, scrapes: int, top: int = 100) -> str:
    """Where the window's CPU went (profiled: each call costs more than unprofiled, the
    shares are the point), per thread and per function, per scrape."""
    import marshal

    before, after = (marshal.loads(Path(f"{stem}.{n}").read_bytes()) for n in (0, 1))
    per = max(1, scrapes)
    threads: Dict[str, float] = {}
    functions: Dict[str, List[float]] = {}
    for (thread, function), (own, total, calls) in after.items():
        if function.endswith(" dump") or "yappi" in function:  # the first dump, inside the window
            continue
        o0, t0, n0 = before.get((thread, function), (0.0, 0.0, 0))
        name = thread_group(thread)
        threads[name] = threads.get(name, 0.0) + own - o0
        row = functions.setdefault(f"{name} {function}", [0.0, 0.0, 0.0])
        row[0] += own - o0
        row[1] += total - t0
        row[2] += calls - n0
    lines = [f"Profiled, {scrapes} scrapes: ms per scrape", "", "| thread | own ms |", "| --- | --- |"]
    lines += [f"| {t} | {v * 1000 / per:.3f} |" for t, v in sorted(threads.items(), key=lambda kv: -kv[1])]
    for column, by in ((0, "own"), (1, "with callees")):
        lines += ["", f"By {by} time:", "", "| thread, function | own ms | with callees ms | calls |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {f} | {v[0] * 1000 / per:.3f} | {v[1] * 1000 / per:.3f} | {v[2] / per:.1f} |"
                  for f, v in sorted(functions.items(), key=lambda kv: -kv[1][column])[:top]]
    return "\n".join(lines) + "\n"


def markdown(report: Dict[str, Any]) -> str:
    names = [k for k in (report["phases"][0] if report["phases"] else {}) if k not in ("phase", "seconds", "load")]
    lines = [f"{report.get('machine', '')}; {report.get('cpus')} CPUs; {report.get('clients_ready')} of "
             f"{report['clients']} MPS clients ready ({report['busy']} busy)", "",
             "| phase | " + " | ".join(f"{n} CPU ms/s (control processes) | RSS MiB | p50 ms" for n in names) + " |",
             "| --- |" + " --- | --- | --- |" * len(names)]
    for row in report["phases"]:
        cells = []
        for n in names:
            r: Dict[str, Optional[float]] = row[n]
            cells.append(f"{r.get('exact_cpu_ms_per_s', r['cpu_ms_per_s'])} ({r['children_cpu_ms_per_s']}) | "
                         f"{r['rss_mib']} | {r['p50_ms']}")
        lines.append(f"| {row['phase']} | " + " | ".join(cells) + " |")
    for n in names:
        lines += ["", f"{n}, CPU ms/s per thread:", ""]
        for row in report["phases"]:
            threads = row[n].get("threads") or {}
            lines.append(f"- {row['phase']}: " + ", ".join(f"{t} {v:.3f}" for t, v in threads.items() if v >= 0.005))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
