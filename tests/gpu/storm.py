"""The client storm on a real GPU (issues 12 and 29): many MPS clients arriving at once,
the exporters scraped every second through it.

    python3 tests/gpu/storm.py --work /tmp/mps-storm --out DIR [--clients 48] [--busy 12]

- starts its own MPS control daemon (its own pipe and log directories; `quit` at the end
  whatever happens) and mps-exporter (`serve`) with every NVML call timed per GPU
  inside the exporter process (`timed-serve` below: thin wrappers around pynvml);
- starts nvitop-exporter beside it, and (issue 29) a second mps-exporter that reads NVML
  in every scrape (`--collector.refresh-interval 0`) to compare with the first (the
  default background refresh, 1 s); the age of the NVML reading each scrape served is
  recorded, and after the storm, with nobody scraping past `--pause-after`, control.log's
  growth and the first exporter's CPU per second;
- scrapes both once a second (mps-exporter as Prometheus does: OpenMetrics, gzip and
  `X-Prometheus-Scrape-Timeout-Seconds: 1`, the timeout Prometheus sends for a 1 s
  interval), a few seconds idle, then through the storm: CLIENTS clients started at
  once, BUSY of them multiplying matrices, the others holding memory; until every
  client is ready and a while after;
- once settled, every client's memory as mps-exporter serves it against nvidia-smi;
- writes DIR/storm-report.json (the fields issue 12 asks for; `side_by_side`, `pause`),
  DIR/storm-report.md (the side-by-side table) and
  DIR/storm-nvml-latency.json (every NVML call: seconds since the storm began, GPU,
  function, seconds), the fixture bench/scrape_bench.py replays.

CPU per scrape is each exporter's user+system time (/proc/PID/stat) over the storm
divided by its scrapes: everything it did at this cadence, background threads included.
Inside the exporter (`timed-serve`), DIR/calls.json also holds where that CPU went
(`cpu_series`: thread CPU per part, NVML per function, sampled every second, and per OS thread
("thread:NAME (TID)", every 10 s)), each
scrape's wall time split into waiting for the sources and the rest (`scrape_walls`), each
source read's wall and where it ran (`reads`), and the garbage collector's passes over 2 ms (`slow_gc`). `profile_storm.sh` runs it on the
lent machine, with py-spy unless PYSPY=0.
"""

from __future__ import annotations

import argparse
import gzip
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.6,application/openmetrics-text;"
                     "version=0.0.1;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
MIB = 2**20


