"""Truth-check phases of issue 38 (nodes with several GPUs), for two or more GPUs
(`truth_check.py --phases starts,cvdlimits,killdaemon,ceiling,quit`):

- `starts`: two control daemons in the device plugin's layout (one per GPU,
  CUDA_VISIBLE_DEVICES=0 and =1), each with two clients, one of them multiplying
  matrices (NVML GPM has activity on both GPUs); then 20 exporter starts (fresh
  `python3 -X faulthandler` processes discovering the device-plugin root), 4 at a time on
  different ports, each scraped every 0.2 s for 10 s. A death is a process that exited
  before it was stopped: its return code (negative: the signal) and the last 40 lines
  of its stderr (faulthandler's stacks). 0 deaths of 20; scrapes answered 200 counted.
- `cvdlimits`: per-GPU daemons with CUDA_VISIBLE_DEVICES by index (`1`) and, in a
  second pair, by UUID. On the GPU 1 daemon: (a) `set_default_device_pinned_mem_limit 0
  3G`: a client without a setting of its own is refused past 3 GiB, and the default,
  the server's and that client's limit are 3 GiB on gpu="1" (nothing on gpu="0");
  (b) a client's own `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G`: 2 GiB on gpu="1";
  (c) the daemon quit and started again, then the DRA driver's
  `set_default_device_pinned_mem_limit GPU-<uuid> 2048M`: refused at 2.5 GiB, 2 GiB on
  gpu="1". The raw answers of the get_* commands by index and by UUID after each kind of
  set are facts.
- `killdaemon`: a per-GPU daemon with a server and a client, SIGKILLed with its servers
  (found by CUDA_MPS_PIPE_DIRECTORY in /proc/PID/environ), its directory left in place:
  its server and client series leave /metrics within 2 s (scraped every 0.1 s).
- `ceiling`: 20 idle clients with CUDA_DEVICE_MAX_CONNECTIONS=8 at once on the check's
  own daemon and GPU 0: MPS admits some and refuses the rest (server.log `Reached
  maximum number of device connections`); mps_server_client_limit = the number admitted.

The churn (clients coming and going for ten minutes) is `churn.py`, a script of its own:
it runs longer than one command on the lent machine. Every phase here refuses to run on
fewer than two GPUs (multi_gpu_phase.require_two_gpus), saying so in the report.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import oracles
from multi_gpu_phase import SETTLE, _guarded, client_limit

if TYPE_CHECKING:  # pragma: no cover
    from discovery_phase import Daemon
    from scrape import Exposition
    from truth_check import Client, TruthCheck

GiB = 2**30
ROOT = Path("/tmp/mpsd")  # short: a UNIX socket path must fit 107 bytes; run_x2.sh quits every daemon below it
STARTS, STARTS_AT_ONCE, START_SECONDS, START_SCRAPE_EVERY = 20, 4, 10.0, 0.2
STDERR_LINES = 40
VANISH_SECONDS = 2.0  # a killed daemon's servers and clients must leave /metrics this fast
CEILING_CLIENTS = 20
LIMIT_METRICS = ("mps_default_pinned_memory_limit_bytes", "mps_server_pinned_memory_limit_bytes",
                 "mps_client_pinned_memory_limit_bytes")


# ====================================================================== pure helpers (CI)
def tail_lines(text: str, n: int = STDERR_LINES) -> List[str]:
    return text.splitlines()[-n:]


def start_summary(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Deaths (exited before being stopped: `rc` not None) and scrapes, over the starts."""
    deaths = [{"start": x["start"], "rc": x["rc"], "signal": _signal_name(x["rc"]),
               "stderr_tail": x.get("stderr_tail", [])} for x in runs if x.get("rc") is not None]
    return {"starts": len(runs), "deaths": deaths, "scrapes_200": sum(x.get("ok", 0) for x in runs),
            "scrapes_other": sum(x.get("failed", 0) for x in runs),
            "never_answered": [x["start"] for x in runs if not x.get("ok")],
            "first_200_seconds": sorted(round(x["first_ok"], 2) for x in runs if x.get("first_ok") is not None)}


