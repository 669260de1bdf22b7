"""Truth-check phases of issue 40: clients that die of out of memory, and an Xid
(`truth_check.py --phases oomlimit,oomfull,nearclean,xid,quit`). One GPU is enough;
every client runs on the check's own daemon and CUDA device 0.

- `oomlimit`: a client held to 2 GiB by its own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G
  fills itself until NVML shows it at 95.5 % of the limit (gpu_client.py --fill-self-mib:
  NVML's per-client reading, which the exporter reads, counts the CUDA context too), waits
  SETTLE, a scrape takes that reading, then it asks for 1 GiB more and exits 3 on CUDA's
  out of memory (--exit-on-fail). Beside it a client at 0.5 GiB of the same limit exits
  normally. mps_client_exits_at_memory_limit_total must rise by exactly one,
  {reason="client_limit", outcome="failed"} on the client's GPU (nvidia-smi's), and not
  for the far client.
- `oomfull`: three idle fillers sized from nvidia-smi's total at run time, a victim
  (0.25 GiB), then a top-up that fills the GPU until NVML's used memory is 98 % of the
  total; the victim asks for more than remains and exits 3: exactly one
  {reason="device_full", outcome="failed"}. The top-up, then the fillers, exit normally:
  what the exporter counts for them (a normal exit on a still full GPU may count as
  device_full/clean) is a fact; the check is that none is `failed`.
- `nearclean`: a client at 96 % of its own 2 GiB limit exits normally (status 0): one
  {reason="client_limit", outcome="clean"}, never `failed`.
- `xid`: fatal.py (a kernel writing through a wild pointer) beside a bystander, as phase
  `fault`: mps_gpu_xid_errors_total rises on the GPU they ran on, by code, as an NVML event
  set of this script's own sees them (the oracle); every code one of NVIDIA's
  application Xids; mps_gpu_xid_events_registered 1 there; mps_fatal_gpu_errors_total +1;
  each code's mps_gpu_xid_last_seen_timestamp_seconds within 10 s of server.log's
  `encountered a fatal GPU error` line (the log's local time made Unix time with the
  clock offset measured on control.log in the phase). The kernel's Xid lines (dmesg) are
  a fact.

The exporter's exit tracker runs once per collection (a scrape), not on the background
NVML refresh: each phase scrapes after SETTLE with the client at its edge (its last
reading), then until the count moves. Every wait has a timeout; the phase's clients are
killed and the servers shut down at its end whatever failed.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from scrape import Exposition
    from truth_check import Client, TruthCheck

GiB, MIB = 2**30, 2**20
SETTLE = 3.0  # NVML read in the background every 1 s and served while at most 2 s old
LOG_SETTLE = 1.0
COUNT_WAIT = 15.0  # seconds a count may take to move after the exit (tracker: one collection, maybe two)
READY_WAIT = 120.0
EXIT_WAIT = 30.0
EXITS = "mps_client_exits_at_memory_limit_total"
LIMIT_ENV = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"}
LIMIT_BYTES = 2 * GiB
# The exporter's defaults: --mps.oom-margin-ratio, --mps.device-full-ratio.
MARGIN_RATIO, DEVICE_FULL_RATIO = 0.05, 0.97
OOMLIMIT_FILL, NEARCLEAN_FILL = 0.955, 0.96  # of the 2 GiB limit, as NVML reads the client
FULL_TARGET, FULL_MIN = 0.98, 0.975  # the top-up fills to FULL_TARGET; below FULL_MIN the phase says so
FILLERS = 3
CONTEXT_MIB = 600  # a generous PyTorch context under MPS (NVML: ~400 MiB, README lesson 7)
TOPUP_MIB = 3072  # left for the top-up client to fill adaptively
XID_WINDOW = 10.0
# NVIDIA's Xid catalogue: the codes an application's own error raises (not the GPU's).
APPLICATION_XIDS = {13: "graphics engine exception", 31: "GPU memory page fault (MMU fault)",
                    43: "GPU stopped processing", 45: "preemptive cleanup, due to previous errors",
                    68: "video processor exception", 69: "graphics engine class error",
                    94: "contained ECC error"}
ALERTED_XIDS = {13, 31, 43, 94}  # MpsGpuXidApplication's list (alerts/config.py): a fact, not a check


# ====================================================================== pure helpers (CI)
def exit_counts(e: "Exposition") -> Dict[Tuple[str, str, str], float]:
    """mps_client_exits_at_memory_limit_total by (gpu, reason, outcome), summed over daemons."""
    out: Dict[Tuple[str, str, str], float] = {}
    for x in e.series(EXITS):
        key = (x.labels.get("gpu", ""), x.labels.get("reason", ""), x.labels.get("outcome", ""))
        out[key] = out.get(key, 0.0) + x.value
    return out


def exit_key(gpu: str, reason: str, outcome: str) -> str:
    return f"gpu={gpu} reason={reason} outcome={outcome}"


def count_deltas(before: Dict[Tuple[str, str, str], float],
                 after: Dict[Tuple[str, str, str], float]) -> Dict[str, int]:
    """The rows that moved between two readings of exit_counts (a row new since is counted
    from 0), as {"gpu=G reason=R outcome=O": delta}."""
    out = {}
    for key in sorted(set(before) | set(after)):
        delta = after.get(key, 0.0) - before.get(key, 0.0)
        if delta:
            out[exit_key(*key)] = int(round(delta))
    return out


def failed_only(deltas: Dict[str, int]) -> Dict[str, int]:
    return {k: v for k, v in deltas.items() if k.endswith("outcome=failed")}


def outcomes(e: "Exposition") -> List[str]:
    """The outcomes the exporter has rows for: failed and clean where it asks the kernel."""
    return sorted({x.labels.get("outcome", "") for x in e.series(EXITS)})


def near_limit(used_bytes: Optional[float], limit_bytes: Optional[float], ratio: float = MARGIN_RATIO) -> bool:
    """Within `ratio` of the limit as the exporter rounds it (exits.Margins, written apart)."""
    if used_bytes is None or not limit_bytes:
        return False
    return limit_bytes - used_bytes <= math.ceil(limit_bytes * ratio)


def filler_sizes(total_mib: float, used_mib: float, fillers: int = FILLERS, target: float = FULL_TARGET,
                 context_mib: float = CONTEXT_MIB, topup_mib: float = TOPUP_MIB) -> List[float]:
    """GiB each idle filler holds: together, with the contexts of the fillers, the victim and
    the top-up, they bring the GPU to `target` of its total less `topup_mib`, which the
    top-up fills as NVML reads it. Rounded down to 1/64 GiB; [] where there is no room."""
    room = target * total_mib - used_mib - (fillers + 2) * context_mib - topup_mib
    if room <= 0 or fillers <= 0:
        return []
    each = math.floor(room / fillers / 16) / 64  # MiB -> GiB, down to 16 MiB
    return [each] * fillers if each > 0 else []


def victim_ask_gib(total_mib: float, full_min: float = FULL_MIN) -> float:
    """GiB more the victim of oomfull asks: past what a GPU filled to `full_min` can have left."""
    return float(math.ceil(total_mib * (1 - full_min) / 1024) + 1)


def clock_offset(raw_seconds: float) -> float:
    """The MPS logs' clock less Unix time: 0 on one machine with one time zone; a time
    zone apart (the daemon's TZ not ours) is a whole number of quarter hours."""
    return round(raw_seconds / 900.0) * 900.0


def log_unix(when: datetime, offset: float) -> float:
    """A log line's naive local time as Unix time."""
    return when.timestamp() - offset


def xid_counts(e: "Exposition") -> Dict[Tuple[str, str], float]:
    """mps_gpu_xid_errors_total by (gpu, xid)."""
    return {(x.labels.get("gpu", ""), x.labels.get("xid", "")): x.value for x in e.series("mps_gpu_xid_errors_total")}


def xid_deltas(before: Dict[Tuple[str, str], float], after: Dict[Tuple[str, str], float]) -> Dict[str, Dict[str, int]]:
    """{gpu: {xid: delta}} of the codes that rose."""
    out: Dict[str, Dict[str, int]] = {}
    for key in sorted(set(after)):
        delta = after[key] - before.get(key, 0.0)
        if delta:
            out.setdefault(key[0], {})[key[1]] = int(round(delta))
    return out


def oracle_counts(events: List[Dict[str, Any]]) -> Dict[str, Dict[str, int]]:
    """{gpu: {xid: n}} of the NVML events this script received itself."""
    out: Dict[str, Dict[str, int]] = {}
    for ev in events:
        gpu = out.setdefault(str(ev["gpu"]), {})
        gpu[str(ev["xid"])] = gpu.get(str(ev["xid"]), 0) + 1
    return out


_DMESG_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+),")