# ---------------------------------------------------------------- in the exporter process
def timed_serve(argv: List[str], calls_out: str) -> int:
    """mps-exporter `serve` with every pynvml call timed: (monotonic start, gpu, function, seconds)."""
    import pynvml

    calls: List[Tuple[float, int, str, float]] = []
    handles: Dict[int, int] = {}  # id(handle) -> GPU index
    # Where the exporter's CPU goes: thread CPU seconds per part, cumulative, sampled every
    # second with the process's own CPU (cpu_series in the calls file).
    cpu: Dict[str, float] = {}
    depth = threading.local()

    def counted(part: str, fn: Any, key: str = "") -> Any:
        """fn with its thread's CPU added to cpu[key or part] (the outermost call of a part
        only; "read:" parts are named after the source)."""
        def run(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(depth, part, 0)
            setattr(depth, part, outer + 1)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(depth, part, outer)
                if not outer:
                    name = key or (part + args[0].name if part == "read:" else part)
                    cpu[name] = cpu.get(name, 0.0) + time.thread_time() - start
        return run

    def wrap(name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.monotonic() - start
                gpu = handles.get(id(args[0]), -1) if args else -1
                calls.append((start, gpu, name, seconds))
        return counted("nvml", timed, "nvml:" + name)

    for name in dir(pynvml):
        if name.startswith("nvml") and inspect.isfunction(getattr(pynvml, name)) and name != "nvmlDeviceGetHandleByIndex":
            setattr(pynvml, name, wrap(name, getattr(pynvml, name)))
    by_index = pynvml.nvmlDeviceGetHandleByIndex

    def handle_by_index(index: int) -> Any:
        start = time.monotonic()
        handle = by_index(index)
        handles[id(handle)] = index
        calls.append((start, index, "nvmlDeviceGetHandleByIndex", time.monotonic() - start))
        return handle

    pynvml.nvmlDeviceGetHandleByIndex = handle_by_index
    # The list functions the exporter calls straight through their C entry points
    # (sources/nvml.py DirectLists), timed under pynvml's public names as before.
    lookup = pynvml._nvmlGetFunctionPointer

    def timed_lookup(name: str) -> Any:
        entry = lookup(name)
        public = name[:-3] if name.endswith(("_v2", "_v3")) else name
        if public not in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses",
                          "nvmlDeviceGetProcessUtilization"):
            return entry
        return wrap(public, entry)

    pynvml._nvmlGetFunctionPointer = timed_lookup
    import mps_exporter.collector as collector_module
    import mps_exporter.logs.pipeline as pipeline_module
    import mps_exporter.httpd.web as web_module
    from mps_exporter.cli import main

    # Each source read's wall: (monotonic start, source, seconds, "here" for a quick read in
    # the scrape's thread that answered, "declined" for one that handed over, else "thread").
    reads: List[Tuple[float, str, float, str]] = []
    source_read = collector_module._SourceRun._read

    def timed_read(self: Any, future: Any, collection: Any, quick: bool = False) -> bool:
        start = time.monotonic()
        done: bool = source_read(self, future, collection, quick)
        reads.append((start, self.name, time.monotonic() - start, ("here" if done else "declined") if quick else "thread"))
        return done

    collector_module._SourceRun._read = counted("read:", timed_read)
    collector_module.Exposition.encode = counted("encode", collector_module.Exposition.encode)
    # Each scrape's wall time split: waiting for the sources, and the rest of the encoding.
    scrape_walls: List[Tuple[float, float, float]] = []  # (start, collection seconds, encode seconds)
    collection = collector_module.MpsCollector.collection
    encode = collector_module.Exposition.encode
    waited = threading.local()

    def timed_collection(self: Any) -> Any:
        start = time.monotonic()
        try:
            return collection(self)
        finally:
            waited.seconds = time.monotonic() - start

    def timed_encode(self: Any, *args: Any) -> Any:
        start, waited.seconds = time.monotonic(), 0.0
        try:
            return encode(self, *args)
        finally:
            scrape_walls.append((start, waited.seconds, time.monotonic() - start))

    collector_module.MpsCollector.collection = timed_collection
    collector_module.Exposition.encode = timed_encode
    web_module._Exchange.answer = counted("http", web_module._Exchange.answer)
    pipeline_module.LogPipeline._poll_file = counted("logs", pipeline_module.LogPipeline._poll_file)
    series: List[Tuple[float, float, Dict[str, float]]] = []
    stop = threading.Event()

    # CPU seconds per OS thread, by the Python thread's name (pool threads started with
    # _thread have none: "tid N"), cumulative: what the parts above leave out.
    by_thread: Dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")

    def thread_cpu() -> Dict[str, float]:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            try:
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended meanwhile
            name = names.get(int(tid), f"tid {tid}")
            # a thread that ended keeps what it had; a name used by several threads, the sum
            by_thread[f"{name} ({tid})"] = (int(fields[11]) + int(fields[12])) / tick
        return dict(by_thread)

    def sample() -> None:
        rounds = 0
        while not stop.wait(1.0):
            t = os.times()
            rounds += 1  # threads every 10 s: reading their stat files costs the exporter CPU too
            threads = thread_cpu() if rounds % 10 == 0 else by_thread
            series.append((time.monotonic(), t.user + t.system, {**cpu, **{"thread:" + k: v for k, v in
                                                                           threads.items()}}))

    threading.Thread(target=sample, daemon=True).start()
    import gc

    collections: List[Tuple[float, int, float]] = []  # (start, generation, seconds) of the slow ones
    gc_start = [0.0]

    def gc_timed(phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0] = time.monotonic()
        elif time.monotonic() - gc_start[0] > 0.002:
            collections.append((gc_start[0], info["generation"], time.monotonic() - gc_start[0]))

    gc.callbacks.append(gc_timed)
    try:
        return main(argv)
    finally:
        stop.set()
        with open(calls_out, "w") as f:
            json.dump({"clock": "monotonic", "calls": calls, "cpu_series": series, "scrape_walls": scrape_walls, "reads": reads,
                       "slow_gc": collections}, f)


# ---------------------------------------------------------------- the driver
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, seconds: float) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {seconds} s")


