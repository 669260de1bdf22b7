"""Truth-check phase `discovery` (issue 25): control daemons in the device plugin's and the
DRA driver's layouts at once, found by a second exporter running with
`--mps.discover device-plugin,dra` under /tmp roots.

- daemon `nvidia.com/gpu` in the device plugin's layout (<root>/nvidia.com/gpu/{pipe,log},
  a `.started` file) and one DRA claim's daemon started with -M
  (<plugins>/gpu.nvidia.com/mps/<claim UID>-<5 hex of sha256 of the GPU UUIDs>/{pipe,shm,log}),
  both on GPU 0 beside the truth check's own daemon; a client on each;
- a second claim's daemon started while the exporter runs, with its client;
- the first claim released as the DRA driver does it: its client stops, its daemon
  quits, its directory is removed, directory and all.

At each step every daemon's servers, clients and client memory are compared with its own
`get_server_list` / `get_client_list` and nvidia-smi, and the exporter's daemon set with
the directories there are. Where MPS refuses a second daemon on the GPU, the report says
what it answered. Each daemon's logs are kept under <work>/discovery-logs/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid as uuidlib
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

from oracles import MIB
from scrape import Exposition, scrape
from truth_check import Session

if TYPE_CHECKING:
    from report import Report
    from truth_check import Client, TruthCheck

INTERVAL = 1.0  # --mps.discover-interval of the discovering exporter
DISCOVERY_ROOT = Path("/tmp/mpsd")  # run_device.sh quits every daemon below it
SETTLE = 3.0  # NVML is read in the background every 1 s and served while at most 2 s old
RESOURCE = "nvidia.com/gpu"


class Daemon(Session):
    """One MPS control daemon in a layout's directory: the session's control commands
    (`ctl`, `servers`, `client_lists`, `kill_daemon`) on this daemon's pipe."""

    def __init__(self, name: str, directory: Path, multiuser: bool = False, claim_uid: str = "") -> None:
        self.name, self.directory, self.multiuser, self.claim_uid = name, directory, multiuser, claim_uid
        self.pipe, self.log = directory / "pipe", directory / "log"
        self.env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(self.pipe), CUDA_MPS_LOG_DIRECTORY=str(self.log))
        self.start_reply = ""

    def start(self) -> str:
        for d in (self.pipe, self.log):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o777)
        argv = ["nvidia-cuda-mps-control", "-d"] + (["-M"] if self.multiuser else [])
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=20)
        deadline = time.time() + 10
        while not (self.pipe / "control").exists() and time.time() < deadline:
            time.sleep(0.1)
        self.start_reply = f"{' '.join(argv)}: rc={r.returncode} {(r.stdout + r.stderr).strip()}"
        return self.start_reply

    def quit(self) -> str:
        try:
            return self.ctl("quit", timeout=15)
        except subprocess.TimeoutExpired:
            return f"(no answer to quit: killed {self.kill_daemon()})"

    def keep_logs(self, into: Path) -> None:
        if self.log.is_dir():
            shutil.copytree(self.log, into / self.name.replace("/", "_"), dirs_exist_ok=True)


def dra_directory(plugins: Path, claim_uid: str, gpu_uuids: List[str]) -> Path:
    """As sharing.go names it: <claim UID>-<first 5 hex of sha256 of the UUIDs joined by ','>."""
    digest = hashlib.sha256(",".join(gpu_uuids).encode()).hexdigest()[:5]
    return plugins / "gpu.nvidia.com" / "mps" / f"{claim_uid}-{digest}"