def _signal_name(rc: Optional[int]) -> Optional[str]:
    if rc is None or rc >= 0:
        return None
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def by_gpu(e: "Exposition", metric: str, **labels: str) -> Dict[str, int]:
    """{gpu label: value} of a metric's series with these labels."""
    return {x.labels.get("gpu", ""): int(x.value) for x in e.series(metric, **labels)}


def gone_after(samples: List[Dict[str, Any]]) -> Optional[float]:
    """Seconds after the kill of the first scrape (begun after it) from which on every
    answered scrape had neither the daemon's servers nor its clients; None: never."""
    gone = None
    for x in samples:
        if x.get("status") != 200:
            continue
        if x["servers"] or x["clients"]:
            gone = None
        elif gone is None:
            gone = x["t"]
    return gone


def refusal_lines(server_log_text: str, since: int = 0) -> List[str]:
    """server.log lines (after the first `since` bytes) that refuse a new client, either kind."""
    return [line for line in server_log_text[since:].splitlines() if "Failed to accept new client" in line]


# ====================================================================== machine helpers
def control_daemon_pids(pipe: Path) -> List[int]:
    """PIDs of `nvidia-cuda-mps-control -d` processes started with this pipe directory
    (CUDA_MPS_PIPE_DIRECTORY in /proc/PID/environ, as run_device.sh finds them)."""
    mine, out = f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path("/proc", entry, "cmdline").read_bytes().split(b"\0")
            # `-d`: the daemon, not a control command of the same pipe (the exporter's, ours)
            if cmd and cmd[0].endswith(b"nvidia-cuda-mps-control") and b"-d" in cmd[1:] and \
                    mine in Path("/proc", entry, "environ").read_bytes().split(b"\0"):
                out.append(int(entry))
        except OSError:
            continue
    return out