class Scraper(threading.Thread):
    """Scrapes one URL once a second (on the tick, never bunching up)."""

    def __init__(self, name: str, url: str, pid: int, headers: Dict[str, str], ages: bool = False) -> None:
        super().__init__(name=name, daemon=True)
        self.url, self.pid, self.headers = url, pid, headers
        self.ages = ages  # record the ages of the NVML and control readings each scrape served (mps-exporter)
        self.results: List[Dict[str, Any]] = []  # t, seconds, status, phase, bytes
        self.phase = "idle"
        self.stop_event = threading.Event()
        self.last_text = ""

    def run(self) -> None:
        tick = time.monotonic()
        while not self.stop_event.is_set():
            start = time.monotonic()
            wall = time.time()
            status, size = 0, 0
            try:
                req = urllib.request.Request(self.url, headers=self.headers)
                with urllib.request.urlopen(req, timeout=30) as r:
                    body = r.read()
                    status = r.status
                    if r.headers.get("Content-Encoding") == "gzip":
                        body = gzip.decompress(body)
                size = len(body)
                self.last_text = body.decode()
            except OSError as e:
                status = -1
                print(f"{self.name}: scrape failed: {e}", flush=True)
            row = {"t": start, "seconds": time.monotonic() - start, "status": status,
                   "phase": self.phase, "bytes": size, "cpu": cpu_seconds(self.pid)}
            if self.ages and status == 200:
                row["age"] = reading_age(self.last_text, wall)
                row["control_age"] = reading_age(self.last_text, wall, "control")
            self.results.append(row)
            tick += 1.0
            while tick <= time.monotonic():
                tick += 1.0
            self.stop_event.wait(tick - time.monotonic())


def reading_age(text: str, at: float, collector: str = "nvml") -> Optional[float]:
    """Seconds between the scrape (wall clock at its start) and the collector's reading it served."""
    taken = [v for labels, v in series(text, "mps_exporter_collector_last_success_timestamp_seconds")
             if labels.get("collector") == collector]
    return round(max(0.0, at - taken[0]), 4) if taken else None


def cpu_per_second(results: List[Dict[str, Any]], phases: Tuple[str, ...]) -> Optional[float]:
    """The process's CPU seconds per second of wall time over these phases' scrapes."""
    rows = [r for r in results if r["phase"] in phases]
    if len(rows) < 2:
        return None
    return round((rows[-1]["cpu"] - rows[0]["cpu"]) / (rows[-1]["t"] - rows[0]["t"]), 5)


def age_stats(results: List[Dict[str, Any]], phases: Tuple[str, ...], key: str = "age") -> Dict[str, Any]:
    ages = [r[key] for r in results if r["phase"] in phases and r.get(key) is not None]
    if not ages:
        return {}
    return {"scrapes": len(ages), "p50_seconds": round(percentile(ages, 50), 3),
            "p99_seconds": round(percentile(ages, 99), 3), "max_seconds": round(max(ages), 3)}