def dmesg_xids(text: str) -> List[Tuple[str, int]]:
    """(PCI bus id, code) of each kernel `NVRM: Xid (PCI:0000:18:00): 31, pid=...` line."""
    return [(m.group(1).lower(), int(m.group(2))) for m in _DMESG_XID.finditer(text)]


def fill_ok(fill: Optional[Dict[str, Any]]) -> bool:
    return bool(fill) and fill.get("stopped") == "target"


# ====================================================================== machine helpers
def gpu_of(tc: "TruthCheck", pid: int) -> Optional[str]:
    """nvidia-smi's index of the GPU where `pid` holds memory (compute-apps), None: none."""
    index = {g.uuid: str(g.index) for g in tc.s.smi_gpus()}
    found = sorted(index.get(uuid, "?") for (uuid, p) in tc.s.smi_apps() if p == pid)
    return found[0] if found else None


def smi_mib(tc: "TruthCheck", pid: int) -> Optional[int]:
    found = [mib for (_uuid, p), mib in tc.s.smi_apps().items() if p == pid]
    return sum(found) if found else None


def read_fill(c: "Client") -> Optional[Dict[str, Any]]:
    path = Path(f"{c.ready}.fill")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def scrape_until(tc: "TruthCheck", done: Callable[["Exposition"], bool], timeout: float,
                 step: float = 0.3) -> "Exposition":
    """Fresh scrapes (each one collection: the exit tracker runs in it) until `done` or `timeout`."""
    deadline = time.time() + timeout
    e = tc.scrape()
    while not done(e) and time.time() < deadline:
        time.sleep(step)
        e = tc.scrape()
    return e