def _wait(predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    from truth_check import wait_for  # truth_check imports this module: not at its top
    return wait_for(predicate, timeout, step)


def per_gpu_daemons(root: Path, visible: List[str]) -> List["Daemon"]:
    """Daemons in the device plugin's layout, <root>/nvidia.com/mps-gpu<i>/{pipe,log}, each
    with CUDA_VISIBLE_DEVICES = visible[i] (an index or a UUID), as the plugin starts them."""
    import discovery_phase as dp
    shutil.rmtree(root, ignore_errors=True)
    daemons = []
    for g, cvd in enumerate(visible):
        d = dp.Daemon(f"nvidia.com/mps-gpu{g}", root / "nvidia.com" / f"mps-gpu{g}")
        d.env["CUDA_VISIBLE_DEVICES"] = cvd
        daemons.append(d)
    return daemons


def start_daemons(tc: "TruthCheck", label: str, daemons: List["Daemon"]) -> None:
    for d in daemons:
        tc.r.facts[f"{label}: start {d.name} (CUDA_VISIBLE_DEVICES={d.env.get('CUDA_VISIBLE_DEVICES')})"] = d.start()
        (d.directory / ".started").touch()
        tc.r.check_true(f"{label}: daemon {d.name} started", "its control socket", d.start_reply,
                        (d.pipe / "control").exists())


def daemon_env(d: "Daemon", **more: str) -> Dict[str, str]:
    """A client's environment for daemon d: its pipe and log, and CUDA_VISIBLE_DEVICES=0,
    which counts from the daemon's own list (its GPU). Without it PyTorch 2.11 counts the
    node's GPUs through NVML, CUDA under the daemon sees one, and the client dies at its
    first CUDA call (`device=1, num_gpus=1`, run x2-issue38-call1)."""
    return {"CUDA_MPS_PIPE_DIRECTORY": str(d.pipe), "CUDA_MPS_LOG_DIRECTORY": str(d.log),
            "CUDA_VISIBLE_DEVICES": "0", **more}


def exporter_for(tc: "TruthCheck", root: Path, port: int, name: str, extra: List[str] = ()) -> subprocess.Popen:
    """A `python3 -X faulthandler` exporter discovering the device-plugin root (no DRA claims)."""
    import discovery_phase as dp
    argv = [sys.executable, "-X", "faulthandler", *dp.exporter_args(tc.s.work / f"{name}-state.json", root,
                                                                     root / "no-dra", port), *extra]
    env = {k: v for k, v in tc.s.env.items() if not k.startswith("CUDA_MPS_")}
    return subprocess.Popen(argv, stdout=open(tc.s.work / f"{name}.log", "w"), stderr=subprocess.STDOUT, env=env,
                            cwd="/tmp")


def stop_process(p: Optional[subprocess.Popen]) -> Optional[int]:
    if p is None:
        return None
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    return p.returncode


def finish(tc: "TruthCheck", label: str, clients: List["Client"], daemons: List["Daemon"],
           exporter: Optional[subprocess.Popen]) -> None:
    import discovery_phase as dp
    kept = tc.s.work / (label.replace("[", "-").replace("]", "") + "-logs")
    kept.mkdir(parents=True, exist_ok=True)
    dp.tear_down(tc.s, tc.r, label, clients, daemons, kept, exporter)
    for d in daemons:  # one that did not answer quit: killed with its servers, none outlives the phase
        if control_daemon_pids(d.pipe):
            tc.r.facts[f"{label}: {d.name} still running after quit: killed"] = d.kill_daemon()


# ====================================================================== starts
def one_start(tc: "TruthCheck", i: int, port: int, root: Path) -> Dict[str, Any]:
    """Start an exporter, scrape it every 0.2 s for 10 s, stop it; a death if it exited first."""
    work = tc.s.work / "starts"
    err_path = work / f"exporter-{i}.err"
    import discovery_phase as dp
    argv = [sys.executable, "-X", "faulthandler", *dp.exporter_args(work / f"state-{i}.json", root, root / "no-dra",
                                                                     port)]
    env = {k: v for k, v in tc.s.env.items() if not k.startswith("CUDA_MPS_")}
    url = f"http://127.0.0.1:{port}/metrics"
    with open(work / f"exporter-{i}.out", "w") as out, open(err_path, "w") as err:
        p = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd="/tmp")
    t0 = time.monotonic()
    ok = failed = 0
    first_ok = None
    while time.monotonic() - t0 < START_SECONDS and p.poll() is None:
        tick = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                resp.read()
                good = resp.status == 200
        except Exception:  # refused before it listens, a timeout, a reset: not 200
            good = False
        if good:
            ok += 1
            first_ok = first_ok if first_ok is not None else time.monotonic() - t0
        else:
            failed += 1
        time.sleep(max(0.0, START_SCRAPE_EVERY - (time.monotonic() - tick)))
    rc = p.poll()  # not None: it exited before being stopped, a death
    stop_rc = stop_process(p) if rc is None else None
    run: Dict[str, Any] = {"start": i, "port": port, "rc": rc, "stop_rc": stop_rc, "ok": ok, "failed": failed,
                           "first_ok": first_ok, "seconds": round(time.monotonic() - t0, 2)}
    if rc is not None:
        run["stderr_tail"] = tail_lines(err_path.read_text(errors="replace"))
    return run


def phase_starts(tc: "TruthCheck") -> None:
    from truth_check import free_port
    s, r = tc.s, tc.r
    root = ROOT / "st"
    # A daemon per GPU, as the device plugin starts them: by index and, every other GPU, by UUID.
    uuids = [g.uuid for g in s.smi_gpus()]
    daemons = per_gpu_daemons(root, [str(g) if g % 2 == 0 else uuids[g] for g in range(s.gpus)])
    clients: List["Client"] = []
    (s.work / "starts").mkdir(parents=True, exist_ok=True)
    try:
        start_daemons(tc, "starts", daemons)
        for g, d in enumerate(daemons):  # one busy (GPM activity) and one idle client per GPU
            clients += [s.client(f"sts{g}_busy", 0.5, device=0, n=4096, env=daemon_env(d)),
                        s.client(f"sts{g}_idle", 0.25, device=0, n=64, idle=True, env=daemon_env(d))]
        late = s.wait_ready(clients, 90)
        r.check(f"starts: the {len(clients)} clients ready (2 per daemon)", [], [c.tag for c in late])
        r.facts["starts: servers per daemon"] = {d.name: d.servers() for d in daemons}
        ports: List[int] = []
        while len(ports) < STARTS:
            p = free_port()
            if p not in ports:
                ports.append(p)
        with concurrent.futures.ThreadPoolExecutor(STARTS_AT_ONCE) as pool:
            runs = list(pool.map(lambda i: one_start(tc, i, ports[i], root), range(STARTS)))
        summary = start_summary(runs)
        r.facts["starts: runs"] = runs
        r.facts["starts: summary"] = {k: v for k, v in summary.items() if k != "deaths"}
        r.check("starts: exporter deaths (exited before being stopped) of 20 starts", [],
                summary["deaths"], note=f"{summary['scrapes_200']} scrapes answered 200, "
                                       f"{summary['scrapes_other']} did not")
        r.check("starts: every start answered 200 within its 10 s", [], summary["never_answered"])
        r.check_true("starts: the clients still run (GPM had activity throughout)", [],
                     [c.tag for c in clients if c.proc.poll() is not None],
                     all(c.proc.poll() is None for c in clients))
    finally:
        finish(tc, "starts", clients, daemons, None)