def exporter_args(state_file: Path, dp_root: Path, plugins: Path, port: int) -> List[str]:
    """The interpreter's arguments of an exporter discovering both layouts' roots."""
    return ["-m", "mps_exporter.cli", "serve", "--mps.discover", "device-plugin,dra",
            "--mps.discover.device-plugin-root", str(dp_root), "--mps.discover.dra-root", str(plugins),
            "--mps.discover-interval", str(INTERVAL), "--mps.state-file", str(state_file),
            "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "info"]


def start_exporter(tc: "TruthCheck", dp_root: Path, plugins: Path, port: int) -> subprocess.Popen:
    log = open(tc.s.work / "exporter-discovery.log", "w")
    argv = [sys.executable, *exporter_args(tc.s.work / "discovery-state.json", dp_root, plugins, port)]
    env = {k: v for k, v in tc.s.env.items() if not k.startswith("CUDA_MPS_")}
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/tmp")


def tear_down(s: Session, r: "Report", phase: str, clients: List["Client"], daemons: List[Daemon], kept: Path,
              exporter: Optional[subprocess.Popen]) -> None:
    """The end of a phase with daemons of its own: clients stopped, each daemon told to quit
    (its answer kept as a fact) and its logs kept, the exporter stopped."""
    s.stop(clients)
    for d in daemons:
        if d.pipe.exists():
            r.facts[f"{phase}: quit {d.name}"] = d.quit()
        d.keep_logs(kept)
    if exporter is not None:
        exporter.terminate()
        try:
            exporter.wait(10)
        except subprocess.TimeoutExpired:
            exporter.kill()


def wait_scrape(url: str, predicate, timeout: float) -> Optional[Exposition]:
    """The first scrape within `timeout` that satisfies `predicate` (None: none did)."""
    deadline = time.time() + timeout
    while True:
        try:
            e = scrape(url, timeout=10)
            if predicate(e):
                return e
        except OSError:
            pass
        if time.time() >= deadline:
            return None
        time.sleep(0.2)


def compare_daemon(tc: "TruthCheck", label: str, d: Daemon, e: Exposition, apps: Dict[tuple, int]) -> None:
    """One daemon's servers, clients and client memory against its own commands and nvidia-smi."""
    r = tc.r
    lists = d.client_lists()
    clients = {c for cs in lists.values() for c in cs}
    r.check(f"{label}: {d.name}: server set = its get_server_list", sorted(lists),
            sorted(int(p) for p in e.label_set("mps_server_info", "server_pid", daemon=d.name)))
    r.check(f"{label}: {d.name}: client set = its get_client_list", sorted(clients),
            sorted(int(p) for p in e.label_set("mps_client_info", "pid", daemon=d.name)))
    r.check(f"{label}: {d.name}: mps_server_clients = len(get_client_list)", {str(s): len(c) for s, c in lists.items()},
            {x.labels["server_pid"]: int(x.value) for x in e.series("mps_server_clients", daemon=d.name)})
    exp = {f"{pid}@{u[:12]}": mib for (u, pid), mib in apps.items() if pid in clients}
    act = {f"{x.labels['pid']}@{x.labels['uuid'][:12]}": x.value / MIB
           for x in e.series("mps_client_memory_used_bytes", daemon=d.name)}
    worst = max([abs(exp[k] - act.get(k, float("inf"))) for k in exp] or [0.0])
    r.check_true(f"{label}: {d.name}: client memory = nvidia-smi compute-apps (within 1 MiB)", exp, act,
                 set(exp) == set(act) and worst <= 1.0, note=f"largest difference {worst:.2f} MiB")
    info = e.series("mps_control_daemon_info", daemon=d.name)
    r.check(f"{label}: {d.name}: daemon info (claim_uid, multiuser, pipe_directory)",
            [(d.claim_uid, str(d.multiuser).lower(), str(d.pipe))],
            [(x.labels["claim_uid"], x.labels["multiuser"], x.labels["pipe_directory"]) for x in info])


def compare_all(tc: "TruthCheck", url: str, label: str, daemons: List[Daemon]) -> Exposition:
    """Every daemon against its own oracles, on a scrape the oracles agree with before and after."""
    for _ in range(4):
        before = ({d.name: d.client_lists() for d in daemons}, tc.s.smi_apps())
        e = scrape(url)
        after = ({d.name: d.client_lists() for d in daemons}, tc.s.smi_apps())
        if before == after:
            break
        time.sleep(1)
    tc.r.check(f"{label}: the exporter's daemons = the daemon directories there are",
               sorted(d.name for d in daemons), sorted(e.label_set("mps_control_daemon_up", "daemon")))
    for d in daemons:
        compare_daemon(tc, label, d, e, after[1])
    return e


def run(tc: "TruthCheck", port: int) -> None:
    """The phase; every daemon it started is told to quit (or killed) whatever failed."""
    s, r = tc.s, tc.r
    # Short roots: MPS's control socket is <pipe>/control, a UNIX socket path, which must fit
    # in 108 bytes; under /tmp/mps-truth/discovery/kubelet-plugins a DRA daemon's is 115 and
    # `nvidia-cuda-mps-control -d` exits 1 saying nothing (the first run, 2026-11-25).
    dp_root, plugins = DISCOVERY_ROOT / "dp", DISCOVERY_ROOT / "kp"
    shutil.rmtree(DISCOVERY_ROOT, ignore_errors=True)
    kept = s.work / "discovery-logs"
    kept.mkdir(parents=True, exist_ok=True)
    gpu0 = s.smi_gpus()[0].uuid
    claims = [str(uuidlib.uuid4()) for _ in range(2)]
    plugin = Daemon(RESOURCE, dp_root / RESOURCE)
    first = Daemon(dra_directory(plugins, claims[0], [gpu0]).name, dra_directory(plugins, claims[0], [gpu0]),
                   multiuser=True, claim_uid=claims[0])
    later = Daemon(dra_directory(plugins, claims[1], [gpu0]).name, dra_directory(plugins, claims[1], [gpu0]),
                   claim_uid=claims[1])
    everyone = [plugin, first, later]
    url = f"http://127.0.0.1:{port}/metrics"
    exporter: Optional[subprocess.Popen] = None
    clients = []
    try:
        r.facts["discovery: control socket path lengths (at most 107)"] = {
            d.name: len(str(d.pipe / "control")) for d in everyone}
        r.facts["discovery: start plugin daemon"] = plugin.start()
        (plugin.directory / ".started").touch()
        (dp_root / "shm").mkdir(parents=True, exist_ok=True)
        r.facts["discovery: start first claim's daemon"] = first.start()
        for d in (plugin, first):
            r.check_true(f"discovery: daemon {d.name} started", "its control socket", d.start_reply,
                         (d.pipe / "control").exists())
        (first.directory / "shm").mkdir(exist_ok=True)
        (first.log / "startup.log").write_text("startup complete\n")
        exporter = start_exporter(tc, dp_root, plugins, port)
        e = wait_scrape(url, lambda e: len(e.label_set("mps_control_daemon_up", "daemon")) == 2, 30)
        r.check_true("discovery: both layouts' daemons found", sorted([plugin.name, first.name]),
                     sorted(e.label_set("mps_control_daemon_up", "daemon")) if e else None, e is not None)

        a = s.client("disc-plugin", 1.0, env={"CUDA_MPS_PIPE_DIRECTORY": str(plugin.pipe),
                                              "CUDA_MPS_LOG_DIRECTORY": str(plugin.log)})
        b = s.client("disc-claim1", 2.0, env={"CUDA_MPS_PIPE_DIRECTORY": str(first.pipe),
                                              "CUDA_MPS_LOG_DIRECTORY": str(first.log)})
        clients += [a, b]
        late = s.wait_ready([a, b], 120)
        time.sleep(SETTLE)
        r.facts["discovery: clients not ready (a second daemon's server on the GPU)"] = {
            c.tag: c.text().strip()[-400:] for c in late}
        r.facts["discovery: servers"] = {d.name: d.servers() for d in (plugin, first)}
        compare_all(tc, url, "discovery: two layouts", [plugin, first])

        # A claim prepared while the exporter runs.
        appeared_at = time.time()
        r.facts["discovery: start later claim's daemon"] = later.start()
        r.check_true(f"discovery: daemon {later.name} started", "its control socket", later.start_reply,
                     (later.pipe / "control").exists())
        e = wait_scrape(url, lambda e: later.name in e.label_set("mps_control_daemon_up", "daemon"), 30)
        seen_after = time.time() - appeared_at
        r.check_true(f"discovery: a daemon started while the exporter runs appears within one re-scan "
                     f"({INTERVAL:g} s) plus a scrape", f"<= {INTERVAL + 2:g} s", f"{seen_after:.2f} s",
                     e is not None and seen_after <= INTERVAL + 2)
        c = s.client("disc-claim2", 1.0, env={"CUDA_MPS_PIPE_DIRECTORY": str(later.pipe),
                                              "CUDA_MPS_LOG_DIRECTORY": str(later.log)})
        clients.append(c)
        s.wait_ready([c], 120)
        time.sleep(SETTLE)
        compare_all(tc, url, "discovery: three daemons", [plugin, first, later])

        # The first claim released: its client ends, its daemon quits, its directory goes.
        s.stop([b])
        r.facts["discovery: quit first claim's daemon"] = first.quit()
        first.keep_logs(kept)
        shutil.rmtree(first.directory)
        removed_at = time.time()
        e = wait_scrape(url, lambda e: first.name not in e.text, 30)
        gone_after = time.time() - removed_at
        r.check_true(f"discovery: a removed daemon leaves /metrics within one re-scan ({INTERVAL:g} s) plus a "
                     f"scrape", f"<= {INTERVAL + 2:g} s", f"{gone_after:.2f} s", e is not None and gone_after <= INTERVAL + 2)
        if e is not None:
            r.check("discovery: after the release, logs collector still succeeds", 1.0,
                    e.value("mps_exporter_collector_success", collector="logs"))
        time.sleep(6)  # the state file is written at most every 5 s
        state = json.loads((s.work / "discovery-state.json").read_text())
        r.check("discovery: state file holds the daemons there are", sorted([plugin.name, later.name]), sorted(state))
        compare_all(tc, url, "discovery: after the release", [plugin, later])
        r.facts["discovery: exporter status"] = subprocess.run(
            [sys.executable, "-m", "mps_exporter.cli", "status", "--mps.discover", "device-plugin,dra",
             "--mps.discover.device-plugin-root", str(dp_root), "--mps.discover.dra-root", str(plugins)],
            capture_output=True, text=True, timeout=60, cwd="/tmp",
            env={k: v for k, v in s.env.items() if not k.startswith("CUDA_MPS_")}).stdout[-3000:]
    finally:
        tear_down(s, r, "discovery", clients, everyone, kept, exporter)
        if (s.work / "exporter-discovery.log").exists():
            shutil.copy(s.work / "exporter-discovery.log", kept / "exporter-discovery.log")
