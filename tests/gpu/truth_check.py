"""The truth check: the exporter against live MPS on a real GPU, every number
compared with its oracle while it happens.

    python3 tests/gpu/truth_check.py --work /tmp/tc --report-dir DIR [--title ...]

Needs root, NVIDIA GPUs, the MPS binaries, PyTorch and `mps_exporter`
importable (see run_device.sh). It starts its own MPS control daemon (pipe and
log directories under --work), the exporter pointed at it on a local port, and
CUDA clients (workloads/); it quits MPS at the end whatever failed. Phases:

  idle      daemon up, no server; scrape latency with 0 clients
  mixed     clients of 2, 8 and 1 GiB (spread over the GPUs); 3 busy clients
  many      32 clients at once; 30 busy clients
  queue     a uid-1500 client queued behind the root server, then admitted
  limits    daemon defaults, per-server limits, clients' own env limits,
            a client near its limit, clients over their limit
  fault     a client that hits a fatal GPU error beside a bystander
  quit      the daemon quits; the log counters against the whole logs
  discovery daemons in the device plugin's and DRA driver's layouts, found by a
            second exporter as they come and go (discovery_phase.py)
  remapped, percap, daemonpergpu, storm2   two or more GPUs (multi_gpu_phase.py)
  starts, cvdlimits, killdaemon, ceiling, procdisc   nodes with several GPUs; procdisc: any node (node_phases.py)
  oomlimit, oomfull, nearclean, xid        out of memory at a limit and on a full GPU, a
            normal exit near a limit, an Xid from a fatal error (oom_phase.py)

Each comparison goes into the report (name, expected, actual, passed); the
JSON and a Markdown summary are written to --report-dir.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import limits_truth  # noqa: E402  (issue 24's phases)
import multi_gpu_phase  # noqa: E402  (issue 30's phases: two or more GPUs)
import node_phases  # noqa: E402  (issue 38's phases: nodes with several GPUs)
import oom_phase  # noqa: E402  (issue 40's phases: out of memory and Xid)
import oracles  # noqa: E402
from oracles import MIB, Samples  # noqa: E402
from report import Report  # noqa: E402
from scrape import Exposition, scrape  # noqa: E402
from mps_exporter.logs.pipeline import LIVENESS_SECONDS  # noqa: E402  (how often queued clients are checked)

WORKLOADS = HERE / "workloads"
SECOND_UID = 1500
# --mps.facts-refresh of the exporter, its default: limits and defaults set mid-run must show
# up in the scrape after control.log's `Cmd:set_*` line, not this long after.
FACTS_REFRESH = 60.0
LOG_SETTLE = 1.0  # the log pipeline polls every 0.25 s; wait this long before comparing log numbers
GiB = 2**30


# ====================================================================== machine side
@dataclass
class Client:
    tag: str
    proc: subprocess.Popen
    ready: Path
    stop: Path
    output: Path
    device: int
    mem_gib: float
    env: Dict[str, str] = field(default_factory=dict)
    uid: int = 0
    grow: List[float] = field(default_factory=list)  # --grow steps (GiB held in all)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_ready(self) -> bool:
        return self.ready.exists() and self.ready.stat().st_size > 0

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def ready_fields(self) -> List[str]:
        """PID, time and SM count the client wrote when it was ready."""
        return self.ready.read_text().split() if self.is_ready() else []


class Session:
    def __init__(self, work: Path, gpus: int) -> None:
        self.work = work
        self.gpus = gpus
        self.pipe, self.logdir = work / "pipe", work / "log"
        self.ready_dir, self.out_dir, self.scripts = work / "ready", work / "clients", work / "workloads"
        for d in (self.pipe, self.logdir, self.ready_dir, self.out_dir):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o777)
        work.chmod(0o755)
        # The second user must read the scripts: copy them out of the (maybe private) checkout.
        shutil.copytree(WORKLOADS, self.scripts, dirs_exist_ok=True)
        for p in [self.scripts, *self.scripts.iterdir()]:
            p.chmod(0o755)
        self.env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(self.pipe), CUDA_MPS_LOG_DIRECTORY=str(self.logdir),
                        PYTHONUNBUFFERED="1")
        self.clients: List[Client] = []
        self.timeline: List[str] = []

    def mark(self, text: str) -> None:
        line = f"{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')[:-3]} {text}"
        self.timeline.append(line)
        print(f"### {line}", flush=True)

    # ------------------------------------------------------------- control
    def ctl(self, command: str, timeout: float = 10) -> str:
        r = subprocess.run(["nvidia-cuda-mps-control"], input=command + "\n", capture_output=True, text=True,
                           env=self.env, timeout=timeout)
        return r.stdout + r.stderr

    def servers(self) -> List[int]:
        return oracles.parse_pids(self.ctl("get_server_list"))

    def client_lists(self) -> Dict[int, List[int]]:
        return {s: oracles.parse_pids(self.ctl(f"get_client_list {s}")) for s in self.servers()}

    def start_daemon(self) -> str:
        r = subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, text=True, env=self.env, timeout=20)
        wait_for(lambda: (self.logdir / "control.log").exists(), 10)
        return r.stdout + r.stderr + f"rc={r.returncode}"

    def daemon_running(self) -> bool:
        """This session's control daemon runs (its CUDA_MPS_PIPE_DIRECTORY is ours): other
        daemons on the machine (churn.py's, a phase's) are not this one."""
        return bool(node_phases.control_daemon_pids(self.pipe))

    def quit(self) -> str:
        """`quit`; a daemon that does not answer it (one hung in phase queuedeath's run 1) is
        killed, with its servers: the report is written whatever MPS does."""
        if not self.daemon_running():
            return "(no daemon)"
        try:
            out = self.ctl("quit")
        except subprocess.TimeoutExpired:
            out = f"(no answer in 10 s: killed {self.kill_daemon()})"
        wait_for(lambda: not self.daemon_running(), 20)
        return out

    def kill_daemon(self) -> List[int]:
        """SIGKILL this session's MPS daemon and servers (their CUDA_MPS_PIPE_DIRECTORY is ours)."""
        mine = f"CUDA_MPS_PIPE_DIRECTORY={self.pipe}".encode()
        killed = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                proc = Path("/proc", entry)
                if b"nvidia-cuda-mps" in (proc / "cmdline").read_bytes() and \
                        mine in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry), signal.SIGKILL)
                    killed.append(int(entry))
            except (OSError, ProcessLookupError):
                continue
        return killed

    def shutdown_servers(self) -> None:
        for s in self.servers():
            self.ctl(f"shutdown_server {s}")
        wait_for(lambda: not self.servers(), 30)

    # -------------------------------------------------------------- clients
    def client(self, tag: str, mem_gib: float, device: int = 0, env: Optional[Dict[str, str]] = None,
               uid: int = 0, n: int = 2048, idle: bool = False, grow: Optional[List[float]] = None,
               mps: bool = True, extra: Optional[List[str]] = None) -> Client:
        """`extra`: more gpu_client.py options (--fill-self-mib, --exit-on-fail, ...)."""
        ready, stop, output = self.ready_dir / f"{tag}.ready", self.ready_dir / f"{tag}.stop", self.out_dir / f"{tag}.txt"
        for p in (ready, stop, *ready.parent.glob(f"{tag}.*.grow*")):
            p.unlink(missing_ok=True)
        argv = [sys.executable, str(self.scripts / "gpu_client.py"), str(mem_gib), "--ready", str(ready),
                "--stop", str(stop), "--device", str(device), "--n", str(n), "--max-seconds", "240"]
        if idle:
            argv.append("--idle")
        for gib in grow or []:
            argv += ["--grow", str(gib)]
        argv += extra or []
        if uid:
            argv = [sys.executable, str(self.scripts / "runas.py"), str(uid), *argv]
        base = self.env if mps else {k: v for k, v in self.env.items() if not k.startswith("CUDA_MPS_")}
        full_env = dict(base, TAG=tag, **(env or {}))
        with open(output, "w") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd="/tmp")
        c = Client(tag, proc, ready, stop, output, device, mem_gib, dict(env or {}), uid, list(grow or []))
        self.clients.append(c)
        return c

    def grow(self, c: Client, step: int, timeout: float = 60) -> str:
        """Tell client `c` to take its grow step `step`; its answer (OK or FAIL ...)."""
        result = Path(f"{c.ready}.grow{step}")
        result.unlink(missing_ok=True)
        Path(f"{c.stop}.grow{step}").touch()
        wait_for(lambda: result.exists() and result.stat().st_size > 0 or c.proc.poll() is not None, timeout)
        return result.read_text().strip() if result.exists() else f"no answer (exit {c.proc.poll()})"

    def run_script(self, tag: str, script: str, env: Optional[Dict[str, str]] = None) -> Client:
        output = self.out_dir / f"{tag}.txt"
        with open(output, "w") as f:
            proc = subprocess.Popen([sys.executable, str(self.scripts / script)], stdout=f, stderr=subprocess.STDOUT,
                                    env=dict(self.env, TAG=tag, **(env or {})), cwd="/tmp")
        c = Client(tag, proc, Path("/nonexistent"), Path("/nonexistent"), output, 0, 0.0)
        self.clients.append(c)
        return c

    def wait_ready(self, clients: List[Client], timeout: float) -> List[Client]:
        """Clients that neither said ready nor exited within `timeout`."""
        wait_for(lambda: all(c.is_ready() or c.proc.poll() is not None for c in clients), timeout)
        return [c for c in clients if not c.is_ready()]

    def stop(self, clients: List[Client], timeout: float = 60) -> None:
        for c in clients:
            c.stop.touch()
        deadline = time.time() + timeout
        for c in clients:
            try:
                c.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    def kill_all(self) -> None:
        for c in self.clients:
            if c.proc.poll() is None:
                c.proc.kill()
        for c in self.clients:
            try:
                c.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    # -------------------------------------------------------------- oracles
    def smi_gpus(self) -> List[oracles.SmiGpu]:
        return oracles.parse_smi_gpus(run(["nvidia-smi", "--query-gpu=index,uuid,memory.total,memory.used",
                                           "--format=csv,noheader,nounits"]))

    def smi_apps(self) -> Dict[tuple, int]:
        return oracles.parse_smi_apps(run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory",
                                           "--format=csv,noheader,nounits"]))

    def control_log(self) -> List[oracles.LogLine]:
        return oracles.parse_log(read(self.logdir / "control.log"))

    def server_log(self) -> List[oracles.LogLine]:
        return oracles.parse_log(read(self.logdir / "server.log"))