def memory_check(text: str, text2: str, apps: Dict[int, int], client_pids: set) -> Dict[str, Any]:
    """Every client's memory as the exporter served it against nvidia-smi (within 1 MiB)."""
    served = {int(l["pid"]): v for l, v in series(text, "mps_client_memory_used_bytes")}
    served2 = {int(l["pid"]): v for l, v in series(text2, "mps_client_memory_used_bytes")}
    mismatches = []
    for pid in sorted(client_pids):
        want = apps.get(pid)
        got = served.get(pid, served2.get(pid))
        if want is None or got is None or abs(got / MIB - want) > 1.0:
            mismatches.append({"pid": pid, "nvidia_smi_mib": want, "exporter_mib": None if got is None else got / MIB})
    return {"clients_compared": len(client_pids), "within_1_mib": len(client_pids) - len(mismatches),
            "exact": len(client_pids) - len(mismatches), "mismatches": mismatches}


def pause_check(exporter_pid: int, control_log: Path, pause_after: float, seconds: float) -> Dict[str, Any]:
    """Nobody scrapes: after --collector.pause-after the exporter sends no control command
    (control.log does not grow) and its CPU per second (issue 29, done-when 3)."""
    time.sleep(pause_after + 3.0)
    size0, cpu0, t0 = control_log.stat().st_size, cpu_seconds(exporter_pid), time.monotonic()
    time.sleep(seconds)
    size1, cpu1, t1 = control_log.stat().st_size, cpu_seconds(exporter_pid), time.monotonic()
    return {"pause_after_seconds": pause_after, "measured_seconds": round(t1 - t0, 2),
            "control_log_growth_bytes": size1 - size0,
            "cpu_ms_per_second": round(1000 * (cpu1 - cpu0) / (t1 - t0), 3)}


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1)))))]


def scrape_stats(results: List[Dict[str, Any]], phases: Tuple[str, ...]) -> Dict[str, Any]:
    rows = [r for r in results if r["phase"] in phases]
    secs = [r["seconds"] for r in rows]
    if not rows:
        return {}
    cpu = rows[-1]["cpu"] - rows[0]["cpu"]
    return {"scrapes": len(rows), "failed": sum(1 for r in rows if r["status"] != 200),
            "p50_seconds": round(percentile(secs, 50), 4), "p99_seconds": round(percentile(secs, 99), 4),
            "max_seconds": round(max(secs), 4),
            "cpu_seconds_per_scrape": round(cpu / max(1, len(rows) - 1), 5)}


