"""Truth-check phases of issue 30, for a machine with two or more GPUs
(`truth_check.py --phases remapped,percap,daemonpergpu,storm2,quit`):

- `remapped`: limits across remapped devices. Clients with CUDA_VISIBLE_DEVICES=1 (and
  with GPU 1's UUID) setting CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G, one seeing both GPUs
  with `0=2G,1=4G`, one seeing only GPU 1 with `1=4G`. Each holds 0.5 GiB and tries to
  hold 2.5 GiB (and 4.5 on GPU 1 for the one seeing both): what MPS enforced, on which
  physical GPU, against mps_client_pinned_memory_limit_bytes{gpu}.
- `percap`: 48 idle clients on each of GPU 0 and GPU 1, then a 49th on GPU 1: 48 admitted
  on each, the 49th refused, mps_client_rejections_total up by the refusal lines.
- `daemonpergpu`: two control daemons as NVIDIA's device plugin runs them, one per
  resource, each with CUDA_VISIBLE_DEVICES set to one GPU and its own pipe and log
  directories (<root>/nvidia.com/mps-gpu<i>/{pipe,log}); a discovering exporter finds
  both; each daemon's servers, clients and client memory against its own commands and
  nvidia-smi (discovery_phase.compare_all); a default pinned limit set on the GPU 1
  daemon's device 0 and a client's own `0=2G` there, against MPS's refusal and the
  series' `gpu` label (physical 1: the daemon's CUDA_VISIBLE_DEVICES remaps devices).
- `storm2`: 52 clients on each of two GPUs arriving at once (48 admitted per device), a
  quarter of them busy, beside nvitop-exporter 1.7.2, both scraped once a second while they
  arrive (storm.py's Scraper): our scrape p99 and CPU seconds per scrape at or below
  nvitop-exporter's in the same run, and every admitted client's memory equal to
  nvidia-smi within 1 MiB once settled.

Every phase refuses to run on fewer than two GPUs, saying so in the report (a failed
check, not a silent pass). Oracles: the clients' own allocations, get_client_list,
nvidia-smi and the daemons' logs; never the exporter's code.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import oracles
from oracles import MIB

if TYPE_CHECKING:  # pragma: no cover
    from scrape import Exposition
    from truth_check import Client, TruthCheck

GiB = 2**30
SETTLE = 3.0  # NVML is read in the background every 1 s and served while at most 2 s old
PER_DEVICE = 48  # clients MPS 13000 accepts per device (h100-edges)
DEVICE_PLUGIN_ROOT = Path("/tmp/mpsd/dp2")  # short: the control socket path must fit 108 bytes


class NotEnoughGpus(RuntimeError):
    pass


def require_two_gpus(gpus: int, phase: str) -> None:
    """The guard of every phase here: MPS shows these only with two GPUs on one node."""
    if gpus < 2:
        raise NotEnoughGpus(f"phase {phase} needs two or more GPUs; this machine has {gpus} "
                            f"(run it on nvidia-h100-x2 or larger: tests/gpu/README.md)")


def _guarded(phase: Callable[["TruthCheck"], None], name: str) -> Callable[["TruthCheck"], None]:
    def run(tc: "TruthCheck") -> None:
        tc.phase(name)
        try:
            require_two_gpus(tc.s.gpus, name)
        except NotEnoughGpus as e:
            tc.r.check_true(f"{name}: two or more GPUs", ">= 2", str(tc.s.gpus), False, note=str(e))
            return
        phase(tc)
    return run


def client_limit(e: "Exposition", server_pid: Optional[int] = None, **labels: str) -> Optional[float]:
    """mps_server_client_limit whatever its labels: the series of `server_pid` where the
    series carry one; else the one value all the (matching) series agree on; else None."""
    found = e.series("mps_server_client_limit", **labels)
    if server_pid is not None:
        mine = [x.value for x in found if x.labels.get("server_pid") == str(server_pid)]
        if mine:
            return mine[0]
    values = {x.value for x in found}
    return values.pop() if len(values) == 1 else None



# ------------------------------------------------------------------ limits across remapped devices
def remapped_clients(uuid1: str) -> Dict[str, Dict[str, object]]:
    """name -> the client's environment, its grow steps (GiB in all), and per step the
    physical GPU and limit MPS should hold it to (None: no limit below the step)."""
    return {
        "cvd1": {"env": {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"},
                 "device": 0, "grow": [2.5], "expect": {1: 2 * GiB}},
        "cvd_uuid": {"env": {"CUDA_VISIBLE_DEVICES": uuid1, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"},
                     "device": 0, "grow": [2.5], "expect": {1: 2 * GiB}},
        # Sees both; holds memory on its device 1 (physical 1), limited to 4G there.
        "both_on1": {"env": {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G,1=4G"},
                     "device": 1, "grow": [2.5, 4.5], "expect": {0: 2 * GiB, 1: 4 * GiB}},
        "only1_key1": {"env": {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=4G"},
                       "device": 0, "grow": [2.5, 4.5], "expect": {}},
    }


def enforced_limit(answers: List[str], steps: List[float]) -> object:
    """What the grow answers say MPS enforced: the first step refused bounds the limit
    between the step before it and it; every step allowed: none below the last."""
    for i, answer in enumerate(answers):
        if answer.startswith("FAIL"):
            return f"between {steps[i - 1] if i else 0.5} and {steps[i]} GiB"
    return None


def phase_remapped(tc: "TruthCheck") -> None:
    s, r = tc.s, tc.r
    uuid1 = s.smi_gpus()[1].uuid
    plan = remapped_clients(uuid1)
    clients = {name: s.client(f"rm_{name}", 0.5, device=int(p["device"]), idle=True,
                              grow=list(p["grow"]), env=dict(p["env"]))
               for name, p in plan.items()}
    late = s.wait_ready(list(clients.values()), 90)
    r.facts["remapped: clients not ready"] = [c.tag for c in late]
    answers = {name: [s.grow(c, i) for i in range(len(plan[name]["grow"]))]
               for name, c in clients.items()}
    r.facts["remapped: grow answers"] = answers
    time.sleep(SETTLE)
    e = tc.scrape()
    for name, c in clients.items():
        p = plan[name]
        expect: Dict[int, int] = p["expect"]
        steps: List[float] = p["grow"]
        label = f"remapped: {name} ({p['env']})"
        # MPS's side: refused exactly where the expected limit is below a step on that GPU.
        on = 1  # every client here holds its memory on physical GPU 1
        bound = expect.get(on)
        want = ["FAIL" if bound is not None and step * GiB > bound else "OK" for step in steps]
        r.check(f"{label}: MPS refused exactly the steps past the expected limit on physical GPU {on}", want,
                [a.split()[0] if a else a for a in answers[name]])
        got = {int(x.labels["gpu"]): int(x.value) for x in e.series("mps_client_pinned_memory_limit_bytes",
                                                                    pid=str(c.pid))}
        r.check(f"{label}: mps_client_pinned_memory_limit_bytes by physical GPU it runs on "
                f"(enforced: {enforced_limit(answers[name], steps)})", {on: bound} if bound else {}, got)
    s.stop(list(clients.values()))
    s.shutdown_servers()


# ------------------------------------------------------------------ 48 clients per device
def phase_percap(tc: "TruthCheck") -> None:
    s, r = tc.s, tc.r
    e0 = tc.scrape()
    rej0 = e0.value("mps_client_rejections_total", reason="client_limit") or 0
    lines0 = len(oracles.client_refusals(s.server_log()))
    clients = [s.client(f"pc{g}_{i}", 0, device=0, n=64, idle=True, env={"CUDA_VISIBLE_DEVICES": str(g)})
               for g in (0, 1) for i in range(PER_DEVICE)]
    late = s.wait_ready(clients, 240)
    r.check("percap: 48 clients admitted on each of GPU 0 and GPU 1", [], [c.tag for c in late])
    extra = s.client("pc1_extra", 0, device=0, n=64, idle=True, env={"CUDA_VISIBLE_DEVICES": "1"})
    s.wait_ready([extra], 150)
    try:
        extra.proc.wait(60)
    except Exception:
        pass
    time.sleep(SETTLE)
    e = tc.scrape()
    refusals = oracles.client_refusals(s.server_log())[lines0:]
    r.facts["percap: the 49th client's output"] = extra.text().strip()[-400:]
    r.check("percap: the 49th client on GPU 1 refused (cudaErrorDevicesUnavailable)", True,
            not extra.is_ready() and "busy or unavailable" in extra.text())
    r.check("percap: one refusal line in server.log", 1, len(refusals))
    r.check("percap: mps_client_rejections_total{client_limit} delta = refusal lines", len(refusals),
            (e.value("mps_client_rejections_total", reason="client_limit") or 0) - rej0)
    servers = s.servers()
    r.check("percap: mps_server_client_limit (of the clients' server) = 48", PER_DEVICE,
            client_limit(e, servers[0] if len(servers) == 1 else None))
    apps = s.smi_apps()
    per_gpu = {g.uuid: sum(1 for (u, pid) in apps if u == g.uuid and pid in {c.pid for c in clients})
               for g in s.smi_gpus()[:2]}
    exp = {x.labels["uuid"]: 0 for x in e.series("mps_client_memory_used_bytes")}
    for x in e.series("mps_client_memory_used_bytes"):
        if int(x.labels["pid"]) in {c.pid for c in clients}:
            exp[x.labels["uuid"]] += 1
    r.check("percap: clients per GPU, exporter = nvidia-smi (48 each)", per_gpu, {u: exp.get(u, 0) for u in per_gpu})
    s.stop(clients + [extra])
    s.shutdown_servers()


# ------------------------------------------------------------------ one daemon per GPU
def phase_daemonpergpu(tc: "TruthCheck") -> None:
    import discovery_phase as dp
    from truth_check import free_port

    s, r = tc.s, tc.r
    shutil.rmtree(DEVICE_PLUGIN_ROOT, ignore_errors=True)
    daemons = []
    for g in (0, 1):
        d = dp.Daemon(f"nvidia.com/mps-gpu{g}", DEVICE_PLUGIN_ROOT / "nvidia.com" / f"mps-gpu{g}")
        d.env["CUDA_VISIBLE_DEVICES"] = str(g)  # as the device plugin starts it, per resource
        daemons.append(d)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    exporter, clients = None, []
    kept = s.work / "daemonpergpu-logs"
    kept.mkdir(parents=True, exist_ok=True)
    try:
        for d in daemons:
            r.facts[f"daemonpergpu: start {d.name}"] = d.start()
            (d.directory / ".started").touch()
        # The second daemon's device 0 is physical GPU 1: a default limit it binds there.
        r.facts["daemonpergpu: default limit on the GPU 1 daemon's device 0"] = daemons[1].ctl(
            "set_default_device_pinned_mem_limit 0 3G")
        exporter = dp.start_exporter(tc, DEVICE_PLUGIN_ROOT, DEVICE_PLUGIN_ROOT.parent / "no-dra", port)  # no DRA claims
        e = dp.wait_scrape(url, lambda e: len(e.label_set("mps_control_daemon_up", "daemon")) == 2, 30)
        r.check_true("daemonpergpu: both daemons found", sorted(d.name for d in daemons),
                     sorted(e.label_set("mps_control_daemon_up", "daemon")) if e else None, e is not None)
        for g, d in enumerate(daemons):
            # No CUDA_VISIBLE_DEVICES in the client: the daemon's remaps the devices (its GPU is
            # the client's device 0), and a client keeping `1` would fail (NVIDIA's MPS docs,
            # "Appendix: Environment Variables").
            env = {"CUDA_MPS_PIPE_DIRECTORY": str(d.pipe), "CUDA_MPS_LOG_DIRECTORY": str(d.log),
                   "CUDA_VISIBLE_DEVICES": "0"}  # counts from the daemon's list (node_phases.daemon_env)
            own = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"}  # the third client's own limit
            clients += [s.client(f"dpg{g}_{i}", 0.5 + i * 0.25, device=0, idle=True, grow=[3.5],
                                 env={**env, **(own if i == 2 else {})}) for i in range(3)]
        s.wait_ready(clients, 120)
        grown = {clients[3].tag: s.grow(clients[3], 0)}
        r.facts["daemonpergpu: a GPU 1 client grows to 3.5 GiB under its daemon's 3G default"] = grown
        r.check("daemonpergpu: MPS enforced the GPU 1 daemon's device-0 default (3.5 GiB refused)", ["FAIL"],
                [a.split()[0] if a else a for a in grown.values()])
        time.sleep(SETTLE)
        e = dp.compare_all(tc, url, "daemonpergpu", daemons)
        uuids = [g.uuid for g in s.smi_gpus()[:2]]
        for g, d in enumerate(daemons):
            r.check(f"daemonpergpu: {d.name}: its clients' memory only on GPU {g}", [uuids[g]],
                    sorted(e.label_set("mps_client_memory_used_bytes", "uuid", daemon=d.name)))
        # The daemon's device indices count its CUDA_VISIBLE_DEVICES: the series must name
        # the physical GPU (NVML's index), not the daemon's device 0.
        name = daemons[1].name
        r.check(f"daemonpergpu: {name}: mps_default_pinned_memory_limit_bytes on physical GPU 1", {"1": 3 * GiB},
                {x.labels["gpu"]: int(x.value) for x in e.series("mps_default_pinned_memory_limit_bytes", daemon=name)})
        r.check(f"daemonpergpu: {name}: its clients' limit on physical GPU 1", {"1": 3 * GiB},
                {x.labels["gpu"]: int(x.value) for x in e.series("mps_client_pinned_memory_limit_bytes", daemon=name)
                 if x.labels["pid"] == str(clients[4].pid)})
        r.check(f"daemonpergpu: {name}: a client's own 0=2G binds its device 0, physical GPU 1", {"1": 2 * GiB},
                {x.labels["gpu"]: int(x.value) for x in e.series("mps_client_pinned_memory_limit_bytes", daemon=name)
                 if x.labels["pid"] == str(clients[5].pid)})
    finally:
        dp.tear_down(s, r, "daemonpergpu", clients, daemons, kept, exporter)


# ------------------------------------------------------------------ storm over two GPUs
STORM_PER_GPU = 52  # 48 admitted per device, 4 refused (one server.log line each)
NVITOP_PORT = 10139


def start_nvitop(tc: "TruthCheck", port: int = NVITOP_PORT):
    """nvitop-exporter 1.7.2 (wheels from .whl/, installed by device_env.sh) as storm.py runs it."""
    import subprocess
    import sys
    env = {k: v for k, v in tc.s.env.items() if not k.startswith("CUDA_MPS_")}
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; from nvitop_exporter.cli import main; sys.exit(main())",
         "--bind-address", "127.0.0.1", "--port", str(port), "--interval", "1.0"],
        env=env, stdout=open(tc.s.work / "nvitop-exporter.log", "w"), stderr=subprocess.STDOUT, cwd="/tmp")


PY_SPY = "/tmp/site/bin/py-spy"  # from .whl/ (tests/gpu/device_env.sh); absent: no profile


def start_profiler(tc: "TruthCheck") -> "Optional[subprocess.Popen[bytes]]":
    """py-spy sampling mps-exporter (non-blocking, raw stacks) through the storm: where its CPU goes."""
    import os
    if not os.access(PY_SPY, os.X_OK):
        return None
    out = tc.s.work / "py-spy-storm2.txt"
    return subprocess.Popen([PY_SPY, "record", "--nonblocking", "--rate", "100", "--threads", "--format", "raw",
                             "-p", str(tc.exporter.pid), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profiler(profiler: "Optional[subprocess.Popen[bytes]]") -> None:
    if profiler is not None and profiler.poll() is None:
        profiler.send_signal(2)  # SIGINT: py-spy writes what it sampled
        try:
            profiler.wait(20)
        except subprocess.TimeoutExpired:
            profiler.kill()


def thread_cpu(pid: int) -> Dict[int, float]:
    """CPU seconds (user + system) of each thread of `pid`, by thread ID: what each part of the
    exporter costs (py-spy's raw stacks name each thread ID)."""
    import os
    tick = os.sysconf("SC_CLK_TCK")
    out: Dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return out


def storm_verdict(ours: Dict[str, float], theirs: Dict[str, float]) -> Dict[str, bool]:
    """Ours at or below nvitop-exporter's: scrape p99 and CPU seconds per scrape (storm.scrape_stats)."""
    return {key: ours.get(key) is not None and theirs.get(key) is not None and ours[key] <= theirs[key]
            for key in ("p99_seconds", "cpu_seconds_per_scrape")}


def phase_storm2(tc: "TruthCheck", per_gpu: int = STORM_PER_GPU, idle_seconds: float = 6.0,
                 max_storm_seconds: float = 150.0, settle_seconds: float = 10.0) -> None:
    """52 clients on each GPU at once (48 admitted on each), a quarter busy, beside
    nvitop-exporter; both scraped once a second by storm.py's Scraper (ours as Prometheus
    does). Every GPU of the machine: 2 in issue 38's run, 4 in issue 45's."""
    import storm
    s, r = tc.s, tc.r
    nvitop = start_nvitop(tc)
    clients: List["Client"] = []
    scrapers = []
    try:
        nvitop_up = False
        deadline = time.time() + 60
        while time.time() < deadline and nvitop.poll() is None and not nvitop_up:  # a failed import: at once
            try:
                storm.wait_http(f"http://127.0.0.1:{NVITOP_PORT}/metrics", 1)
                nvitop_up = True
            except RuntimeError:
                pass
        r.check_true("storm2: nvitop-exporter 1.7.2 answers beside mps-exporter", "answers",
                     (tc.s.work / "nvitop-exporter.log").read_text(errors="replace")[-300:] if not nvitop_up else "yes",
                     nvitop_up)
        prometheus = {"Accept": storm.PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip",
                      "X-Prometheus-Scrape-Timeout-Seconds": "1"}
        ours = storm.Scraper("mps-exporter", tc.url, tc.exporter.pid, prometheus, ages=True)
        scrapers.append(ours)
        theirs = None
        if nvitop_up:
            theirs = storm.Scraper("nvitop-exporter", f"http://127.0.0.1:{NVITOP_PORT}/metrics", nvitop.pid,
                                   {"Accept-Encoding": "gzip"})
            scrapers.append(theirs)
        for sc in scrapers:
            sc.start()
        profiler = start_profiler(tc)
        time.sleep(idle_seconds)
        storm.set_phase(scrapers, "storm")
        cpu_before = thread_cpu(tc.exporter.pid)
        started = time.time()
        gpus = list(range(s.gpus))
        for g in gpus:
            for i in range(per_gpu):
                busy = i % 4 == 0  # a quarter busy
                clients.append(s.client(f"st{g}_{i}", 0.25, device=0, n=2048 if busy else 64, idle=not busy,
                                        env={"CUDA_VISIBLE_DEVICES": str(g)}))
        late = s.wait_ready(clients, max_storm_seconds)
        r.facts["storm2: seconds until every client was ready or had exited"] = round(time.time() - started, 1)
        storm.set_phase(scrapers, "settled")
        time.sleep(settle_seconds)
        admitted = [c for c in clients if c.is_ready() and c.proc.poll() is None]
        per = {g: sum(1 for c in admitted if c.tag.startswith(f"st{g}_")) for g in gpus}
        r.check(f"storm2: {PER_DEVICE} of {per_gpu} admitted on each GPU ({len(gpus) * per_gpu} at once)",
                {g: PER_DEVICE for g in gpus}, per)
        r.check("storm2: the others refused (exited, not ready)", [],
                [c.tag for c in clients if not c.is_ready() and c.proc.poll() is None])
        r.facts["storm2: a refused client's output"] = next((c.text().strip()[-300:] for c in late), "")
        for sc in scrapers:
            sc.stop_event.set()
        for sc in scrapers:
            sc.join(35)
        stop_profiler(profiler)
        cpu_after = thread_cpu(tc.exporter.pid)
        r.facts["storm2: mps-exporter CPU seconds by thread ID, storm + settled"] = {
            tid: round(cpu_after[tid] - cpu_before.get(tid, 0.0), 2) for tid in sorted(cpu_after)
            if cpu_after[tid] - cpu_before.get(tid, 0.0) >= 0.01}
        # Settled: every admitted client's memory against nvidia-smi, oracles agreeing before and after.
        pids = {c.pid for c in admitted}
        for _ in range(4):
            apps = s.smi_apps()
            e = tc.scrape()
            if apps == s.smi_apps():
                break
            time.sleep(1)
        exp = {f"{pid}@{u[:12]}": mib for (u, pid), mib in apps.items() if pid in pids}
        act = {f"{x.labels['pid']}@{x.labels['uuid'][:12]}": x.value / MIB
               for x in e.series("mps_client_memory_used_bytes") if int(x.labels["pid"]) in pids}
        worst = max([abs(exp[k] - act.get(k, float("inf"))) for k in exp] or [0.0])
        r.check_true(f"storm2: every admitted client's memory = nvidia-smi within 1 MiB, settled ({len(pids)})",
                     len(pids), len(act), len(exp) == len(pids) and set(exp) == set(act) and worst <= 1.0,
                     note=f"largest difference {worst:.2f} MiB")
        phases = ("storm", "settled")
        s_ours = storm.scrape_stats(ours.results, phases)
        r.facts["storm2: side by side"] = storm.side_by_side(scrapers)
        r.facts["storm2: markdown"] = storm.side_by_side_markdown({"side_by_side": r.facts["storm2: side by side"]})
        r.check("storm2: mps-exporter scrapes that failed", 0, s_ours.get("failed"))
        if theirs is not None:
            s_theirs = storm.scrape_stats(theirs.results, phases)
            verdict = storm_verdict(s_ours, s_theirs)
            r.check_true("storm2: our scrape p99 <= nvitop-exporter's, same run", s_theirs.get("p99_seconds"),
                         s_ours.get("p99_seconds"), verdict["p99_seconds"])
            r.check_true("storm2: our CPU seconds per scrape <= nvitop-exporter's, same run",
                         s_theirs.get("cpu_seconds_per_scrape"), s_ours.get("cpu_seconds_per_scrape"),
                         verdict["cpu_seconds_per_scrape"])
        r.facts["storm2: scrape p50 / p99 ms (ours)"] = [
            None if s_ours.get(k) is None else round(1000 * s_ours[k], 1) for k in ("p50_seconds", "p99_seconds")]
    finally:
        for sc in scrapers:
            sc.stop_event.set()
        if nvitop.poll() is None:
            nvitop.terminate()
            try:
                nvitop.wait(10)
            except Exception:
                nvitop.kill()
        s.stop(clients)
        s.shutdown_servers()


PHASES: Dict[str, Callable[["TruthCheck"], None]] = {
    name: _guarded(fn, name) for name, fn in (("remapped", phase_remapped), ("percap", phase_percap),
                                              ("daemonpergpu", phase_daemonpergpu), ("storm2", phase_storm2))}