def events_only(lines: List[oracles.LogLine]) -> List[str]:
    """control.log lines outside command blocks (`NEW UI` ... `UI closed`): what the
    daemon did on its own, without the exporter's and this script's commands."""
    out, in_command = [], False
    for x in lines:
        if x.text.startswith("NEW UI"):
            in_command = True
        elif x.text.startswith("UI closed"):
            in_command = False
        elif not in_command:
            out.append(x.text)
    return out[:40]


def run(argv: List[str], timeout: float = 30) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout).stdout


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def processes():
    """(comm, cmdline) of every process, from /proc."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm = read(Path("/proc", entry, "comm")).strip()
                args = Path("/proc", entry, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            yield comm, args


def ps_uid_user(pid: int) -> tuple:
    """(uid, user) from the owner of /proc/PID and the passwd database: an oracle apart
    from the exporter's /proc/PID/status reader."""
    import pwd
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return ("", "")
    try:
        return (str(uid), pwd.getpwuid(uid).pw_name)
    except KeyError:
        return (str(uid), str(uid))


def cpu_seconds(pid: int) -> Dict[str, float]:
    """utime+stime of the process and of its reaped children (its control processes)."""
    fields = read(Path(f"/proc/{pid}/stat")).rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return {"self": (int(fields[11]) + int(fields[12])) / tick, "children": (int(fields[13]) + int(fields[14])) / tick}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ====================================================================== the check
