"""Truth-check phases of issue 24: the limit MPS really enforces, processes outside MPS,
priority and terminate_client. Each phase is a function of the running TruthCheck
(`truth_check.py --phases limitforms,threadvalues,outsider,priority,terminate,quit`).

Oracles: what MPS enforced as the client saw it (an allocation refused or not, the SM
count CUDA gives it, the rate of a busy kernel), nvidia-smi's process list, the control
daemon's replies and the logs; never the exporter's own code.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

from oracles import MIB

if TYPE_CHECKING:  # pragma: no cover
    from truth_check import Client, TruthCheck

GiB = 2**30
LOG_SETTLE = 1.0


def _settle() -> None:
    time.sleep(LOG_SETTLE)


def _uuid0(tc: "TruthCheck") -> str:
    return tc.s.smi_gpus()[0].uuid


# ------------------------------------------------------------------ limit forms
def phase_limitforms(tc: "TruthCheck") -> None:
    """Issue 24's table: each client holds 0.5 GiB, then tries to hold 2.5 GiB in all; a
    2 GiB limit makes that fail. No server or default limit is set, so what binds is
    the client's own variable or nothing."""
    tc.phase("limitforms")
    s, r = tc.s, tc.r
    uuid = _uuid0(tc)
    forms = {"ordinal": "0=2G", "ordinal_mib": "0=2048M", "uuid": f"{uuid}=2G", "uuid_prefix": f"{uuid[:12]}=2G",
             "invisible": "0=2G,1=4G", "bare": "2G"}
    # One GPU visible to each client, as in the issue (device 1 does not exist for it).
    clients = {name: s.client(f"lf_{name}", 0.5, idle=True, grow=[2.5],
                              env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": value, "CUDA_VISIBLE_DEVICES": "0"})
               for name, value in forms.items()}
    late = s.wait_ready(list(clients.values()), 90)
    r.facts["limitforms: clients not ready"] = [c.tag for c in late]
    grown = {name: s.grow(c, 0) for name, c in clients.items()}
    r.facts["limitforms: grow to 2.5 GiB"] = {forms[n]: g for n, g in grown.items()}
    _settle()
    e = tc.scrape()
    for name, c in clients.items():
        enforced = 2 * GiB if grown[name].startswith("FAIL") else None  # refused: 2 GiB binds; else none below 2.5
        pid = str(c.pid)
        got = e.value("mps_client_pinned_memory_limit_bytes", pid=pid, gpu="0")
        r.check(f"limitforms: {forms[name]!r}: mps_client_pinned_memory_limit_bytes = what MPS enforced "
                f"(2.5 GiB {'refused' if enforced else 'allowed'})", enforced, got)
        source = e.label_set("mps_client_limit_source", "pinned_memory", pid=pid)
        r.check(f"limitforms: {forms[name]!r}: limit source", ["client" if enforced else "none"], sorted(source))
        ignored = {x.labels["reason"] for x in e.series("mps_client_limit_ignored", pid=pid, limit="pinned_memory")}
        r.check_true(f"limitforms: {forms[name]!r}: ignored reason published exactly when MPS dropped the setting",
                     "a reason" if not enforced else "none", sorted(ignored), bool(ignored) == (enforced is None))
    s.stop(list(clients.values()))
    s.shutdown_servers()


# ------------------------------------------------------------------ thread values
def _rate(c: "Client") -> Optional[float]:
    """Kernels per second from the client's last line (`iters=N busy=S`)."""
    fields = dict(f.split("=", 1) for f in c.text().split() if "=" in f)
    try:
        return float(fields["iters"]) / float(fields["busy"])
    except (KeyError, ValueError, ZeroDivisionError):
        return None


def phase_threadvalues(tc: "TruthCheck", busy_seconds: float = 5.0) -> None:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20 (valid), `abc`, `150` and unset, one client at a
    time running 4096x4096 products: the SM count CUDA gives each and its rate are what MPS
    applied; the exporter's thread ratio must be that."""
    tc.phase("threadvalues")
    s, r = tc.s, tc.r
    values = {"unset": None, "valid20": "20", "abc": "abc", "150": "150"}
    measured: Dict[str, dict] = {}
    for name, value in values.items():
        env = {} if value is None else {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": value}
        c = s.client(f"tv_{name}", 0.25, n=4096, env=env)
        s.wait_ready([c], 60)
        _settle()
        e = tc.scrape()
        ratio = e.value("mps_client_active_thread_ratio", pid=str(c.pid))
        ignored = sorted(x.labels["reason"] for x in e.series("mps_client_limit_ignored", pid=str(c.pid)))
        time.sleep(busy_seconds)
        s.stop([c])
        fields = c.ready_fields()
        measured[name] = {"sms": int(fields[2]) if len(fields) > 2 else None, "rate": _rate(c), "exporter": ratio,
                          "ignored": ignored, "exit": c.proc.returncode, "output": c.text().strip()[-200:]}
    r.facts["threadvalues: per value (SMs CUDA gave, products/s, exporter ratio)"] = measured
    full = measured["unset"]["sms"]
    for name, m in measured.items():
        if m["sms"] is None or not full:
            r.check_true(f"threadvalues: {name}: client ran", "ready", m["output"], False)
            continue
        enforced = round(m["sms"] / full, 2)
        r.check(f"threadvalues: {name}: mps_client_active_thread_ratio = the SM share MPS gave "
                f"({m['sms']} of {full} SMs; {m['rate'] or 0:.0f} products/s against "
                f"{measured['unset']['rate'] or 0:.0f} unset)",
                enforced, None if m["exporter"] is None else round(m["exporter"], 2), tolerance=0.05)
    s.shutdown_servers()


# ------------------------------------------------------------------ outsider
def phase_outsider(tc: "TruthCheck") -> None:
    """With MPS serving a client, a process whose CUDA_MPS_PIPE_DIRECTORY reaches no daemon
    holds 1.4 GiB on the same GPU: nvidia-smi lists it; so must the exporter."""
    tc.phase("outsider")
    s, r = tc.s, tc.r
    inside = s.client("out_mps", 1, idle=True)
    s.wait_ready([inside], 60)
    nowhere = s.work / "no-daemon"
    nowhere.mkdir(exist_ok=True)
    outsider = s.client("out_outside", 1.4, idle=True, mps=False, env={"CUDA_MPS_PIPE_DIRECTORY": str(nowhere)})
    s.wait_ready([outsider], 60)
    _settle()
    lists, apps, gpus, e, stable = tc.stable_state()
    r.facts["outsider: nvidia-smi compute apps (uuid, pid) -> MiB"] = {f"{u[:12]} {p}": m for (u, p), m in apps.items()}
    uuid = gpus[0].uuid
    want = apps.get((uuid, outsider.pid))
    got = e.value("mps_process_outside_mps_memory_used_bytes", pid=str(outsider.pid), gpu="0")
    r.check_true("outsider: the process outside MPS is in nvidia-smi's list and not a client of the daemon",
                 True, [want, sorted(c for cs in lists.values() for c in cs)],
                 want is not None and outsider.pid not in {c for cs in lists.values() for c in cs})
    r.check("outsider: mps_process_outside_mps_memory_used_bytes = nvidia-smi (MiB, within 1)", want,
            None if got is None else got / MIB, tolerance=1.0)
    info = e.series("mps_process_outside_mps_info", pid=str(outsider.pid))
    r.check("outsider: mps_process_outside_mps_info names its pid and uid", [(str(outsider.pid), "0")],
            [(x.labels["pid"], x.labels["uid"]) for x in info])
    r.check("outsider: mps_gpu_processes_outside_mps", 1, e.value("mps_gpu_processes_outside_mps", gpu="0"))
    r.check("outsider: sharing mode", ["mixed"], sorted(e.label_set("mps_gpu_sharing_mode", "mode", gpu="0")))
    r.check("outsider: the MPS client is no outsider", [], [x.labels["pid"] for x in info if x.labels["pid"] ==
                                                             str(inside.pid)])
    expr = _alert_expr("MpsProcessOutsideMps")
    r.facts["outsider: MpsProcessOutsideMps expression"] = expr
    r.check("outsider: MpsProcessOutsideMps's expression (a selector of mps_process_outside_mps_info) returns it",
            [str(outsider.pid)], sorted(x.labels["pid"] for x in _select(e, expr)))
    r.check("outsider: no per-process SM utilization on a GPU MPS serves", [],
            sorted(e.label_set("mps_process_sm_utilization_ratio", "pid", gpu="0")))
    status = _status(tc)
    r.facts["outsider: mps-exporter status (GPU section)"] = status[:status.find("MPS daemon")][:1500]
    r.check_true("outsider: `mps-exporter status` names it under its GPU", f"process {outsider.pid} ... outside MPS",
                 status[:1500], f"process {outsider.pid} (" in status and "runs outside MPS" in status)
    s.stop([outsider, inside])
    s.shutdown_servers()


def _alert_expr(name: str) -> str:
    root = str(Path(__file__).resolve().parents[2])  # the checkout: its alerts package
    if root not in sys.path:
        sys.path.insert(0, root)
    from alerts import definitions

    return next(a.expr for a in definitions.ALERTS if a.alertname == name)


def _select(e, expr: str) -> list:
    """The series a plain selector `metric{job="mps-exporter"}` picks from one exporter's
    exposition (the job label is the scrape's, not the exporter's)."""
    metric = expr.split("{", 1)[0].strip()
    if not metric.isidentifier() or expr.strip() != f'{metric}{{job="mps-exporter"}}':
        raise ValueError(f"not a plain selector: {expr!r}")
    return e.series(metric)


# ------------------------------------------------------------------ priority
def phase_priority(tc: "TruthCheck") -> None:
    """`set_default_client_priority 1`, then a client without CUDA_MPS_CLIENT_PRIORITY: its new
    server logs `Server Priority set to 1` and the client runs at it."""
    tc.phase("priority")
    s, r = tc.s, tc.r
    s.shutdown_servers()
    r.facts["priority: replies"] = {
        "get_default_client_priority (before)": s.ctl("get_default_client_priority"),
        "set_default_client_priority 1": s.ctl("set_default_client_priority 1"),
        "get_default_client_priority (after)": s.ctl("get_default_client_priority")}
    c = s.client("prio_inherit", 0.5, idle=True)
    own = s.client("prio_own0", 0.5, idle=True, env={"CUDA_MPS_CLIENT_PRIORITY": "0"})
    s.wait_ready([c, own], 60)
    (srv,) = s.servers()
    logged = [x.text for x in s.server_log() if x.pid == srv and "Priority" in x.text]
    r.facts["priority: server.log"] = logged
    _settle()
    e = tc.scrape()
    r.check("priority: server.log says the server's priority", ["Server Priority set to 1"], logged)
    r.check("priority: mps_default_client_priority = get_default_client_priority", 1.0,
            e.value("mps_default_client_priority"))
    r.check("priority: mps_server_priority = 'Server Priority set to N'", 1.0,
            e.value("mps_server_priority", server_pid=str(srv)))
    r.check("priority: a client without CUDA_MPS_CLIENT_PRIORITY runs at its server's (1)", 1.0,
            e.value("mps_client_priority", pid=str(c.pid)))
    r.check("priority: its source", ["server_at_connect"],
            sorted(e.label_set("mps_client_limit_source", "priority", pid=str(c.pid))))
    r.check("priority: a client with CUDA_MPS_CLIENT_PRIORITY=0 runs at 0", 0.0,
            e.value("mps_client_priority", pid=str(own.pid)))
    s.stop([c, own])
    s.shutdown_servers()
    r.facts["priority: reset"] = s.ctl("set_default_client_priority 0")


# ------------------------------------------------------------------ terminate_client
def phase_terminate(tc: "TruthCheck") -> None:
    """An operator ends a client's GPU work with `terminate_client <server> <client>`."""
    tc.phase("terminate")
    s, r = tc.s, tc.r
    _settle()
    before = tc.scrape().value("mps_clients_terminated_total") or 0
    victim = s.client("term_victim", 0.5, n=2048)
    bystander = s.client("term_bystander", 0.5, idle=True)
    s.wait_ready([victim, bystander], 60)
    (srv,) = s.servers()
    r.facts["terminate: reply"] = s.ctl(f"terminate_client {srv} {victim.pid}")
    try:
        victim.proc.wait(30)  # it dies at its next CUDA call
    except subprocess.TimeoutExpired:
        pass
    r.facts["terminate: victim's output"] = victim.text().strip()[-400:]
    r.facts["terminate: server.log"] = [x.text for x in s.server_log() if x.pid == srv][-12:]
    _settle()
    e = tc.scrape()
    r.check("terminate: mps_clients_terminated_total went up by one", before + 1,
            e.value("mps_clients_terminated_total"))
    r.check("terminate: the bystander is still a client", [str(bystander.pid)],
            sorted(e.label_set("mps_client_info", "pid")))
    status = _status(tc)
    r.facts["terminate: mps-exporter status (EVENTS)"] = status[status.find("EVENTS"):][:1500]
    r.check_true("terminate: `mps-exporter status` lists the ended client", f"client ended ... {victim.pid}",
                 status[-600:], f"ended client {victim.pid}" in status)
    s.stop([bystander])
    s.shutdown_servers()


def _status(tc: "TruthCheck") -> str:
    argv = [sys.executable, "-m", "mps_exporter.cli", "status", "--mps.pipe-directory", str(tc.s.pipe),
            "--mps.log-directory", str(tc.s.logdir)]
    env = {k: v for k, v in tc.s.env.items() if not k.startswith("CUDA_MPS_")}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd="/tmp")
    return done.stdout + done.stderr


PHASES: Dict[str, Callable[["TruthCheck"], None]] = {
    "limitforms": phase_limitforms, "threadvalues": phase_threadvalues, "outsider": phase_outsider,
    "priority": phase_priority, "terminate": phase_terminate,
}
__all__: List[str] = ["PHASES"]