def wait_exit(c: "Client", timeout: float = EXIT_WAIT) -> Optional[int]:
    try:
        return c.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def settled_scrape(tc: "TruthCheck") -> "Exposition":
    time.sleep(LOG_SETTLE)
    return tc.scrape()


def gone(e: "Exposition", pids: List[int]) -> bool:
    listed = e.label_set("mps_client_info", "pid") | e.label_set("mps_client_memory_used_bytes", "pid")
    return not ({str(p) for p in pids} & listed)


def check_exit_status_known(tc: "TruthCheck", label: str, e: "Exposition") -> None:
    tc.r.check(f"{label}: the exporter asks the kernel how clients end (rows for outcome failed and clean, "
               "none unknown)", ["clean", "failed"], outcomes(e),
               note="outcome=unknown only: no proc connector (see the exporter.log line 'exit status of MPS "
                    "clients unknown')")


def near_state(tc: "TruthCheck", label: str, c: "Client", gpu: str, e: "Exposition") -> Dict[str, Any]:
    """What the exporter and nvidia-smi read of client `c` now, as facts."""
    pid = str(c.pid)
    state = {"nvidia_smi_mib": smi_mib(tc, c.pid),
             "exporter_used_mib": _mib(e.value("mps_client_memory_used_bytes", pid=pid, gpu=gpu)),
             "exporter_limit_mib": _mib(e.value("mps_client_pinned_memory_limit_bytes", pid=pid, gpu=gpu)),
             "exporter_peak_mib": _mib(e.value("mps_client_memory_peak_bytes", pid=pid, gpu=gpu)),
             "fill": read_fill(c)}
    tc.r.facts[f"{label}: {c.tag} at its edge (MiB)"] = state
    return state


def _mib(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v / MIB, 2)


def _phase(name: str, body: Callable[["TruthCheck"], None]) -> Callable[["TruthCheck"], None]:
    """The phase under its name; its clients killed and the servers shut down at its end."""
    def run(tc: "TruthCheck") -> None:
        tc.phase(name)
        first = len(tc.s.clients)
        try:
            body(tc)
        finally:
            mine = tc.s.clients[first:]
            left = [c.tag for c in mine if c.proc.poll() is None]
            if left:
                tc.r.facts[f"{name}: clients still running at its end (killed)"] = left
            for c in mine:
                if c.proc.poll() is None:
                    c.proc.kill()
            for c in mine:
                wait_exit(c, 10)
            try:
                tc.s.shutdown_servers()
            except Exception as err:  # the next phase starts a server of its own anyway
                tc.r.facts[f"{name}: shutdown_servers failed"] = repr(err)
    return run