class TruthCheck:
    def __init__(self, s: Session, report: Report) -> None:
        self.s, self.r = s, report
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.exporter: Optional[subprocess.Popen] = None
        self.raw = None  # rawcost.RawScrape, made once NVML is known to work
        self.perf: Dict[str, dict] = {}
        self.idle_cpu_rate: Dict[str, float] = {}
        self.refusal_clients = 52

    # ------------------------------------------------------------ helpers
    def phase(self, name: str) -> None:
        self.r.phase = name
        self.s.mark(f"phase {name}")

    def start_exporter(self) -> None:
        log = open(self.s.work / "exporter.log", "w")
        argv = [sys.executable, "-m", "mps_exporter.cli", "serve", "--mps.pipe-directory", str(self.s.pipe),
                "--mps.log-directory", str(self.s.logdir), "--web.listen-address", f"127.0.0.1:{self.port}",
                "--mps.facts-refresh", str(FACTS_REFRESH), "--log.level", "info",
                # Its own daemon only: the checks compare with that daemon's logs and lists, and
                # the node's other daemons (churn.py's in run_x2/x4.sh) are discovery's phases.
                "--no-mps.discover-processes"]
        env = {k: v for k, v in self.s.env.items() if not k.startswith("CUDA_MPS_")}
        self.exporter = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/tmp")

        def answers() -> bool:
            try:
                scrape(self.url, timeout=5)
                return True
            except OSError:
                return False
        if not wait_for(answers, 30, 0.2):
            raise RuntimeError("exporter did not answer: " + read(self.s.work / "exporter.log")[-2000:])

    def scrape(self) -> Exposition:
        """A scrape whose NVML and control readings were taken after this call began. The
        exporter reads NVML in the background (--collector.refresh-interval, 1 s) and,
        scraped often, may serve the control daemon's answer to the scrape before (not
        waited for while the daemon answers slowly); either is up to two intervals old.
        The comparisons that follow are with oracles read from now on, so the check waits
        (at most 5 s) for readings that young."""
        asked = time.time()
        while True:
            e = scrape(self.url)
            taken = [e.value("mps_exporter_collector_last_success_timestamp_seconds", collector=name)
                     for name in ("nvml", "control")]
            if all(t is None or t >= asked for t in taken) or time.time() > asked + 5:
                return e
            time.sleep(0.05)

    def stable_state(self, attempts: int = 4):
        """Oracles, a scrape, oracles again; retried until the oracles agree before and after."""
        for _ in range(attempts):
            before = (self.s.client_lists(), self.s.smi_apps(), self.s.smi_gpus())
            e = self.scrape()
            after = (self.s.client_lists(), self.s.smi_apps(), self.s.smi_gpus())
            same_gpu_mem = all(abs(a.memory_used_mib - b.memory_used_mib) <= 1 for a, b in zip(before[2], after[2]))
            if before[0] == after[0] and before[1] == after[1] and same_gpu_mem:
                return before[0], before[1], before[2], e, True
            time.sleep(1)
        return after[0], after[1], after[2], e, False

    # ----------------------------------------------- state comparisons
    def compare_state(self, label: str, expect_clients: List[Client] = ()) -> Exposition:
        lists, apps, gpus, e, stable = self.stable_state()
        r = self.r
        if not stable:
            r.facts.setdefault("unstable", []).append(label)
        servers = set(lists)
        clients = {c for cs in lists.values() for c in cs}
        r.check(f"{label}: server set = get_server_list", sorted(servers),
                sorted(int(p) for p in e.label_set("mps_server_info", "server_pid")))
        r.check(f"{label}: client set = union of get_client_list", sorted(clients),
                sorted(int(p) for p in e.label_set("mps_client_info", "pid")))
        if expect_clients:
            r.check_true(f"{label}: every launched client is listed by the daemon", sorted(c.pid for c in expect_clients),
                         sorted(clients), {c.pid for c in expect_clients} <= clients)
        r.check(f"{label}: mps_server_clients = len(get_client_list) per server",
                {str(s): len(cs) for s, cs in lists.items()},
                {x.labels["server_pid"]: int(x.value) for x in e.series("mps_server_clients")})
        owner = {str(c): str(s) for s, cs in lists.items() for c in cs}
        r.check(f"{label}: client -> server (mps_client_info server_pid)", owner,
                {x.labels["pid"]: x.labels["server_pid"] for x in e.series("mps_client_info")})
        status = {str(s): self.s.ctl(f"get_server_status {s}").strip() for s in servers}
        r.check(f"{label}: mps_server_status = get_server_status", status,
                {x.labels["server_pid"]: x.labels["status"] for x in e.series("mps_server_status")})
        # memory: clients and servers against nvidia-smi --query-compute-apps, by (GPU uuid, pid)
        exp_mem = {f"{pid}@{uuid[:12]}": mib for (uuid, pid), mib in apps.items() if pid in clients}
        act_mem = {f"{x.labels['pid']}@{x.labels['uuid'][:12]}": x.value / MIB
                   for x in e.series("mps_client_memory_used_bytes")}
        worst = max([abs(exp_mem[k] - act_mem.get(k, float("inf"))) for k in exp_mem] or [0.0])
        r.check_true(f"{label}: per-client memory = nvidia-smi compute-apps (within 1 MiB, {len(exp_mem)} clients)",
                     exp_mem, act_mem, set(exp_mem) == set(act_mem) and worst <= 1.0, note=f"largest difference {worst:.2f} MiB")
        exp_srv = {f"{pid}@{uuid[:12]}": mib for (uuid, pid), mib in apps.items() if pid in servers}
        act_srv = {f"{x.labels['server_pid']}@{x.labels['uuid'][:12]}": x.value / MIB
                   for x in e.series("mps_server_memory_used_bytes")}
        worst = max([abs(exp_srv[k] - act_srv.get(k, float("inf"))) for k in exp_srv] or [0.0])
        r.check_true(f"{label}: per-server memory = nvidia-smi compute-apps (within 1 MiB)", exp_srv, act_srv,
                     set(exp_srv) == set(act_srv) and worst <= 1.0, note=f"largest difference {worst:.2f} MiB")
        self.compare_gpus(label, e, gpus, apps)
        uids = {str(c): ps_uid_user(c)[0] for c in sorted(clients)}
        r.check(f"{label}: client uid = owner of /proc/PID", uids, {x.labels["pid"]: x.labels["uid"] for x in e.series("mps_client_info")})
        suids = {str(sv): ps_uid_user(sv)[0] for sv in sorted(servers)}
        r.check(f"{label}: server uid = owner of /proc/PID", suids,
                {x.labels["server_pid"]: x.labels["uid"] for x in e.series("mps_server_info")})
        return e

    def compare_gpus(self, label: str, e: Exposition, gpus: List[oracles.SmiGpu], apps: Dict[tuple, int]) -> None:
        r = self.r
        r.check(f"{label}: GPU set = nvidia-smi", sorted(g.uuid for g in gpus), sorted(e.label_set("mps_gpu_up", "uuid")))
        for g in gpus:
            lab = {"gpu": str(g.index), "uuid": g.uuid}
            r.check(f"{label}: GPU {g.index} memory total (MiB) = nvidia-smi", g.memory_total_mib,
                    _mib(e.value("mps_gpu_memory_total_bytes", **lab)), tolerance=1.0)
            r.check(f"{label}: GPU {g.index} memory used (MiB) = nvidia-smi", g.memory_used_mib,
                    _mib(e.value("mps_gpu_memory_used_bytes", **lab)), tolerance=1.0)
            r.check(f"{label}: GPU {g.index} compute processes = nvidia-smi compute-apps rows",
                    sum(1 for (uuid, _pid) in apps if uuid == g.uuid), e.value("mps_gpu_compute_processes", **lab))

    # ---------------------------------------------------------- performance
    def measure(self, level: str, rounds: int = 250) -> None:
        """Scrape latency against the raw cost of the same NVML and control calls, interleaved.

        At least 200 rounds: with fewer, the nearest-rank p99 is the single slowest sample."""
        if self.raw is None:
            import rawcost
            self.raw = rawcost.RawScrape(str(self.s.pipe), str(self.s.logdir), FACTS_REFRESH)
            self.raw.once()  # first read: GPM has no interval yet, version asked once
        scrapes, raws, raw_nvml, raw_ctl = Samples(), Samples(), Samples(), Samples()
        durations: Dict[str, Samples] = {}
        cpu0, t0 = cpu_seconds(self.exporter.pid), time.time()
        for _ in range(rounds):
            cost = self.raw.once()
            raws.add(cost["total"])
            raw_nvml.add(cost["nvml"])
            raw_ctl.add(cost["control"])
            e = scrape(self.url)  # as Prometheus scrapes: whatever reading is the latest
            scrapes.add(e.seconds)
            for x in e.series("mps_exporter_collector_duration_seconds"):
                durations.setdefault(x.labels["collector"], Samples()).add(x.value)
            time.sleep(0.02)
        cpu1, elapsed = cpu_seconds(self.exporter.pid), time.time() - t0
        background = self.idle_cpu_rate.get("self", 0.0) * elapsed
        result = {
            "rounds": rounds, "clients": len([c for c in self.s.clients if c.proc.poll() is None]),
            "scrape_p50_ms": 1e3 * scrapes.p(50), "scrape_p99_ms": 1e3 * scrapes.p(99),
            "raw_p50_ms": 1e3 * raws.p(50), "raw_p99_ms": 1e3 * raws.p(99),
            "raw_nvml_p50_ms": 1e3 * raw_nvml.p(50), "raw_control_p50_ms": 1e3 * raw_ctl.p(50),
            "raw_nvml_calls": cost["nvml_calls"], "raw_control_calls": cost["control_calls"],
            "cpu_ms_per_scrape": 1e3 * (cpu1["self"] - cpu0["self"]) / rounds,
            "cpu_ms_per_scrape_minus_idle": 1e3 * (cpu1["self"] - cpu0["self"] - background) / rounds,
            "children_cpu_ms_per_scrape": 1e3 * (cpu1["children"] - cpu0["children"]) / rounds,
            "collector_p50_ms": {k: 1e3 * v.p(50) for k, v in durations.items()},
        }
        result["ratio_p50"] = result["scrape_p50_ms"] / result["raw_p50_ms"]
        result["ratio_p99"] = result["scrape_p99_ms"] / result["raw_p99_ms"]
        goal = result["raw_p99_ms"] * 1.2 + 5
        self.perf[level] = result
        self.r.check_true(f"perf {level}: scrape p99 <= raw p99 x 1.2 + 5 ms", round(goal, 2),
                          round(result["scrape_p99_ms"], 2), result["scrape_p99_ms"] <= goal,
                          note=f"p50 {result['scrape_p50_ms']:.2f} ms vs raw {result['raw_p50_ms']:.2f} ms")

    def measure_idle_cpu(self, seconds: float = 4.0) -> None:
        c0 = cpu_seconds(self.exporter.pid)
        time.sleep(seconds)
        c1 = cpu_seconds(self.exporter.pid)
        self.idle_cpu_rate = {k: (c1[k] - c0[k]) / seconds for k in c0}
        self.r.facts["exporter_idle_cpu_seconds_per_second"] = self.idle_cpu_rate

    # ------------------------------------------------------------------ phases
    def phase_idle(self) -> None:
        self.phase("idle")
        s, r = self.s, self.r
        e = self.scrape()
        r.check("daemon up (get_server_list answers)", 1, e.value("mps_control_daemon_up", daemon="default"))
        r.check("idle: server set = get_server_list", s.servers(),
                sorted(int(p) for p in e.label_set("mps_server_info", "server_pid")))
        atp = s.ctl("get_default_active_thread_percentage")
        r.facts["reply get_default_active_thread_percentage (none set)"] = atp
        r.facts["reply get_default_device_pinned_mem_limit 0 (none set)"] = s.ctl("get_default_device_pinned_mem_limit 0")
        r.check("idle: mps_default_active_thread_ratio = get_default_active_thread_percentage / 100",
                float(atp.strip()) / 100, e.value("mps_default_active_thread_ratio", daemon="default"), tolerance=1e-9)
        r.check("idle: no default pinned limit series (none set)", [],
                [x.labels for x in e.series("mps_default_pinned_memory_limit_bytes")])
        r.check("idle: sharing mode idle on every GPU", {str(i): "idle" for i in range(s.gpus)},
                {x.labels["gpu"]: x.labels["mode"] for x in e.series("mps_gpu_sharing_mode")})
        self.compare_gpus("idle", e, s.smi_gpus(), s.smi_apps())
        version = run(["nvidia-cuda-mps-control", "-v"])
        r.facts["nvidia-cuda-mps-control -v"] = version
        r.check("idle: mps_control_daemon_info version = nvidia-cuda-mps-control -v", oracles_version(version),
                next(iter(e.label_set("mps_control_daemon_info", "version")), None))
        self.measure_idle_cpu()
        self.measure("0 clients")

    def phase_mixed(self) -> None:
        self.phase("mixed")
        s, r = self.s, self.r
        clients = [s.client("a", 2, device=0 % s.gpus), s.client("b", 8, device=1 % s.gpus),
                   s.client("c", 1, device=2 % s.gpus, n=4096)]
        late = s.wait_ready(clients, 90)
        r.check("mixed: clients ready", [], [c.tag for c in late])
        e = self.compare_state("mixed", clients)
        if s.gpus > 1:
            # per-GPU attribution: each client's memory only on the GPU it was placed on
            uuid_of = {g.index: g.uuid for g in s.smi_gpus()}
            r.check("mixed: per-GPU attribution of client memory = placement",
                    {str(c.pid): [uuid_of[c.device]] for c in clients},
                    {str(c.pid): sorted(x.labels["uuid"] for x in e.series("mps_client_memory_used_bytes", pid=str(c.pid)))
                     for c in clients})
        r.facts["NVML memory (v1, v2, nvidia-smi) and process lists (pid: MiB) per GPU, 3 clients"] = nvml_memory_views(s)
        modes = {x.labels["gpu"]: x.labels["mode"] for x in e.series("mps_gpu_sharing_mode")}
        r.check("mixed: sharing mode mps on GPUs with clients", {str(c.device): "mps" for c in clients},
                {k: v for k, v in modes.items() if k in {str(c.device) for c in clients}})
        for srv in s.servers():  # exact replies when no limit is set (for the report)
            r.facts["reply get_device_pinned_mem_limit <server> 0 (none set)"] = s.ctl(f"get_device_pinned_mem_limit {srv} 0")
            r.facts["reply get_active_thread_percentage <server> (none set)"] = s.ctl(f"get_active_thread_percentage {srv}")
            r.facts["reply get_server_status <server> (busy)"] = s.ctl(f"get_server_status {srv}")
            r.facts["reply ps (3 clients)"] = s.ctl("ps")
            r.check("mixed: no server pinned limit series (none set)", [],
                    [x.labels for x in e.series("mps_server_pinned_memory_limit_bytes")])
            r.check("mixed: client active thread ratio = server's get_active_thread_percentage / 100",
                    {str(c.pid): float(s.ctl(f"get_active_thread_percentage {srv}")) / 100 for c in clients},
                    {str(c.pid): e.value("mps_client_active_thread_ratio", pid=str(c.pid)) for c in clients})
        self.measure("3 busy clients")
        s.stop(clients)

    def phase_many(self, count: int = 32) -> None:
        self.phase("many")
        s, r = self.s, self.r
        clients = [s.client(f"m{i}", 0.25, device=i % s.gpus, n=1024) for i in range(count)]
        late = s.wait_ready(clients, 150)
        r.check(f"many: {count} clients ready", [], [c.tag for c in late])
        e = self.compare_state(f"many ({count})", clients)
        r.check(f"many: mps_server_clients sum = {count} launched", count,
                sum(x.value for x in e.series("mps_server_clients")))
        self.measure("30 busy clients", rounds=200)
        s.stop(clients)

    def queue_behind_root(self, phase: str, tag: str) -> Tuple[Client, Client, Exposition]:
        """A uid 0 client holding its server, then a uid 1500 client pushed to the pending
        list behind it (checked in control.log); a scrape 2 s later."""
        s = self.s
        first = s.client(f"{tag}_root", 0.5)
        s.wait_ready([first], 60)
        second = s.client(f"{tag}_user", 0.5, uid=SECOND_UID)
        pushed = wait_for(lambda: any(w.client_pid == second.pid for w in oracles.queue_waits(s.control_log())), 60)
        self.r.check(f"{phase}: uid 1500 client pushed to the pending list (control.log)", True, pushed)
        time.sleep(2.0)
        return first, second, self.scrape()

    def phase_queue(self) -> None:
        self.phase("queue")
        s, r = self.s, self.r
        e0 = self.scrape()
        h0 = (e0.value("mps_client_queue_wait_seconds_count", reason="user_switch") or 0,
              e0.value("mps_client_queue_wait_seconds_sum", reason="user_switch") or 0)
        handoffs0 = e0.value("mps_server_handoffs_total") or 0
        first, second, e = self.queue_behind_root("queue", "q")
        waits = oracles.queue_waits(s.control_log())
        pending = [w for w in waits if w.admitted is None]
        r.check("queue: mps_queued_clients{user_switch} = pending user-switch pushes in control.log",
                sum(1 for w in pending if w.user_switch), e.value("mps_queued_clients", reason="user_switch"))
        r.check("queue: mps_queued_clients{server_starting} = pending same-user pushes in control.log",
                sum(1 for w in pending if not w.user_switch), e.value("mps_queued_clients", reason="server_starting"))
        oldest = max((e.at - w.pushed.timestamp() for w in pending), default=0.0)
        r.check("queue: oldest wait = scrape time - push time in control.log (within 1 s)", round(oldest, 3),
                e.value("mps_queued_client_oldest_wait_seconds"), tolerance=1.0)
        listed = {c for cs in s.client_lists().values() for c in cs}
        r.check("queue: the queued client is in no get_client_list and no mps_client_info", [False, False],
                [second.pid in listed, str(second.pid) in e.label_set("mps_client_info", "pid")])
        s.stop([first])
        s.wait_ready([second], 60)
        time.sleep(LOG_SETTLE + 0.5)
        e2 = self.scrape()
        mine = [w for w in oracles.queue_waits(s.control_log()) if w.client_pid == second.pid]
        wait_s = mine[0].seconds if mine and mine[0].seconds is not None else None
        r.facts["queue wait of the uid 1500 client, control.log (s)"] = wait_s
        r.check("queue: histogram count delta {user_switch} = 1 admission", 1,
                (e2.value("mps_client_queue_wait_seconds_count", reason="user_switch") or 0) - h0[0])
        r.check("queue: histogram sum delta {user_switch} = wait from control.log timestamps (within 2 ms)",
                wait_s, (e2.value("mps_client_queue_wait_seconds_sum", reason="user_switch") or 0) - h0[1],
                tolerance=0.002)
        attempts = oracles.count_text(s.control_log(), r"^Try shutting down server \d+, backoff is disabled")
        r.facts["daemon-initiated shutdowns (backoff is disabled lines) so far"] = attempts
        r.check("queue: handoffs delta = 1 (root server drained for uid 1500)", 1,
                (e2.value("mps_server_handoffs_total") or 0) - handoffs0)
        r.check("queue: deferrals = 'Server will not shutdown' lines in control.log",
                oracles.count_text(s.control_log(), r"Server will not shutdown"),
                e2.value("mps_server_shutdown_deferrals_total"))
        e3 = self.compare_state("queue (uid 1500 admitted)", [second])
        uid, user = ps_uid_user(second.pid)
        r.check("queue: client user label = passwd name of the /proc/PID owner", user,
                next(iter(e3.label_set("mps_client_info", "user", pid=str(second.pid))), None))
        s.stop([second])

    def phase_queuedeath(self) -> None:
        """A client queued behind another user's server is killed while it waits (a job
        cancelled in the queue): it must stop counting as queued within seconds, or the
        queueing alert pages until the other user's server drains. Then the other user's
        client leaves: run 1 saw MPS start the dead client's user's server, hand it the dead
        connection (`User did not send valid credentials`) and stop answering."""
        self.phase("queuedeath")
        s, r = self.s, self.r
        first, second, e = self.queue_behind_root("queuedeath", "qd")
        r.check("queuedeath: the waiting client counts as queued", 1, e.value("mps_queued_clients", reason="user_switch"))
        control0, server0 = len(s.control_log()), len(s.server_log())
        second.proc.kill()
        second.proc.wait()
        time.sleep(LIVENESS_SECONDS + LOG_SETTLE)
        e2 = self.scrape()
        r.check(f"queuedeath: the killed client no longer counts as queued {LIVENESS_SECONDS + LOG_SETTLE:g} s later "
                "(queued, oldest wait)", [0, 0],
                [e2.value("mps_queued_clients", reason="user_switch"), e2.value("mps_queued_client_oldest_wait_seconds")])
        r.facts["queuedeath: control.log after the kill (commands left out)"] = events_only(s.control_log()[control0:])
        control1 = len(s.control_log())
        s.stop([first])
        # uid 0's server drains with backoff (up to 6.4 s between tries); then MPS starts uid 1500's.
        started = wait_for(lambda: oracles.count_text(s.control_log()[control1:], r"^Starting new server \d+ for user 1500")
                           > 0, 30)
        r.facts["queuedeath: MPS started a server for the dead client's user"] = started
        time.sleep(LOG_SETTLE + 1)
        refused = oracles.count_text(s.server_log()[server0:], r"^User did not send valid credentials")
        r.facts["queuedeath: control.log after the blocking client left (commands left out)"] = \
            events_only(s.control_log()[control1:])
        r.facts["queuedeath: server.log after the kill"] = [x.text for x in s.server_log()[server0:]][:40]
        e3 = self.scrape()
        r.check("queuedeath: mps_client_rejections_total{invalid_credentials} = 'User did not send valid "
                "credentials' lines in server.log", refused,
                e3.value("mps_client_rejections_total", reason="invalid_credentials") or 0)
        r.check("queuedeath: nothing queued after the handoff", 0, e3.value("mps_queued_clients", reason="user_switch"))
        try:
            s.ctl("get_server_list", timeout=5)
            answers = True
        except subprocess.TimeoutExpired:
            answers = False
        r.facts["queuedeath: the control daemon answers get_server_list afterwards"] = answers
        if answers:
            s.shutdown_servers()
            return
        time.sleep(3.0)  # the exporter's --mps.command-timeout is 2 s
        e4 = self.scrape()
        r.check("queuedeath: a daemon that stopped answering is reported (mps_control_daemon_up, collector control)",
                [0, 0], [e4.value("mps_control_daemon_up"),
                         e4.value("mps_exporter_collector_success", collector="control")])
        r.facts["queuedeath: hung daemon and servers killed (pids), then a new daemon"] = [s.kill_daemon(),
                                                                                           s.start_daemon()]

    def phase_limits(self) -> None:
        self.phase("limits")
        s, r = self.s, self.r
        s.shutdown_servers()
        default_limit = {0: "4G", 1: "6G"}
        for dev in range(s.gpus):
            r.facts[f"reply set_default_device_pinned_mem_limit {dev} {default_limit[dev]}"] = \
                s.ctl(f"set_default_device_pinned_mem_limit {dev} {default_limit[dev]}")
        r.facts["reply set_default_active_thread_percentage 50"] = s.ctl("set_default_active_thread_percentage 50")
        time.sleep(LOG_SETTLE)  # the Cmd:set_* lines, not the refresh interval, make them re-read
        plain = s.client("l_plain", 1)
        own = s.client("l_env", 1.5, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
                                          "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3G"})
        near = s.client("l_near", 1.25, env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"})
        over_env = s.client("l_over_env", 2, env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G"})
        over_default = s.client("l_over_default", 5)
        running = [plain, own, near]
        s.wait_ready(running, 90)
        for c in (over_env, over_default):
            try:
                c.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        e = self.compare_state("limits", [c for c in running if c.is_ready()])
        dflt_atp = s.ctl("get_default_active_thread_percentage")
        r.check("limits: mps_default_active_thread_ratio = get_default_active_thread_percentage / 100",
                float(dflt_atp) / 100, e.value("mps_default_active_thread_ratio"), tolerance=1e-9)
        for dev in range(s.gpus):
            text = s.ctl(f"get_default_device_pinned_mem_limit {dev}")
            r.facts[f"reply get_default_device_pinned_mem_limit {dev} (set)"] = text
            r.check(f"limits: mps_default_pinned_memory_limit_bytes{{gpu={dev}}} = get_default_device_pinned_mem_limit",
                    oracles.parse_size_text(text), e.value("mps_default_pinned_memory_limit_bytes", gpu=str(dev)))
        servers = s.servers()
        server_limit, server_atp = {}, {}
        for srv in servers:
            atp_text = s.ctl(f"get_active_thread_percentage {srv}")
            r.facts["reply get_active_thread_percentage <server> (default 50 set)"] = atp_text
            server_atp[srv] = float(atp_text)
            r.check("limits: mps_server_active_thread_ratio = get_active_thread_percentage <server> / 100",
                    server_atp[srv] / 100, e.value("mps_server_active_thread_ratio", server_pid=str(srv)), tolerance=1e-9)
            for dev in range(s.gpus):
                text = s.ctl(f"get_device_pinned_mem_limit {srv} {dev}")
                r.facts[f"reply get_device_pinned_mem_limit <server> {dev} (default set)"] = text
                server_limit[(srv, dev)] = oracles.parse_size_text(text)
                r.check(f"limits: mps_server_pinned_memory_limit_bytes{{gpu={dev}}} = get_device_pinned_mem_limit <server> {dev}",
                        server_limit[(srv, dev)],
                        e.value("mps_server_pinned_memory_limit_bytes", server_pid=str(srv), gpu=str(dev)))
        owner = {c: srv for srv, cs in s.client_lists().items() for c in cs}
        exp_pinned, act_pinned, exp_atp, act_atp = {}, {}, {}, {}
        for c in running:
            srv = owner.get(c.pid)
            env_limit = oracles.env_pinned_limit(c.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""), 0)
            exp_pinned[c.tag] = env_limit if env_limit is not None else server_limit.get((srv, 0))
            act_pinned[c.tag] = e.value("mps_client_pinned_memory_limit_bytes", pid=str(c.pid), gpu="0")
            own_atp = c.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            candidates = [v for v in (float(own_atp) if own_atp else None, server_atp.get(srv)) if v is not None]
            exp_atp[c.tag] = min(candidates) / 100 if candidates else None
            act_atp[c.tag] = e.value("mps_client_active_thread_ratio", pid=str(c.pid))
        r.check("limits: effective pinned limit per client = own env, else server's", exp_pinned, act_pinned)
        r.check("limits: pinned limit series only on the GPU each client runs on (nvidia-smi)",
                {c.tag: sorted(str(g.index) for g in s.smi_gpus() for (uuid, pid) in s.smi_apps()
                               if pid == c.pid and uuid == g.uuid) for c in running},
                {c.tag: sorted(e.label_set("mps_client_pinned_memory_limit_bytes", "gpu", pid=str(c.pid))) for c in running})
        r.check("limits: effective active thread ratio = min(own env, server's) / 100", exp_atp, act_atp)
        used = e.value("mps_client_memory_used_bytes", pid=str(near.pid), gpu="0")
        r.check_true("limits: client near its 2 GiB limit stays under it (exporter memory <= exporter limit)",
                     act_pinned.get("l_near"), used, used is not None and act_pinned.get("l_near") is not None
                     and used <= act_pinned["l_near"], note=f"used {_mib(used)} MiB")
        for c, why in ((over_env, "own env limit 0=1G, asks 2 GiB"), (over_default, "server limit 4G, asks 5 GiB")):
            text = c.text()
            r.facts[f"output of {c.tag} ({why})"] = text.strip()[:600]
            r.check(f"limits: client over its limit is refused ({why})", [3, True],
                    [c.proc.returncode, "ALLOC_FAIL" in text])
        s.stop(running)
        s.shutdown_servers()
        for dev in range(s.gpus):
            s.ctl(f"set_default_device_pinned_mem_limit {dev} 0")
        s.ctl("set_default_active_thread_percentage 100")

    def phase_fault(self) -> None:
        """A device-side assert (fault.py), then a fatal GPU error (fatal.py), beside a bystander."""
        self.phase("fault")
        s, r = self.s, self.r
        bystander = s.client("f_bystander", 1)
        s.wait_ready([bystander], 60)
        for tag, script, fatal in (("f_assert", "fault.py", False), ("f_fatal", "fatal.py", True)):
            time.sleep(LOG_SETTLE)
            f0 = self.scrape().value("mps_fatal_gpu_errors_total") or 0
            reports0 = oracles.fatal_error_reports(s.server_log())
            lines0 = len(s.server_log())
            client = s.run_script(tag, script)
            seen_ctl, seen_exp = self.watch_status(client)
            r.facts[f"{tag}: get_server_status while it ran (distinct replies, in order)"] = _distinct(seen_ctl)
            r.facts[f"{tag}: mps_server_status while it ran (distinct, in order)"] = _distinct(seen_exp)
            r.facts[f"{tag}: output of {script}"] = client.text().strip()[:600]
            time.sleep(LOG_SETTLE)
            e = self.scrape()
            r.facts[f"{tag}: server.log lines"] = [f"{x.time:%H:%M:%S.%f} {x.text}" for x in s.server_log()[lines0:]][:40]
            reports = oracles.fatal_error_reports(s.server_log()) - reports0
            what = "fatal GPU error (illegal address)" if fatal else "device-side assert"
            r.check(f"fault: {what}: fatal error reports in server.log", 1 if fatal else 0, reports,
                    note="MPS logs a device-side assert as 'Worker is in reset', not as a fatal GPU error")
            r.check(f"fault: {what}: mps_fatal_gpu_errors_total delta = fatal error reports in server.log", reports,
                    (e.value("mps_fatal_gpu_errors_total") or 0) - f0)
            ctl_states, exp_states = {x.partition(" ")[2] for x in seen_ctl}, {x.partition(" ")[2] for x in seen_exp}
            r.check_true(f"fault: {what}: every state get_server_status gave also appeared in mps_server_status",
                         sorted(ctl_states), sorted(exp_states), ctl_states <= exp_states,
                         note="both polled every ~0.1 s while the client ran")
        s.stop([bystander])
        r.facts["output of f_bystander"] = bystander.text().strip()[:600]

    # ------------------------------------------------- MPS at its edges (issue 11)
    def phase_refusals(self) -> None:
        """More clients on one GPU than MPS accepts (48 on an H100 with MPS 13000): the
        rest hang about 28 s and fail with cudaErrorDevicesUnavailable; server.log has
        one 'Failed to accept new client' line per refusal."""
        self.phase("refusals")
        s, r = self.s, self.r
        count = self.refusal_clients
        e0 = self.scrape()
        rej0 = e0.value("mps_client_rejections_total", reason="client_limit") or 0
        lines0 = len(oracles.client_refusals(s.server_log()))
        started = time.time()
        clients = [s.client(f"r{i}", 0, device=0, n=64, idle=True) for i in range(count)]
        s.wait_ready(clients, 240)  # the refused ones exit after ~28 s; the rest say ready
        refused = [c for c in clients if not c.is_ready()]
        for c in refused:
            try:
                c.proc.wait(max(1, 150 - (time.time() - started)))
            except subprocess.TimeoutExpired:
                pass
        time.sleep(LOG_SETTLE)
        lists = s.client_lists()
        e = self.scrape()
        limits = oracles.client_refusals(s.server_log())[lines0:]
        accepted = sum(len(cs) for cs in lists.values())
        failed = [c for c in refused if c.proc.poll() is not None]
        r.facts["refusals: client outputs of the refused (first 2)"] = [c.text().strip()[-400:] for c in refused[:2]]
        r.facts["refusals: refused clients' seconds from start to exit"] = sorted(
            round(c.output.stat().st_mtime - started, 1) for c in failed)
        r.facts["refusals: server.log refusal lines"] = [f"{x.time:%H:%M:%S.%f} {x.text}" for x in s.server_log()
                                                         if x.text.startswith("Failed to accept")][:10]
        r.check(f"refusals: {count} launched = accepted (get_client_list) + refused", count, accepted + len(refused))
        r.check("refusals: every refused client failed with 'busy or unavailable' (cudaErrorDevicesUnavailable)",
                len(refused), sum(1 for c in failed if "busy or unavailable" in c.text()))
        r.check("refusals: refusal lines in server.log = refused clients", len(refused), len(limits))
        r.check("refusals: mps_client_rejections_total{client_limit} delta = refusal lines in server.log", len(limits),
                (e.value("mps_client_rejections_total", reason="client_limit") or 0) - rej0)
        r.check("refusals: mps_server_client_limit = the number the refusal line gives", limits[-1] if limits else None,
                e.value("mps_server_client_limit"))
        r.check("refusals: mps_server_client_limit = clients accepted by the server", accepted,
                e.value("mps_server_client_limit"))
        r.check("refusals: mps_server_clients = len(get_client_list)", {str(k): len(v) for k, v in lists.items()},
                {x.labels["server_pid"]: int(x.value) for x in e.series("mps_server_clients")})
        s.stop(clients)
        s.shutdown_servers()

    def phase_limitchange(self) -> None:
        """A server limit changed under a connected client D, then a client E connects;
        both try to grow past the new limit. MPS binds each client to the limits in force
        when it connected: the exporter's limit of each must be the one MPS enforced."""
        self.phase("limitchange")
        s, r = self.s, self.r
        s.ctl("set_default_device_pinned_mem_limit 0 8G")  # D's server starts with 8G, D gets 8G
        d = s.client("lc_D", 1, idle=True, grow=[3.5, 8.5])
        s.wait_ready([d], 60)
        (srv,) = s.servers()
        before = (s.ctl(f"get_device_pinned_mem_limit {srv} 0").strip(), s.ctl(f"get_active_thread_percentage {srv}").strip())
        r.facts["limitchange: server limits when D connected (get_device_pinned_mem_limit, get_active_thread_percentage)"] = before
        r.facts["limitchange: set replies"] = [s.ctl(f"set_device_pinned_mem_limit {srv} 0 3G"),
                                               s.ctl(f"set_active_thread_percentage {srv} 30")]
        after = (s.ctl(f"get_device_pinned_mem_limit {srv} 0").strip(), s.ctl(f"get_active_thread_percentage {srv}").strip())
        r.facts["limitchange: server limits after the change"] = after
        time.sleep(LOG_SETTLE)
        e_set = self.scrape()  # the server appeared seconds ago: its limits are cached for FACTS_REFRESH
        r.check("limitchange: the scrape after the Cmd:set_* lines shows the server's new limits (not "
                f"--mps.facts-refresh {FACTS_REFRESH:g} s later)",
                [oracles.parse_size_text(after[0]), float(after[1]) / 100],
                [e_set.value("mps_server_pinned_memory_limit_bytes", server_pid=str(srv), gpu="0"),
                 e_set.value("mps_server_active_thread_ratio", server_pid=str(srv))])
        e_client = s.client("lc_E", 1, idle=True, grow=[2.0, 3.5])
        s.wait_ready([e_client], 60)
        grown = {}
        for c in (d, e_client):
            for i, gib in enumerate(c.grow):
                grown[(c.tag, gib)] = s.grow(c, i)
        r.facts["limitchange: grow results"] = {f"{tag} to {gib} GiB": res for (tag, gib), res in grown.items()}
        r.facts["limitchange: SM count each client's CUDA reports (D, E)"] = [d.ready_fields()[2:], e_client.ready_fields()[2:]]
        time.sleep(LOG_SETTLE)
        e = self.scrape()
        enforced = {}
        for c in (d, e_client):
            ok = [g for g in c.grow if grown[(c.tag, g)] == "OK"]
            fail = [g for g in c.grow if grown[(c.tag, g)].startswith("FAIL")]
            enforced[c.tag] = (max(ok, default=c.mem_gib), min(fail, default=None))
        r.check("limitchange: MPS let D (connected before the change) grow to 3.5 GiB, not to 8.5", ["OK", False],
                [grown[("lc_D", 3.5)], grown[("lc_D", 8.5)] == "OK"])
        r.check("limitchange: MPS let E (connected after the change) grow to 2 GiB, not to 3.5", ["OK", False],
                [grown[("lc_E", 2.0)], grown[("lc_E", 3.5)] == "OK"])
        for c, want in ((d, oracles.parse_size_text(before[0])), (e_client, oracles.parse_size_text(after[0]))):
            got = e.value("mps_client_pinned_memory_limit_bytes", pid=str(c.pid), gpu="0")
            low, high = enforced[c.tag]
            r.check(f"limitchange: {c.tag}: mps_client_pinned_memory_limit_bytes = server limit when it connected", want, got)
            r.check_true(f"limitchange: {c.tag}: exporter limit within what MPS enforced (grew to {low} GiB, not to {high})",
                         [low, high], None if got is None else got / GiB,
                         got is not None and low * GiB <= got and (high is None or got < high * GiB))
        r.check("limitchange: mps_client_active_thread_ratio = server percentage when each connected",
                {"lc_D": float(before[1]) / 100, "lc_E": float(after[1]) / 100},
                {c.tag: e.value("mps_client_active_thread_ratio", pid=str(c.pid)) for c in (d, e_client)})
        r.check("limitchange: mps_server_pinned_memory_limit_bytes = get_device_pinned_mem_limit now",
                oracles.parse_size_text(after[0]), e.value("mps_server_pinned_memory_limit_bytes", server_pid=str(srv), gpu="0"))
        r.check("limitchange: mps_server_active_thread_ratio = get_active_thread_percentage now",
                float(after[1]) / 100, e.value("mps_server_active_thread_ratio", server_pid=str(srv)), tolerance=1e-9)
        r.facts["limitchange: server.log after the change"] = [
            f"{x.time:%H:%M:%S.%f} {x.text}" for x in s.server_log() if x.pid == srv][-30:]
        s.stop([d, e_client])
        s.shutdown_servers()
        s.ctl("set_default_device_pinned_mem_limit 0 0")

    def phase_kill(self) -> None:
        """A server SIGKILLed under a connected client (control.log still says 'exited with
        status 0'), then a server that exits cleanly after its client left."""
        self.phase("kill")
        s, r = self.s, self.r
        time.sleep(LOG_SETTLE)  # the baseline must include the last phase's exits (run 1 took it too early)
        e0 = self.scrape()
        w0 = e0.value("mps_server_exits_with_clients_total") or 0
        x0 = {x.labels["status"]: x.value for x in e0.series("mps_server_exits_total")}
        logged0 = oracles.server_exit_statuses(s.control_log())
        victim = s.client("k_victim", 1)
        s.wait_ready([victim], 60)
        (srv,) = s.servers()
        attached = s.client_lists().get(srv, [])
        os.kill(srv, 9)
        try:
            victim.proc.wait(60)
        except subprocess.TimeoutExpired:
            victim.proc.kill()
        wait_for(lambda: any(f"Server {srv} exited" in x.text for x in s.control_log()), 20)
        clean = s.client("k_clean", 0.5)
        s.wait_ready([clean], 60)
        s.stop([clean])
        s.shutdown_servers()
        time.sleep(LOG_SETTLE)
        e = self.scrape()
        r.facts["kill: output of the client whose server was killed"] = victim.text().strip()[-600:]
        r.facts["kill: control.log lines of the killed server"] = [x.text for x in s.control_log() if f" {srv} " in f" {x.text} "]
        r.check("kill: the client was connected when its server was killed (get_client_list)", [victim.pid], attached)
        r.check("kill: the client failed (exit status not 0)", True, victim.proc.returncode not in (0, None))
        with_clients = oracles.exits_with_clients(s.control_log(), s.server_log())
        r.check("kill: servers that exited with clients in the logs (oracle) = the killed one", True, srv in with_clients)
        r.check("kill: mps_server_exits_with_clients_total delta = 1 (killed), 0 for the clean exit", 1,
                (e.value("mps_server_exits_with_clients_total") or 0) - w0)
        exits = {x.labels["status"]: x.value - x0.get(x.labels["status"], 0) for x in e.series("mps_server_exits_total")}
        logged = {k: n - logged0.get(k, 0) for k, n in oracles.server_exit_statuses(s.control_log()).items()}
        r.check("kill: mps_server_exits_total delta by status = 'exited with status' lines in control.log (2 exits)",
                {k: n for k, n in logged.items() if n}, {k: int(v) for k, v in exits.items() if v})

    def watch_status(self, client: Client, min_samples: int = 30, timeout: float = 45):
        """get_server_status of every server and mps_server_status, polled while `client` runs."""
        seen_ctl, seen_exp = [], []
        deadline = time.time() + timeout
        while time.time() < deadline and (client.proc.poll() is None or len(seen_exp) < min_samples):
            for srv in self.s.servers():
                seen_ctl.append(f"{srv} {self.s.ctl(f'get_server_status {srv}').strip()}")
            seen_exp += [f"{x.labels['server_pid']} {x.labels['status']}" for x in self.scrape().series("mps_server_status")]
            time.sleep(0.1)
        return seen_ctl, seen_exp

    def phase_discovery(self) -> None:
        self.phase("discovery")
        import discovery_phase
        discovery_phase.run(self, free_port())

    def phase_quit(self) -> None:
        self.phase("quit")
        s, r = self.s, self.r
        r.facts["reply quit"] = s.quit()
        time.sleep(LOG_SETTLE + 0.5)
        e = self.scrape()
        r.check("quit: mps_control_daemon_up = 0 (no control daemon process)", 0 if not s.daemon_running() else 1,
                e.value("mps_control_daemon_up"))
        r.check("quit: no server series", [], sorted(e.label_set("mps_server_info", "server_pid")))
        r.check("quit: no client series", [], sorted(e.label_set("mps_client_info", "pid")))
        ctl_log, srv_log = s.control_log(), s.server_log()
        r.check("logs: mps_server_starts_total = 'NEW SERVER N: Ready' lines",
                oracles.count_text(ctl_log, r"^NEW SERVER \d+: Ready"), e.value("mps_server_starts_total"))
        r.check("logs: mps_server_exits_total by status = 'Server N exited with status S' lines",
                oracles.server_exit_statuses(ctl_log),
                {x.labels["status"]: int(x.value) for x in e.series("mps_server_exits_total")})
        r.check("logs: mps_client_connections_total = distinct client PIDs connected in server.log",
                len(oracles.connected_client_pids(srv_log)), e.value("mps_client_connections_total"))
        r.check("logs: mps_fatal_gpu_errors_total = fatal error reports in server.log",
                oracles.fatal_error_reports(srv_log), e.value("mps_fatal_gpu_errors_total"))
        r.check("logs: mps_control_commands_total by verb = 'Cmd:' lines", oracles.command_counts(ctl_log),
                {x.labels["command"]: int(x.value) for x in e.series("mps_control_commands_total")})
        for f in ("control", "server"):
            lines = read(s.logdir / f"{f}.log").count("\n")
            r.check(f"logs: mps_log_lines_total{{file={f}}} = lines in {f}.log", lines,
                    e.value("mps_log_lines_total", file=f))
        r.check("logs: mps_client_rejections_total{client_limit} = refusal lines in server.log",
                len(oracles.client_refusals(srv_log)), e.value("mps_client_rejections_total", reason="client_limit"))
        r.check("logs: mps_server_exits_with_clients_total = exits with a client connected (both logs merged by time)",
                len(oracles.exits_with_clients(ctl_log, srv_log)), e.value("mps_server_exits_with_clients_total"))
        r.check("logs: no unrecognized lines", {"control": 0, "server": 0},
                {x.labels["file"]: int(x.value) for x in e.series("mps_log_unrecognized_lines_total")})
        r.facts["mps_server_start_failures_total"] = e.value("mps_server_start_failures_total")

    # ---------------------------------------------------------------- run
    def run(self, phases: List[str]) -> None:
        s = self.s
        s.mark("start")
        self.r.facts["nvidia-smi -L"] = run(["nvidia-smi", "-L"])
        self.r.facts["driver"] = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).strip()
        self.r.facts["mps daemon start"] = s.start_daemon()
        self.start_exporter()
        for name in phases:
            try:
                phase = getattr(self, f"phase_{name}", None)
                if phase is not None:
                    phase()
                else:
                    {**limits_truth.PHASES, **multi_gpu_phase.PHASES, **node_phases.PHASES,
                     **oom_phase.PHASES}[name](self)
            except Exception as e:  # one broken phase must not stop the rest (nor the quit)
                traceback.print_exc()
                self.r.check_true(f"{name}: phase completed", "no error", f"{type(e).__name__}: {e}", False)
                s.kill_all()
                try:
                    s.shutdown_servers()
                except Exception:
                    pass