def series(text: str, name: str) -> List[Tuple[Dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels_text, value = line[len(name) + 1:].rsplit("} ", 1)
            labels = dict(part.split("=", 1) for part in _split_labels(labels_text))
            out.append(({k: v.strip('"') for k, v in labels.items()}, float(value.split()[0])))
    return out


def _split_labels(text: str) -> List[str]:
    parts, cur, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + ([cur] if cur else [])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/mps-storm")
    ap.add_argument("--out", required=True)
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--busy", type=int, default=12)
    ap.add_argument("--idle-seconds", type=float, default=8)
    ap.add_argument("--settle-seconds", type=float, default=15)
    ap.add_argument("--max-storm-seconds", type=float, default=150)
    ap.add_argument("--name", default="h100-storm")
    ap.add_argument("--pause-after", type=float, default=10.0,
                    help="the exporter's --collector.pause-after; the pause check waits this long without scrapes")
    ap.add_argument("--pause-seconds", type=float, default=20.0, help="then measures this long (0: no pause check)")
    ap.add_argument("--exporter-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for mps-exporter serve (repeat: --exporter-arg=--collector.control-wait --exporter-arg=0.01)")
    ap.add_argument("--no-refresh-zero", dest="refresh_zero", action="store_false",
                    help="leave out the second mps-exporter (--collector.refresh-interval 0) scraped beside the first")
    args = ap.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    pipe, logs, clients_dir = work / "pipe", work / "log", work / "clients"
    for d in (pipe, logs, clients_dir, out):
        d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    procs: List[subprocess.Popen] = []
    report: Dict[str, Any] = {"name": args.name, "machine": "", "notes": []}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        report["machine"] = smi
        report["gpus"] = len(smi.splitlines())
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=env, check=True)
        calls_file = out / "calls.json"
        exporter = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "timed-serve", str(calls_file), "--", "serve",
             "--mps.pipe-directory", str(pipe), "--mps.log-directory", str(logs), "--no-collector.dcgm",
             "--web.listen-address", "127.0.0.1:10138", "--collector.pause-after", str(args.pause_after), *args.exporter_arg],
            env=env, stdout=open(out / "exporter.log", "w"), stderr=subprocess.STDOUT)
        procs.append(exporter)
        # The same exporter reading NVML in every scrape (as before issue 29), beside it.
        zero = start_refresh_zero(pipe, logs, env, out) if args.refresh_zero else None
        procs.extend([zero] if zero is not None else [])
        nvitop = subprocess.Popen(
            [sys.executable, "-c", "import sys; from nvitop_exporter.cli import main; sys.exit(main())",
             "--bind-address", "127.0.0.1", "--port", "10139", "--interval", "1.0"],
            env=env, stdout=open(out / "nvitop-exporter.log", "w"), stderr=subprocess.STDOUT)
        procs.append(nvitop)
        wait_http("http://127.0.0.1:10138/metrics", 60)
        wait_http("http://127.0.0.1:10139/metrics", 60)
        prometheus = {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip", "X-Prometheus-Scrape-Timeout-Seconds": "1"}
        ours = Scraper("mps-exporter", "http://127.0.0.1:10138/metrics", exporter.pid, prometheus, ages=True)
        theirs = Scraper("nvitop-exporter", "http://127.0.0.1:10139/metrics", nvitop.pid,
                         {"Accept-Encoding": "gzip"})
        scrapers = [ours, theirs]
        if zero is not None:
            wait_http("http://127.0.0.1:10140/metrics", 60)
            scrapers.append(Scraper("mps-exporter-refresh-0", "http://127.0.0.1:10140/metrics", zero.pid, prometheus,
                                    ages=True))
        for scraper in scrapers:
            scraper.start()
        time.sleep(args.idle_seconds)

        # The storm: every client at once.
        storm_start = time.monotonic()
        set_phase(scrapers, "storm")
        stop_file = clients_dir / "stop"
        clients = []
        for i in range(args.clients):
            busy = i < args.busy
            cmd = [sys.executable, str(HERE / "workloads" / "gpu_client.py"), "0.5" if busy else "0.25",
                   "--ready", str(clients_dir / f"ready-{i}"), "--stop", str(stop_file), "--max-seconds", "240",
                   "--n", "4096"] + ([] if busy else ["--idle"])
            clients.append(subprocess.Popen(cmd, env={**env, "TAG": f"c{i}"}, stdout=open(clients_dir / f"c{i}.out", "w"),
                                            stderr=subprocess.STDOUT))
        procs.extend(clients)
        ready_at = None
        while time.monotonic() - storm_start < args.max_storm_seconds:
            ready = sum(1 for i in range(args.clients) if (clients_dir / f"ready-{i}").exists())
            exited = [c for c in clients if c.poll() is not None]
            if ready + len(exited) >= args.clients:
                ready_at = time.monotonic()
                break
            time.sleep(0.5)
        report["clients"] = args.clients
        report["busy_clients"] = args.busy
        report["clients_ready"] = sum(1 for i in range(args.clients) if (clients_dir / f"ready-{i}").exists())
        report["clients_exited_early"] = [i for i, c in enumerate(clients) if c.poll() is not None]
        report["storm_seconds_until_all_ready"] = None if ready_at is None else round(ready_at - storm_start, 2)
        time.sleep(args.settle_seconds / 2)
        set_phase(scrapers, "settled")
        time.sleep(args.settle_seconds / 2)

        # Settled: every client's memory against nvidia-smi, from the same moment.
        mps_scrapers = [sc for sc in scrapers if sc.ages]
        texts = [sc.last_text for sc in mps_scrapers]
        smi_apps = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory",
                                   "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
        texts2 = [sc.last_text for sc in mps_scrapers]
        apps = {}
        for line in smi_apps.strip().splitlines():
            uuid, pid, used = [c.strip() for c in line.split(",")]
            if used.isdigit():
                apps[int(pid)] = int(used)
        client_pids = {c.pid for c in clients if c.poll() is None}
        checks = [memory_check(t1, t2, apps, client_pids) for t1, t2 in zip(texts, texts2)]
        report["memory_check"] = checks[0]
        if len(checks) > 1:
            report["memory_check_refresh_0"] = checks[1]
        for scraper in scrapers:
            scraper.stop_event.set()
        for scraper in scrapers:
            scraper.join(35)
        if args.pause_seconds > 0:  # the clients still hold their memory; nobody scrapes
            report["pause"] = pause_check(exporter.pid, logs / "control.log", args.pause_after, args.pause_seconds)
        stop_file.write_text("stop\n")
        for c in clients:
            try:
                c.wait(60)
            except subprocess.TimeoutExpired:
                c.kill()

        storm = ("storm", "settled")
        s_ours, s_theirs = scrape_stats(ours.results, storm), scrape_stats(theirs.results, storm)
        report.update({
            "scrape_timeout_header_seconds": 1.0,
            "scrape_p50_seconds": s_ours.get("p50_seconds"), "scrape_p99_seconds": s_ours.get("p99_seconds"),
            "scrape_max_seconds": s_ours.get("max_seconds"),
            "exporter_cpu_seconds_per_scrape": s_ours.get("cpu_seconds_per_scrape"),
            "mps_exporter": {"idle": scrape_stats(ours.results, ("idle",)), "storm": s_ours,
                             "storm_only": scrape_stats(ours.results, ("storm",))},
            "nvitop_exporter": {"idle": scrape_stats(theirs.results, ("idle",)), "storm": s_theirs,
                                "storm_only": scrape_stats(theirs.results, ("storm",))},
            "scrapes": {sc.name: sc.results for sc in scrapers},
            "storm_started_monotonic": storm_start,
        })
        report["side_by_side"] = side_by_side(scrapers)
    finally:
        exporters = 3 if args.refresh_zero else 2  # mps-exporter (and its refresh-0 twin), nvitop-exporter
        for p in procs[exporters:]:
            if p.poll() is None:
                p.kill()
        for p in procs[:exporters]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", env=env, text=True, timeout=30)
        (out / "storm-report.partial.json").write_text(json.dumps(report, indent=1, default=str))
    return finish(report, out)


def start_refresh_zero(pipe: Path, logs: Path, env: Dict[str, str], out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mps_exporter.cli", "serve", "--mps.pipe-directory", str(pipe),
         "--mps.log-directory", str(logs), "--no-collector.dcgm", "--web.listen-address", "127.0.0.1:10140",
         "--collector.refresh-interval", "0"],
        env=env, stdout=open(out / "exporter-refresh-0.log", "w"), stderr=subprocess.STDOUT)