# ====================================================================== oomlimit
def phase_oomlimit(tc: "TruthCheck") -> None:
    s, r = tc.s, tc.r
    e0 = settled_scrape(tc)
    check_exit_status_known(tc, "oomlimit", e0)
    base = exit_counts(e0)
    fill_mib = OOMLIMIT_FILL * LIMIT_BYTES / MIB
    victim = s.client("ol_victim", 1.0, idle=True, n=64, env=dict(LIMIT_ENV), grow=[1.0],
                      extra=["--grow-relative", "--exit-on-fail", "--fill-self-mib", f"{fill_mib:.0f}"])
    far = s.client("ol_far", 0.5, idle=True, n=64, env=dict(LIMIT_ENV))
    late = s.wait_ready([victim, far], READY_WAIT)
    r.check("oomlimit: clients ready", [], [c.tag for c in late])
    if late:
        r.facts["oomlimit: outputs of the clients not ready"] = {c.tag: c.text().strip()[-600:] for c in late}
        return
    gpu = gpu_of(tc, victim.pid) or "0"
    time.sleep(SETTLE)
    e_near = tc.scrape()  # the exit tracker's last reading of the victim: at its edge
    state = near_state(tc, "oomlimit", victim, gpu, e_near)
    near_state(tc, "oomlimit", far, gpu, e_near)
    fill = state["fill"]
    r.check_true(f"oomlimit: the victim filled itself to {OOMLIMIT_FILL:.1%} of 2 GiB as NVML reads it",
                 f">= {fill_mib:.0f} MiB", fill, fill_ok(fill),
                 note="stopped 'brim': the limit refused first (MPS counts more than NVML's reading)")
    r.check("oomlimit: exporter's limit of the victim = its own 0=2G", LIMIT_BYTES,
            e_near.value("mps_client_pinned_memory_limit_bytes", pid=str(victim.pid), gpu=gpu))
    r.check("oomlimit: exporter's memory of the victim = nvidia-smi (MiB, within 1)", state["nvidia_smi_mib"],
            state["exporter_used_mib"], tolerance=1.0)
    used = e_near.value("mps_client_memory_used_bytes", pid=str(victim.pid), gpu=gpu)
    r.check_true(f"oomlimit: the exporter read the victim within {MARGIN_RATIO:.0%} of its limit before it grew",
                 f">= {LIMIT_BYTES * (1 - MARGIN_RATIO) / MIB:.1f} MiB", _mib(used), near_limit(used, LIMIT_BYTES))
    far_used = e_near.value("mps_client_memory_used_bytes", pid=str(far.pid), gpu=gpu)
    r.check_true("oomlimit: the far client is far from its limit (exporter)", "< 95 % of 2 GiB", _mib(far_used),
                 far_used is not None and not near_limit(far_used, LIMIT_BYTES))
    answer = s.grow(victim, 0, timeout=60)
    rc = wait_exit(victim)
    text = victim.text()
    r.facts["oomlimit: the victim's answer to 1 GiB more"] = answer
    r.facts["oomlimit: the victim's output"] = text.strip()[-800:]
    r.check("oomlimit: the victim died of CUDA out of memory (exit 3, grow FAIL, 'out of memory' in its output)",
            [3, "FAIL", True], [rc, answer.split()[0] if answer else answer, "out of memory" in text.lower()])
    want = {exit_key(gpu, "client_limit", "failed"): 1}
    e1 = scrape_until(tc, lambda e: count_deltas(base, exit_counts(e)) == want, COUNT_WAIT)
    after_victim = exit_counts(e1)
    s.stop([far])
    r.check("oomlimit: the far client exited normally (status 0)", 0, far.proc.returncode)
    scrape_until(tc, lambda e: gone(e, [far.pid]), COUNT_WAIT)
    time.sleep(SETTLE)
    e_end = tc.scrape()
    r.check("oomlimit: exits at the memory limit counted: the victim once, client_limit/failed on its GPU "
            "(nvidia-smi's), nothing else", want, count_deltas(base, exit_counts(e_end)))
    r.check("oomlimit: the far client's normal exit counted nowhere", {},
            count_deltas(after_victim, exit_counts(e_end)))