def nvml_memory_views(s: Session) -> Dict[str, dict]:
    """Per GPU: memory used as NVML's v1 and v2 calls and nvidia-smi give it; NVML's two process lists."""
    import pynvml
    pynvml.nvmlInit()
    try:
        views = {}
        for g in s.smi_gpus():
            h = pynvml.nvmlDeviceGetHandleByIndex(g.index)
            v1 = pynvml.nvmlDeviceGetMemoryInfo(h)
            v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            views[str(g.index)] = {
                "v1_used": v1.used / MIB, "v2_used": v2.used / MIB, "v2_reserved": v2.reserved / MIB,
                "nvidia_smi_used": s.smi_gpus()[g.index].memory_used_mib,
                "compute_processes": {p.pid: (p.usedGpuMemory or 0) / MIB
                                      for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)},
                "mps_processes": {p.pid: (p.usedGpuMemory or 0) / MIB
                                  for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(h)}}
        return views
    finally:
        pynvml.nvmlShutdown()


def oracles_version(text: str) -> Optional[str]:
    import re
    m = re.search(r"[Bb]inary version:\s*(\S+)", text)
    return m.group(1) if m else None


def _mib(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v / MIB, 3)


def _distinct(items: List[str]) -> List[str]:
    out: List[str] = []
    for x in items:
        if not out or out[-1] != x:
            out.append(x)
    return out