def set_phase(scrapers: List[Scraper], phase: str) -> None:
    for scraper in scrapers:
        scraper.phase = phase


def side_by_side(scrapers: List[Scraper]) -> Dict[str, Any]:
    """Per exporter and phase: scrape p50/p99/max, CPU per second, ages of the NVML reading served."""
    out: Dict[str, Any] = {}
    for sc in scrapers:
        row: Dict[str, Any] = {}
        for label, phases in (("idle", ("idle",)), ("storm", ("storm",)), ("settled", ("settled",)),
                              ("storm+settled", ("storm", "settled"))):
            row[label] = {**scrape_stats(sc.results, phases), "cpu_seconds_per_second": cpu_per_second(sc.results, phases),
                          "nvml_age": age_stats(sc.results, phases),
                          "control_age": age_stats(sc.results, phases, "control_age")}
        out[sc.name] = row
    return out


def side_by_side_markdown(report: Dict[str, Any]) -> str:
    rows = ["| exporter | phase | scrapes | p50 ms | p99 ms | max ms | CPU ms per second | NVML age p50 / max s "
            "| control age p50 / max s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, phases in report.get("side_by_side", {}).items():
        for phase, st in phases.items():
            if not st.get("scrapes"):
                continue
            age = st.get("nvml_age") or {}
            control = st.get("control_age") or {}
            cpu = st.get("cpu_seconds_per_second")
            rows.append(f"| {name} | {phase} | {st['scrapes']} | {1000 * st['p50_seconds']:.1f} | "
                        f"{1000 * st['p99_seconds']:.1f} | {1000 * st['max_seconds']:.1f} | "
                        f"{'' if cpu is None else f'{1000 * cpu:.1f}'} | "
                        f"{age.get('p50_seconds', '')} / {age.get('max_seconds', '')} | "
                        f"{control.get('p50_seconds', '')} / {control.get('max_seconds', '')} |")
    return "\n".join(rows)


def finish(report: Dict[str, Any], out: Path) -> int:
    """Slow calls per GPU and function from the timed calls; the latency fixture."""
    doc = json.loads((out / "calls.json").read_text())
    start = report["storm_started_monotonic"]
    calls = [(t - start, gpu, fn, sec) for t, gpu, fn, sec in doc["calls"]]
    by_fn: Dict[Tuple[int, str], List[float]] = {}
    for t, gpu, fn, sec in calls:
        if t >= 0:
            by_fn.setdefault((gpu, fn), []).append(sec)
    slow = []
    for (gpu, fn), secs in sorted(by_fn.items(), key=lambda kv: -max(kv[1])):
        slow.append({"gpu": gpu, "function": fn, "calls": len(secs), "p50_seconds": round(statistics.median(secs), 6),
                     "p99_seconds": round(percentile(secs, 99), 6), "max_seconds": round(max(secs), 6),
                     "total_seconds": round(sum(secs), 4)})
    report["slow_calls"] = slow[:12]
    report["nvml_calls_during_storm"] = sum(len(v) for v in by_fn.values())
    fixture = {"description": "Every NVML call mps-exporter made from 10 s before to the end of a client storm "
                              "on one GPU (tests/gpu/storm.py): t seconds since the storm began, GPU index, "
                              "pynvml function, seconds the call took.",
               "machine": report.get("machine"), "clients": report.get("clients"),
               "busy_clients": report.get("busy_clients"),
               "calls": [[round(t, 4), gpu, fn, round(sec, 6)] for t, gpu, fn, sec in calls if t >= -10]}
    (out / "storm-nvml-latency.json").write_text(json.dumps(fixture, separators=(",", ":")))
    (out / "storm-report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "storm-report.md").write_text(
        f"# Client storm: {report.get('clients')} clients ({report.get('busy_clients')} busy) on {report.get('machine')}\n\n"
        + side_by_side_markdown(report) + "\n\n"
        + f"memory (refresh 1 s): {json.dumps({k: v for k, v in report.get('memory_check', {}).items() if k != 'mismatches'})}\n\n"
        + f"memory (refresh 0): {json.dumps({k: v for k, v in report.get('memory_check_refresh_0', {}).items() if k != 'mismatches'})}\n\n"
        + f"pause: {json.dumps(report.get('pause'))}\n")
    summary = {k: report.get(k) for k in ("gpus", "clients", "scrape_p50_seconds", "scrape_p99_seconds",
                                           "scrape_max_seconds", "exporter_cpu_seconds_per_scrape")}
    print(json.dumps(summary), flush=True)
    print(side_by_side_markdown(report), flush=True)
    print(json.dumps({"pause": report.get("pause")}), flush=True)
    print(json.dumps({"nvitop": report.get("nvitop_exporter", {}).get("storm"),
                      "memory": {k: v for k, v in report.get("memory_check", {}).items() if k != "mismatches"},
                      "slow": report["slow_calls"][:6]}, indent=None), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "timed-serve":
        rest = sys.argv[3:]
        sys.exit(timed_serve(rest[1:] if rest[:1] == ["--"] else rest, sys.argv[2]))
    sys.exit(main())