# ====================================================================== oomfull
def phase_oomfull(tc: "TruthCheck") -> None:
    s, r = tc.s, tc.r
    e0 = settled_scrape(tc)
    check_exit_status_known(tc, "oomfull", e0)
    base = exit_counts(e0)
    g0 = s.smi_gpus()[0]
    sizes = filler_sizes(g0.memory_total_mib, g0.memory_used_mib)
    ask = victim_ask_gib(g0.memory_total_mib)
    r.facts["oomfull: nvidia-smi GPU 0 total / used at the start (MiB); fillers (GiB); victim asks (GiB more)"] = [
        g0.memory_total_mib, g0.memory_used_mib, sizes, ask]
    if not sizes:
        r.check_true("oomfull: room for the fillers", "> 0 GiB each", sizes, False)
        return
    fillers = [s.client(f"of_fill{i}", gib, idle=True, n=64) for i, gib in enumerate(sizes)]
    victim = s.client("of_victim", 0.25, idle=True, n=64, grow=[ask], extra=["--grow-relative", "--exit-on-fail"])
    late = s.wait_ready([*fillers, victim], READY_WAIT + 60)
    topup = None
    if not late:
        topup = s.client("of_topup", 0, idle=True, n=64, extra=["--fill-gpu-ratio", str(FULL_TARGET)])
        late = s.wait_ready([topup], READY_WAIT)
    r.check("oomfull: fillers, victim and top-up ready", [], [c.tag for c in late])
    if late or topup is None:
        r.facts["oomfull: outputs of the clients not ready"] = {c.tag: c.text().strip()[-600:] for c in late}
        return
    r.facts["oomfull: the top-up's fill"] = read_fill(topup)
    gpu = gpu_of(tc, victim.pid) or "0"
    time.sleep(SETTLE)
    e_full = tc.scrape()  # every client's last reading: on a full GPU
    smi = {str(g.index): g for g in s.smi_gpus()}[gpu]
    lab = {"gpu": gpu, "uuid": smi.uuid}
    exp_used, exp_total = e_full.value("mps_gpu_memory_used_bytes", **lab), e_full.value("mps_gpu_memory_total_bytes", **lab)
    r.facts["oomfull: GPU used / total when full (nvidia-smi MiB, exporter MiB)"] = [
        smi.memory_used_mib, smi.memory_total_mib, _mib(exp_used), _mib(exp_total)]
    r.facts["oomfull: nvidia-smi compute apps when full (pid: MiB)"] = {
        str(pid): mib for (uuid, pid), mib in s.smi_apps().items() if uuid == smi.uuid}
    r.check_true(f"oomfull: nvidia-smi: the GPU at least {FULL_MIN:.1%} full", f">= {FULL_MIN}",
                 round(smi.memory_used_mib / smi.memory_total_mib, 4),
                 smi.memory_used_mib >= FULL_MIN * smi.memory_total_mib)
    r.check_true(f"oomfull: the exporter read the GPU at least {DEVICE_FULL_RATIO:.0%} full (its device_full edge)",
                 f">= {DEVICE_FULL_RATIO}", None if not exp_used or not exp_total else round(exp_used / exp_total, 4),
                 bool(exp_used and exp_total and exp_used >= DEVICE_FULL_RATIO * exp_total))
    r.check("oomfull: exporter's GPU memory used = nvidia-smi (MiB, within 2)", smi.memory_used_mib, _mib(exp_used),
            tolerance=2.0)
    free_mib = smi.memory_total_mib - smi.memory_used_mib
    r.check_true("oomfull: the victim asks for more than remains (nvidia-smi)", f"> {free_mib} MiB", ask * 1024,
                 ask * 1024 > free_mib)
    answer = s.grow(victim, 0, timeout=60)
    rc = wait_exit(victim)
    text = victim.text()
    r.facts["oomfull: the victim's answer"] = answer
    r.facts["oomfull: the victim's output"] = text.strip()[-800:]
    r.check("oomfull: the victim died of CUDA out of memory (exit 3, grow FAIL, 'out of memory' in its output)",
            [3, "FAIL", True], [rc, answer.split()[0] if answer else answer, "out of memory" in text.lower()])
    want = {exit_key(gpu, "device_full", "failed"): 1}
    e1 = scrape_until(tc, lambda e: count_deltas(base, exit_counts(e)) == want, COUNT_WAIT)
    r.check("oomfull: the victim counted once, device_full/failed on its GPU (nvidia-smi's)", want,
            count_deltas(base, exit_counts(e1)))
    # The top-up first (it leaves the GPU below full), then the fillers, each exit seen by a scrape.
    for group in ([topup], fillers):
        s.stop(group)
        pids = [c.pid for c in group]
        scrape_until(tc, lambda e, pids=pids: gone(e, pids), COUNT_WAIT)
        time.sleep(SETTLE)
        tc.scrape()
    e_end = tc.scrape()
    r.facts["oomfull: exit statuses of the top-up and fillers"] = {c.tag: c.proc.returncode for c in [topup, *fillers]}
    r.facts["oomfull: counts after the victim, the top-up and the fillers exited (deltas)"] = count_deltas(
        base, exit_counts(e_end))
    r.facts["oomfull: counted for the normal exits (top-up and fillers; device_full/clean where the GPU was "
            "still full at their last reading)"] = count_deltas(exit_counts(e1), exit_counts(e_end))
    r.check("oomfull: the normal exits were never counted failed (only the victim is)", want,
            failed_only(count_deltas(base, exit_counts(e_end))))