# ====================================================================== cvdlimits
def _limits_seen(e: Optional["Exposition"], daemon: str, want: Dict[str, Dict[str, int]]) -> bool:
    """want: metric -> {gpu: value} (client series: keyed 'client:<pid>')."""
    if e is None:
        return False
    for key, expect in want.items():
        metric, _, pid = key.partition(":")
        labels = {"daemon": daemon, **({"pid": pid} if pid else {})}
        if by_gpu(e, metric, **labels) != expect:
            return False
    return True


def _queries(d: "Daemon", uuid: str, server: Optional[int]) -> Dict[str, str]:
    """The raw answers of the get_* commands by index and by UUID."""
    out = {"get_default_device_pinned_mem_limit 0": d.ctl("get_default_device_pinned_mem_limit 0"),
           f"get_default_device_pinned_mem_limit {uuid}": d.ctl(f"get_default_device_pinned_mem_limit {uuid}")}
    if server is not None:
        for key in ("0", uuid):
            out[f"get_device_pinned_mem_limit <server> {key}"] = d.ctl(f"get_device_pinned_mem_limit {server} {key}")
    return out


def _grown(tc: "TruthCheck", c: "Client") -> List[str]:
    return [tc.s.grow(c, i) for i in range(len(c.grow))]


def cvd_run(tc: "TruthCheck", mode: str, target: int = 1) -> None:
    """Per-GPU daemons on every GPU, CUDA_VISIBLE_DEVICES by `mode` ('index' or 'uuid'); the
    limits are set on the daemon of GPU `target` (its device 0), GPU 0's has none."""
    import discovery_phase as dp
    from truth_check import free_port
    s, r = tc.s, tc.r
    uuids = [g.uuid for g in s.smi_gpus()[:s.gpus]]
    visible = [str(g) for g in range(s.gpus)] if mode == "index" else uuids
    root = ROOT / ("cvi" if mode == "index" else "cvu")
    daemons = per_gpu_daemons(root, visible)
    d0, d1 = daemons[0], daemons[target]
    gpu = str(target)
    label = f"cvdlimits[{mode}, GPU {target}]" if s.gpus > 2 else f"cvdlimits[{mode}]"
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    exporter, clients = None, []
    uuid1 = uuids[target]
    try:
        start_daemons(tc, label, daemons)
        exporter = exporter_for(tc, root, port, f"exporter-cvd-{mode}-{target}", ["--mps.facts-refresh", "5"])
        # Discovery by process also finds the node's other daemons (churn.py's, beside it in run_x4.sh).
        names = {d.name for d in daemons}
        e = dp.wait_scrape(url, lambda e: names <= set(e.label_set("mps_control_daemon_up", "daemon")), 30)
        r.check_true(f"{label}: every daemon found", sorted(names),
                     sorted(names & set(e.label_set("mps_control_daemon_up", "daemon"))) if e else None, e is not None)
        # (a) the daemon's default set by index.
        r.facts[f"{label}: reply set_default_device_pinned_mem_limit 0 3G"] = d1.ctl(
            "set_default_device_pinned_mem_limit 0 3G")
        a = s.client(f"cv{mode[0]}_a", 0.5, device=0, idle=True, grow=[2.0, 3.5], env=daemon_env(d1))
        b = s.client(f"cv{mode[0]}_b", 0.5, device=0, idle=True, grow=[1.0, 2.5],
                     env=daemon_env(d1, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=2G"))
        z = s.client(f"cv{mode[0]}_gpu0", 0.5, device=0, idle=True, n=64, env=daemon_env(d0))
        clients += [a, b, z]
        late = s.wait_ready(clients, 90)
        r.check(f"{label}: clients ready", [], [c.tag for c in late])
        servers = d1.servers()
        r.facts[f"{label}: GPU {gpu} daemon's servers"] = servers
        r.facts[f"{label}: (a) answers after the set by index"] = _queries(d1, uuid1, servers[0] if servers else None)
        grown = {c.tag: _grown(tc, c) for c in (a, b)}
        r.facts[f"{label}: (a)(b) grow answers"] = grown
        r.check(f"{label}: (a) MPS held a client without its own setting to the 3G default (2 GiB OK, 3.5 refused)",
                ["OK", "FAIL"], [x.split()[0] if x else x for x in grown[a.tag]])
        r.check(f"{label}: (b) MPS held a client's own 0=2G on its device 0 (1 GiB OK, 2.5 refused)",
                ["OK", "FAIL"], [x.split()[0] if x else x for x in grown[b.tag]])
        want = {"mps_default_pinned_memory_limit_bytes": {gpu: 3 * GiB},
                "mps_server_pinned_memory_limit_bytes": {gpu: 3 * GiB},
                f"mps_client_pinned_memory_limit_bytes:{a.pid}": {gpu: 3 * GiB},
                f"mps_client_pinned_memory_limit_bytes:{b.pid}": {gpu: 2 * GiB}}
        time.sleep(SETTLE)
        e = dp.wait_scrape(url, lambda e: _limits_seen(e, d1.name, want), 15) or dp.wait_scrape(url, lambda e: True, 10)
        if e is not None:
            _check_limits(tc, f"{label}: (a)(b)", d1.name, e, want, gpu0_clean=True)
            r.facts[f"{label}: (a)(b) limit series"] = {m: [(x.labels, x.value) for x in e.series(m)]
                                                        for m in LIMIT_METRICS}
        else:
            r.check_true(f"{label}: (a)(b) the exporter answered", "a scrape", None, False)
        # (c) the DRA driver's form on a fresh daemon for GPU {gpu}.
        s.stop([a, b])
        r.facts[f"{label}: (c) quit the GPU {gpu} daemon"] = d1.quit()
        _wait(lambda: not control_daemon_pids(d1.pipe), 20)
        if control_daemon_pids(d1.pipe):
            r.facts[f"{label}: (c) GPU {gpu} daemon killed after quit"] = d1.kill_daemon()
            _wait(lambda: not control_daemon_pids(d1.pipe), 10)
        (d1.pipe / "control").unlink(missing_ok=True)
        r.facts[f"{label}: (c) start the GPU {gpu} daemon again"] = d1.start()
        r.check_true(f"{label}: (c) GPU {gpu} daemon started again", "its control socket", d1.start_reply,
                     (d1.pipe / "control").exists() and bool(control_daemon_pids(d1.pipe)))
        time.sleep(0.5)
        r.facts[f"{label}: (c) reply set_default_device_pinned_mem_limit {uuid1} 2048M"] = d1.ctl(
            f"set_default_device_pinned_mem_limit {uuid1} 2048M")
        c = s.client(f"cv{mode[0]}_c", 0.5, device=0, idle=True, grow=[1.0, 2.5], env=daemon_env(d1))
        clients.append(c)
        late = s.wait_ready([c], 90)
        r.check(f"{label}: (c) client ready", [], [x.tag for x in late])
        servers = d1.servers()
        r.facts[f"{label}: (c) answers after the set by UUID"] = _queries(d1, uuid1, servers[0] if servers else None)
        grown_c = _grown(tc, c)
        r.facts[f"{label}: (c) grow answers"] = grown_c
        r.check(f"{label}: (c) MPS held a client to the default set by UUID, 2048M (1 GiB OK, 2.5 refused)",
                ["OK", "FAIL"], [x.split()[0] if x else x for x in grown_c])
        want = {"mps_default_pinned_memory_limit_bytes": {gpu: 2 * GiB},
                "mps_server_pinned_memory_limit_bytes": {gpu: 2 * GiB},
                f"mps_client_pinned_memory_limit_bytes:{c.pid}": {gpu: 2 * GiB}}
        time.sleep(SETTLE)
        e = dp.wait_scrape(url, lambda e: _limits_seen(e, d1.name, want), 15) or dp.wait_scrape(url, lambda e: True, 10)
        if e is not None:
            _check_limits(tc, f"{label}: (c)", d1.name, e, want, gpu0_clean=True)
            r.facts[f"{label}: (c) limit series"] = {m: [(x.labels, x.value) for x in e.series(m)]
                                                     for m in LIMIT_METRICS}
        else:
            r.check_true(f"{label}: (c) the exporter answered", "a scrape", None, False)
    finally:
        finish(tc, label, clients, daemons, exporter)


def _check_limits(tc: "TruthCheck", label: str, daemon: str, e: "Exposition", want: Dict[str, Dict[str, int]],
                  gpu0_clean: bool) -> None:
    r = tc.r
    for key, expect in want.items():
        metric, _, pid = key.partition(":")
        labels = {"daemon": daemon, **({"pid": pid} if pid else {})}
        what = f"client {pid}" if pid else metric.replace("mps_", "").replace("_pinned_memory_limit_bytes", "")
        r.check(f"{label}: {metric}{{daemon={daemon}}} of {what} by physical GPU", expect, by_gpu(e, metric, **labels))
    if gpu0_clean:
        r.check(f"{label}: no pinned-limit series on gpu=\"0\" (none was set there)", [],
                [(m, x.labels) for m in LIMIT_METRICS for x in e.series(m, gpu="0")])


def cvd_targets(gpus: int) -> List[Tuple[str, int]]:
    """(mode, GPU) of each cvdlimits run: GPU 1 by index and by UUID on two GPUs; on more,
    GPU 2 by index and the last GPU by UUID (issue 45: GPUs 2 and 3 of four)."""
    if gpus <= 2:
        return [("index", 1), ("uuid", 1)]
    return [("index", 2), ("uuid", gpus - 1)]


def phase_cvdlimits(tc: "TruthCheck") -> None:
    for mode, target in cvd_targets(tc.s.gpus):
        try:
            cvd_run(tc, mode, target)
        except Exception as e:  # the next run goes on even if this one broke
            import traceback
            traceback.print_exc()
            tc.r.check_true(f"cvdlimits[{mode}, GPU {target}]: run completed", "no error",
                            f"{type(e).__name__}: {e}", False)


# ====================================================================== killdaemon
def phase_killdaemon(tc: "TruthCheck") -> None:
    import discovery_phase as dp
    from scrape import scrape
    from truth_check import free_port
    s, r = tc.s, tc.r
    root = ROOT / "kd"
    (d,) = per_gpu_daemons(root, ["0"])  # GPU 0's resource
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    exporter, clients = None, []
    try:
        start_daemons(tc, "killdaemon", [d])
        exporter = exporter_for(tc, root, port, "exporter-killdaemon")
        c = s.client("kd_client", 0.5, device=0, idle=True, n=64, env=daemon_env(d))
        clients.append(c)
        r.check("killdaemon: client ready", [], [x.tag for x in s.wait_ready([c], 90)])
        lists = d.client_lists()
        e = dp.wait_scrape(url, lambda e: bool(e.series("mps_server_info", daemon=d.name)) and
                           bool(e.series("mps_client_info", daemon=d.name)), 20)
        r.check_true("killdaemon: before the kill, the exporter shows the daemon's server and client",
                     {str(k): [str(p) for p in v] for k, v in lists.items()},
                     None if e is None else sorted(e.label_set("mps_client_info", "pid", daemon=d.name)),
                     e is not None and {str(p) for v in lists.values() for p in v} ==
                     e.label_set("mps_client_info", "pid", daemon=d.name))
        killed_at = time.monotonic()
        killed = d.kill_daemon()
        r.facts["killdaemon: SIGKILLed (daemon and servers)"] = killed
        samples: List[Dict[str, Any]] = []
        while time.monotonic() - killed_at < 10:
            t = time.monotonic() - killed_at
            try:
                x = scrape(url, timeout=5)
                samples.append({"t": round(t, 3), "status": 200, "seconds": round(x.seconds, 3),
                                "servers": sorted(x.label_set("mps_server_info", "server_pid", daemon=d.name)),
                                "clients": sorted(x.label_set("mps_client_info", "pid", daemon=d.name)),
                                "up": x.value("mps_control_daemon_up", daemon=d.name)})
            except Exception as err:
                samples.append({"t": round(t, 3), "status": repr(err)[:100], "servers": [], "clients": []})
            if len(samples) > 5 and gone_after(samples) is not None and t - gone_after(samples) > 1:
                break
            time.sleep(max(0.0, 0.1 - (time.monotonic() - killed_at - t)))
        gone = gone_after(samples)
        r.facts["killdaemon: scrapes after the kill"] = samples[:60]
        r.facts["killdaemon: seconds until server and client series left"] = gone
        r.check_true(f"killdaemon: the killed daemon's mps_server_info and mps_client_info leave /metrics within "
                     f"{VANISH_SECONDS:g} s", f"<= {VANISH_SECONDS:g} s", gone,
                     gone is not None and gone <= VANISH_SECONDS)
        r.check("killdaemon: the directory is still there (as the device plugin leaves it)", True, d.pipe.is_dir())
        r.facts["killdaemon: the orphaned client (still running, killed now)"] = c.proc.poll() is None
        c.proc.kill()
    finally:
        finish(tc, "killdaemon", clients, [d], exporter)


# ====================================================================== ceiling
def phase_ceiling(tc: "TruthCheck") -> None:
    s, r = tc.s, tc.r
    log = s.logdir / "server.log"
    since = log.stat().st_size if log.exists() else 0
    r.facts["ceiling: other compute apps on the GPUs at the start (nvidia-smi)"] = len(s.smi_apps())
    clients = [s.client(f"ceil_{i}", 0, device=0, n=64, idle=True,
                        env={"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_MAX_CONNECTIONS": "8"})
               for i in range(CEILING_CLIENTS)]
    try:
        late = s.wait_ready(clients, 120)
        admitted = [c for c in clients if c.is_ready()]
        time.sleep(SETTLE)
        lists = s.client_lists()
        listed = sorted(p for cs in lists.values() for p in cs)
        e = tc.scrape()
        mine = [srv for srv, cs in lists.items() if set(cs) & {c.pid for c in clients}]
        apps = s.smi_apps()
        gpu0 = s.smi_gpus()[0].uuid
        on_smi = sorted(pid for (u, pid) in apps if u == gpu0 and pid in {c.pid for c in clients})
        refusals = refusal_lines(log.read_text(errors="replace") if log.exists() else "", since)
        r.facts["ceiling: server.log refusal lines"] = refusals
        r.facts["ceiling: refused clients' output"] = {c.tag: c.text().strip()[-300:] for c in late[:4]}
        r.facts["ceiling: mps_server_client_limit series"] = [(x.labels, x.value)
                                                               for x in e.series("mps_server_client_limit")]
        r.facts["ceiling: mps_client_rejections_total series"] = [(x.labels, x.value)
                                                                  for x in e.series("mps_client_rejections_total")]
        r.facts["ceiling: admitted (ready) / listed / on nvidia-smi"] = [len(admitted), len(listed), len(on_smi)]
        r.check("ceiling: admitted clients = get_client_list = nvidia-smi", [len(admitted)] * 2,
                [len(listed), len(on_smi)])
        r.check_true(f"ceiling: MPS refused some of {CEILING_CLIENTS} (device connections)", f"< {CEILING_CLIENTS}",
                     len(admitted), 0 < len(admitted) < CEILING_CLIENTS)
        r.check_true("ceiling: server.log says 'Reached maximum number of device connections'", "a line",
                     refusals[:2], any("maximum number of device connections" in x for x in refusals))
        # MPS's own count: the clients it had made ACTIVE when it refused (run x2-issue38-call1:
        # 16 at every refusal; the 16th then failed its first allocation with CUDA OOM, 15 ran).
        text = log.read_text(errors="replace")[since:] if log.exists() else ""
        at_refusals = oracles.active_at_refusals(oracles.parse_log(text))
        r.facts["ceiling: clients ACTIVE in server.log at each refusal"] = at_refusals
        r.facts["ceiling: admitted clients that failed afterwards"] = [
            c.tag for c in clients if not c.is_ready() and "out of memory" in c.text()]
        if at_refusals:  # no refusal: no ceiling shown (the checks above fail)
            r.check("ceiling: mps_server_client_limit (of the clients' server) = clients MPS had admitted when "
                    "it refused (server.log)", at_refusals[-1], client_limit(e, mine[0] if mine else None))
    finally:
        s.stop(clients)
        s.shutdown_servers()


# ====================================================================== procdisc
def phase_procdisc(tc: "TruthCheck") -> None:
    """Issue 41: an exporter with its default flags (only its address and state file given)
    finds a daemon whose pipe directory no flag, file or layout names, by its process, within
    one re-scan (--mps.discover-interval, 5 s) of the daemon's start, and serves its client
    with nvidia-smi's memory."""
    import discovery_phase as dp
    from truth_check import free_port
    s, r = tc.s, tc.r
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    d = dp.Daemon("unnamed", ROOT / "unnamed")  # under ROOT: run_x2/x4.sh and the finish quit it
    shutil.rmtree(d.directory, ignore_errors=True)
    name = str(d.pipe)  # discovery names a daemon found by process by its pipe directory
    argv = [sys.executable, "-X", "faulthandler", "-m", "mps_exporter.cli", "serve",
            "--web.listen-address", f"127.0.0.1:{port}", "--mps.state-file", str(s.work / "procdisc-state.json")]
    env = {k: v for k, v in s.env.items() if not k.startswith("CUDA_MPS_")}
    exporter = subprocess.Popen(argv, stdout=open(s.work / "exporter-procdisc.log", "w"), stderr=subprocess.STDOUT,
                                env=env, cwd="/tmp")
    clients: List["Client"] = []
    try:
        before = dp.wait_scrape(url, lambda e: True, 30)
        r.check("procdisc: before its start, the daemon is not watched", [],
                [] if before is None else sorted(x for x in before.label_set("mps_control_daemon_up", "daemon")
                                                 if x == name))
        started = time.time()
        r.facts["procdisc: start"] = d.start()
        found = dp.wait_scrape(url, lambda e: e.value("mps_control_daemon_up", daemon=name) == 1, 30)
        r.facts["procdisc: seconds from the daemon's start to daemon_up 1"] = round(time.time() - started, 2)
        r.check_true("procdisc: found by its process within one re-scan (5 s; 1 s for the scrape)", "<= 6 s",
                     r.facts["procdisc: seconds from the daemon's start to daemon_up 1"],
                     found is not None and time.time() - started <= 6.0)
        c = s.client("pd_a", 0.5, env=daemon_env(d), idle=True)
        clients.append(c)
        r.check("procdisc: client ready", [], [x.tag for x in s.wait_ready(clients, 120)])
        smi = next((mib for (_, pid), mib in s.smi_apps().items() if pid == c.pid), None)

        def served(e: Any) -> Optional[float]:
            return next((x.value / oracles.MIB for x in e.series("mps_client_memory_used_bytes", daemon=name)
                         if x.labels["pid"] == str(c.pid)), None)

        # Settled: the background NVML reading trails the client's last allocation by a refresh.
        e = dp.wait_scrape(url, lambda e: smi is not None and served(e) == smi, 15)
        r.check("procdisc: its client served, memory = nvidia-smi (MiB)", smi, None if e is None else served(e))
    finally:
        finish(tc, "procdisc", clients, [d], exporter)


PHASES: Dict[str, Callable[["TruthCheck"], None]] = {
    name: _guarded(fn, name) for name, fn in (("starts", phase_starts), ("cvdlimits", phase_cvdlimits),
                                              ("killdaemon", phase_killdaemon), ("ceiling", phase_ceiling))}
PHASES["procdisc"] = lambda tc: (tc.phase("procdisc"), phase_procdisc(tc))[1]  # any node: one GPU is enough