def perf_markdown(perf: Dict[str, dict]) -> str:
    rows = ["| busy clients | scrape p50 (ms) | scrape p99 (ms) | raw p50 (ms) | raw p99 (ms) | p50 ratio | "
            "goal raw p99 x 1.2 + 5 (ms) | met | exporter CPU / scrape (ms) | control processes' CPU / scrape (ms) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for level, p in perf.items():
        goal = p["raw_p99_ms"] * 1.2 + 5
        rows.append(f"| {level} | {p['scrape_p50_ms']:.2f} | {p['scrape_p99_ms']:.2f} | {p['raw_p50_ms']:.2f} | "
                    f"{p['raw_p99_ms']:.2f} | {p['ratio_p50']:.2f} | {goal:.2f} | "
                    f"{'yes' if p['scrape_p99_ms'] <= goal else 'no'} | {p['cpu_ms_per_scrape']:.2f} | "
                    f"{p['children_cpu_ms_per_scrape']:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/mps-truth")
    ap.add_argument("--report-dir", required=True)
    ap.add_argument("--name", default="single-h200")
    ap.add_argument("--title", default="Truth check on one NVIDIA H200")
    ap.add_argument("--phases", default="idle,mixed,many,queue,limits,fault,quit")
    ap.add_argument("--many", type=int, default=32)
    ap.add_argument("--refusal-clients", type=int, default=52, help="clients on GPU 0 in phase refusals")
    args = ap.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    gpus = len(run(["nvidia-smi", "-L"]).strip().splitlines())
    s = Session(work, gpus)
    report = Report(args.title)
    check = TruthCheck(s, report)
    check.refusal_clients = args.refusal_clients
    started = time.time()
    try:
        check.run([p for p in args.phases.split(",") if p])
    finally:
        s.kill_all()
        try:
            report.facts.setdefault("reply quit", s.quit())
        finally:
            if check.exporter is not None:
                check.exporter.terminate()
                try:
                    check.exporter.wait(10)
                except subprocess.TimeoutExpired:
                    check.exporter.kill()
        report.facts["timeline"] = s.timeline
        report.facts["perf"] = check.perf
        report.facts["seconds"] = round(time.time() - started, 1)
        report.facts["client outputs"] = {c.tag: c.text().strip()[-300:] for c in s.clients}
        out = Path(args.report_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(report.to_json())
        extra = "## Performance\n\n" + perf_markdown(check.perf) if check.perf else ""
        (out / f"{args.name}.md").write_text(report.to_markdown(extra))
        print(report.to_markdown(extra))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