# ====================================================================== nearclean
def phase_nearclean(tc: "TruthCheck") -> None:
    s, r = tc.s, tc.r
    e0 = settled_scrape(tc)
    check_exit_status_known(tc, "nearclean", e0)
    base = exit_counts(e0)
    fill_mib = NEARCLEAN_FILL * LIMIT_BYTES / MIB
    c = s.client("nc_near", 1.0, idle=True, n=64, env=dict(LIMIT_ENV), extra=["--fill-self-mib", f"{fill_mib:.0f}"])
    late = s.wait_ready([c], READY_WAIT)
    r.check("nearclean: client ready", [], [x.tag for x in late])
    if late:
        r.facts["nearclean: output of the client"] = c.text().strip()[-600:]
        return
    gpu = gpu_of(tc, c.pid) or "0"
    time.sleep(SETTLE)
    e_near = tc.scrape()
    state = near_state(tc, "nearclean", c, gpu, e_near)
    r.check_true(f"nearclean: the client filled itself to {NEARCLEAN_FILL:.0%} of 2 GiB as NVML reads it",
                 f">= {fill_mib:.0f} MiB", state["fill"], fill_ok(state["fill"]))
    r.check("nearclean: exporter's memory of the client = nvidia-smi (MiB, within 1)", state["nvidia_smi_mib"],
            state["exporter_used_mib"], tolerance=1.0)
    used = e_near.value("mps_client_memory_used_bytes", pid=str(c.pid), gpu=gpu)
    r.check_true(f"nearclean: the exporter read the client within {MARGIN_RATIO:.0%} of its 2 GiB limit",
                 f">= {LIMIT_BYTES * (1 - MARGIN_RATIO) / MIB:.1f} MiB", _mib(used), near_limit(used, LIMIT_BYTES))
    s.stop([c])
    r.check("nearclean: the client exited normally (status 0)", 0, c.proc.returncode)
    want = {exit_key(gpu, "client_limit", "clean"): 1}
    scrape_until(tc, lambda e: count_deltas(base, exit_counts(e)) != {}, COUNT_WAIT)
    time.sleep(SETTLE)
    deltas = count_deltas(base, exit_counts(tc.scrape()))
    r.check("nearclean: counted once as client_limit/clean on its GPU", want, deltas)
    r.check("nearclean: never as failed", {}, failed_only(deltas))


# ====================================================================== xid
class NvmlXids:
    """The oracle: this script's own NVML event set, every GPU registered for Xid events,
    waited on in a thread (0.5 s per wait) until stop()."""

    def __init__(self) -> None:
        self.events: List[Dict[str, Any]] = []
        self.registered: Dict[str, Any] = {}
        self.error = ""
        self._stop = threading.Event()
        self._set_up = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, timeout: float = 15.0) -> bool:
        self._thread = threading.Thread(target=self._run, name="oracle-xid", daemon=True)
        self._thread.start()
        return self._set_up.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception as e:
            self.error = f"NVML: {e}"
            self._set_up.set()
            return
        event_set = None
        try:
            kind = getattr(pynvml, "nvmlEventTypeXidCriticalError", 0x8)
            event_set = pynvml.nvmlEventSetCreate()
            for i in range(pynvml.nvmlDeviceGetCount()):
                try:
                    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(i), kind, event_set)
                    self.registered[str(i)] = True
                except pynvml.NVMLError as e:
                    self.registered[str(i)] = str(e)
            self._set_up.set()
            while not self._stop.is_set():
                try:
                    data = pynvml.nvmlEventSetWait_v2(event_set, 500)
                except pynvml.NVMLError as e:
                    if e.value == pynvml.NVML_ERROR_TIMEOUT:
                        continue
                    self.error = f"wait: {e}"
                    return
                if int(data.eventType) & kind:
                    self.events.append({"t": time.time(), "gpu": int(pynvml.nvmlDeviceGetIndex(data.device)),
                                        "xid": int(data.eventData)})
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._set_up.set()
            try:
                if event_set is not None:
                    pynvml.nvmlEventSetFree(event_set)
                pynvml.nvmlShutdown()
            except Exception:
                pass


def measure_clock_offset(tc: "TruthCheck") -> Tuple[Optional[float], float]:
    """(raw, offset): control.log's time of our own `Cmd:get_server_list` less the Unix time
    we sent it (the exporter sends commands only when scraped: none between)."""
    n0 = len(tc.s.control_log())
    sent = time.time()
    tc.s.ctl("get_server_list")
    line = None
    deadline = time.time() + 5
    while line is None and time.time() < deadline:
        line = next((x for x in tc.s.control_log()[n0:] if x.text.startswith("Cmd:get_server_list")), None)
        if line is None:
            time.sleep(0.1)
    if line is None:
        return None, 0.0
    raw = line.time.timestamp() - sent
    return round(raw, 3), clock_offset(raw)


def dmesg() -> str:
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(dmesg: {e})"


def phase_xid(tc: "TruthCheck") -> None:
    s, r = tc.s, tc.r
    oracle = NvmlXids()
    try:
        started = oracle.start()
        r.facts["xid: the oracle's NVML event set (registered per GPU, error)"] = [oracle.registered, oracle.error]
        raw, offset = measure_clock_offset(tc)
        r.facts["xid: clock offset of the MPS logs (raw s, applied s), time zone"] = [raw, offset,
                                                                                      time.strftime("%z %Z")]
        dmesg0 = set(dmesg().splitlines())
        bystander = s.client("x_bystander", 1)
        late = s.wait_ready([bystander], READY_WAIT)
        r.check("xid: bystander ready", [], [c.tag for c in late])
        if late:
            r.facts["xid: output of the bystander"] = bystander.text().strip()[-600:]
            return
        gpu = gpu_of(tc, bystander.pid) or "0"
        e0 = settled_scrape(tc)
        xid0, fatal0 = xid_counts(e0), e0.value("mps_fatal_gpu_errors_total") or 0
        lines0 = len(s.server_log())
        r.check(f"xid: mps_gpu_xid_events_registered = 1 on GPU {gpu} (the clients' GPU, nvidia-smi)", 1,
                e0.value("mps_gpu_xid_events_registered", gpu=gpu))
        r.check_true("xid: the oracle's event set registered the GPU", True, oracle.registered.get(gpu),
                     started and oracle.registered.get(gpu) is True)
        n_oracle = len(oracle.events)
        fatal = s.run_script("x_fatal", "fatal.py")
        fatal_rc = wait_exit(fatal, 120)
        by_rc = wait_exit(bystander, EXIT_WAIT)
        r.facts["xid: output of fatal.py"] = fatal.text().strip()[-600:]
        r.facts["xid: output of the bystander"] = bystander.text().strip()[-600:]
        r.facts["xid: exit statuses (fatal.py, bystander)"] = [fatal_rc, by_rc]

        def seen(e: "Exposition") -> bool:
            return bool(xid_deltas(xid0, xid_counts(e))) and (e.value("mps_fatal_gpu_errors_total") or 0) > fatal0
        scrape_until(tc, seen, COUNT_WAIT)
        time.sleep(SETTLE)  # an Xid that follows the first (43 after 31, 45) is in the final scrape
        e = tc.scrape()
        time.sleep(0.5)
        oracle.stop()
        xid_checks(tc, gpu, e, xid0, fatal0, oracle.events[n_oracle:], s.server_log()[lines0:], offset)
        new_kernel = "\n".join(line for line in dmesg().splitlines() if line not in dmesg0)
        r.facts["xid: the kernel's new Xid lines (dmesg)"] = [line for line in new_kernel.splitlines()
                                                              if "Xid" in line][:10] or new_kernel[:300]
        r.facts["xid: the kernel's Xid codes (PCI bus, code)"] = dmesg_xids(new_kernel)
        r.facts["xid: nvidia-smi bus ids"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"], capture_output=True, text=True,
            timeout=30).stdout.strip().splitlines()
    finally:
        oracle.stop()


def xid_checks(tc: "TruthCheck", gpu: str, e: "Exposition", xid0: Dict[Tuple[str, str], float], fatal0: float,
               events: List[Dict[str, Any]], new_lines: List[Any], offset: float) -> None:
    """The xid phase's comparisons: the exporter's Xids against the oracle's events and
    server.log's fatal error line (after the fault: `e`, the oracle's `events`, the log's
    `new_lines`)."""
    r = tc.r
    r.facts["xid: server.log lines"] = [f"{x.time:%H:%M:%S.%f} {x.text}" for x in new_lines][:40]
    r.facts["xid: the oracle's Xid events (unix time, GPU, code)"] = events
    exp = xid_deltas(xid0, xid_counts(e))
    r.facts["xid: exporter's mps_gpu_xid_errors_total deltas {gpu: {xid: n}}"] = exp
    r.check_true(f"xid: mps_gpu_xid_errors_total rose on GPU {gpu} only", [gpu], sorted(exp), set(exp) == {gpu})
    r.check("xid: the exporter's Xids by GPU and code = the oracle's NVML event set", oracle_counts(events), exp)
    codes = sorted(int(c) for c in exp.get(gpu, {}) if c.isdigit())
    r.facts["xid: the fault's Xid codes (NVIDIA's names; in MpsGpuXidApplication's list)"] = {
        str(c): [APPLICATION_XIDS.get(c, "not an application Xid"), c in ALERTED_XIDS] for c in codes}
    r.check_true("xid: every code is one of NVIDIA's application Xids", sorted(APPLICATION_XIDS), codes,
                 bool(codes) and set(codes) <= set(APPLICATION_XIDS))
    reports = oracles_fatal_reports(new_lines)
    r.check("xid: fatal error reports in server.log (the fault)", 1, len(reports))
    r.check("xid: mps_fatal_gpu_errors_total delta = 1", 1, (e.value("mps_fatal_gpu_errors_total") or 0) - fatal0)
    if not reports:
        return
    at = log_unix(reports[0].time, offset)
    last = {c: e.value("mps_gpu_xid_last_seen_timestamp_seconds", gpu=gpu, xid=str(c)) for c in codes}
    apart = {str(c): None if t is None else round(t - at, 3) for c, t in last.items()}
    r.facts["xid: server.log's fatal line (local, unix)"] = [f"{reports[0].time:%Y-%m-%d %H:%M:%S.%f}", at]
    r.facts["xid: oracle events less the fatal line (s)"] = [round(ev["t"] - at, 3) for ev in events]
    r.check_true(f"xid: each code's mps_gpu_xid_last_seen_timestamp_seconds within {XID_WINDOW:g} s of "
                 "server.log's fatal GPU error line (MpsFatalGpuError's event)", f"|s| <= {XID_WINDOW:g}", apart,
                 bool(apart) and all(v is not None and abs(v) <= XID_WINDOW for v in apart.values()))


def oracles_fatal_reports(lines: List[Any]) -> List[Any]:
    """server.log's `Client {...} encountered a fatal GPU error.` lines (oracles.fatal_error_reports's)."""
    return [x for x in lines if "encountered a fatal GPU error" in x.text]


PHASES: Dict[str, Callable[["TruthCheck"], None]] = {
    name: _phase(name, fn) for name, fn in (("oomlimit", phase_oomlimit), ("oomfull", phase_oomfull),
                                            ("nearclean", phase_nearclean), ("xid", phase_xid))}
