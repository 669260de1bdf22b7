"""A NodeStatus as a readable report: lines of plain ASCII, each with a style.

The style ("title", "heading", "alert" or "") lets the watch screen set headings
in bold and what went wrong in reverse video; printed, the lines are plain text.
"""

from __future__ import annotations

import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .view import EVENT_COUNTERS, ClientStatus, DaemonStatus, EdgeExitStatus, Event, GpuStatus, NodeStatus, ServerStatus, XidStatus

Line = Tuple[str, str]  # (text, style)
TITLE, HEADING, ALERT, PLAIN = "title", "heading", "alert", ""

WIDTH = 100  # where the totals wrap; tables and events keep a line per row
# An MPS fatal GPU error logged this close to a GPU's Xid (either side) is listed beside
# it: the kernel, NVML and MPS each stamp the same fault with their own clock and delay.
XID_NEAR_SECONDS = 60.0
_EVENT_NAMES = {"fatal_gpu_error": "fatal GPU error", "handoff": "handoff", "start_failure": "start failure",
                "exit_with_clients": "server died", "client_rejected": "client refused",
                "left_queue": "left the queue", "client_terminated": "client ended"}


def report(st: NodeStatus) -> List[Line]:
    lines: List[Line] = [(f"mps-exporter status: {st.origin}", TITLE),
                         (f"at {_datetime(st.time)} UTC", PLAIN)]
    sources = ", ".join(f"{s.name} {'ok' if s.ok else 'FAILED'}" for s in st.sources)
    lines.append((f"sources: {sources or 'none enabled'}", PLAIN))
    if st.sources:
        ages = ", ".join(f"{s.name} {'none' if s.age_seconds is None else f'{s.age_seconds:.1f} s'}" for s in st.sources)
        lines.append((f"reading ages: {ages}", PLAIN))
    lines += [(f"! {s.name} failed: {s.error or 'no reason given'}", ALERT) for s in st.sources if not s.ok]
    lines += _gpus(st)
    lines += _xids(st)
    for d in st.daemons:
        lines += _daemon(d, st.time)
    return lines


def plain(lines: Sequence[Line]) -> str:
    return "".join(text + "\n" for text, _ in lines)


# ---------------------------------------------------------------- GPUs
def _gpus(st: NodeStatus) -> List[Line]:
    if not st.gpus:
        nvml = next((s for s in st.sources if s.name == "nvml"), None)
        why = "not read (nvml collector off)" if nvml is None else ("unknown: NVML failed" if not nvml.ok else "none")
        return [("", PLAIN), (f"GPUs: {why}", HEADING)]
    out: List[Line] = []
    for g in st.gpus:
        out += [("", PLAIN), (f"GPU {g.index}  {g.name or '?'}  {g.uuid}", HEADING)]
        if not g.up:
            out.append(("  ! NVML did not answer for this GPU", ALERT))
            continue
        facts, activity = _gpu_facts(g)
        out.append(("  " + " | ".join(facts), PLAIN))
        if activity:
            out.append(("  activity: " + " | ".join(activity), PLAIN))
        for p in g.outside_mps:
            where = f", pod {p.pod}" if p.pod else ""
            out.append((f"  ! process {p.pid} ({p.command}, user {p.user}{where}) runs outside MPS: "
                        f"{_memory(p.memory_bytes, None)}, no MPS limit binds it", ALERT))
    return out


def _xids(st: NodeStatus) -> List[Line]:
    """Each GPU's Xids, newest first, with the fatal GPU errors the MPS logs recorded near
    the time of each (the server, and the clients MPS names as left with a sticky error):
    who was hit when the GPU reported it. NVML's events carry no process; the logs do."""
    out: List[Line] = []
    fatal = [(d.name, e) for d in st.daemons for e in d.events or [] if e.kind == "fatal_gpu_error"]
    for g in st.gpus:
        if g.xid_events_registered is False:
            out += [("", PLAIN), (f"GPU {g.index}: ! NVML refused to register its Xid events: its Xid errors are "
                                  "not counted", ALERT)]
        if not g.xids:
            continue
        out += [("", PLAIN), (f"XID ERRORS of GPU {g.index} (since the exporter started, from NVML's events)",
                              HEADING)]
        for x in g.xids:
            out.append((f"  Xid {x.xid:<6} {x.count:.0f} time(s), last " + _when(x, st.time), ALERT))
            for daemon, e in _near(x, fatal):
                clients = " ".join(map(str, e.clients)) or "none named"
                out.append((f"    {_datetime(e.time, millis=True)}  fatal GPU error in the MPS logs "
                            f"({e.time - (x.last_seen or 0.0):+.1f} s): daemon {daemon}, server "
                            f"{e.server_pid if e.server_pid is not None else '?'}, clients with a sticky error: "
                            f"{clients}", ALERT))
    return out


def _when(x: XidStatus, now: float) -> str:
    if x.last_seen is None:
        return "?"
    return f"{_datetime(x.last_seen, millis=True)} ({_duration(now - x.last_seen)} ago)"


def _near(x: XidStatus, fatal: Sequence[Tuple[str, Event]]) -> List[Tuple[str, Event]]:
    if x.last_seen is None:
        return []
    seen = x.last_seen
    return sorted(((d, e) for d, e in fatal if abs(e.time - seen) <= XID_NEAR_SECONDS), key=lambda de: de[1].time)


def _gpu_facts(g: GpuStatus) -> Tuple[List[str], List[str]]:
    facts = [f"sharing {g.sharing_mode or '?'}", f"memory {_memory(g.memory_used_bytes, g.memory_total_bytes)}"]
    if g.compute_processes is not None:
        facts.append(f"{g.compute_processes:.0f} compute processes")
    if g.power_watts is not None:
        facts.append(f"{g.power_watts:.0f} W")
    if g.temperature_celsius is not None:
        facts.append(f"{g.temperature_celsius:.0f} C")
    if g.compute_mode:
        facts.append(f"compute mode {g.compute_mode}")
    activity = [f"{label} {_percent(value)}" for label, value in (
        ("utilization", g.utilization_ratio), ("SM active", g.sm_active_ratio), ("SM occupancy", g.sm_occupancy_ratio),
        ("tensor", g.tensor_active_ratio), ("DRAM", g.dram_active_ratio),
        ("memory controller", g.memory_utilization_ratio)) if value is not None]
    return facts, activity


# ---------------------------------------------------------------- daemons
def _daemon(d: DaemonStatus, now: float) -> List[Line]:
    state = {True: "up", False: "DOWN", None: "unknown (its control source failed)"}[d.up]
    head = f"MPS daemon {d.name}: {state}" + (f" | version {d.version}" if d.version else "")
    head += (f" | DRA claim {d.claim_uid}" if d.claim_uid else "") + (" | multi-user (-M)" if d.multiuser else "")
    if d.default_active_thread_ratio is None:  # the daemon did not answer: no telling what is set
        defaults = ["unknown"]
    else:
        defaults = [f"active threads {_percent(d.default_active_thread_ratio)}",
                    "pinned memory " + (_per_gpu(d.default_pinned_memory_limit_bytes)
                                        if d.default_pinned_memory_limit_bytes else "no limit")]
    out: List[Line] = [("", PLAIN), (head, HEADING if d.up else ALERT),
                       (f"  pipe {d.pipe_directory or '?'} | logs {d.log_directory or '?'}", PLAIN),
                       ("  defaults: " + ", ".join(defaults), PLAIN)]
    if d.client_limit is not None:
        out.append((f"  clients per device: at most {d.client_limit:g} (as the last refusal said)", PLAIN))
    if d.servers is None or d.clients is None:
        out += [("", PLAIN), ("  servers and clients: unknown (the control source failed)", ALERT)]
    if d.servers is not None:
        out += _servers(d.servers, now)
    if d.clients is not None:
        out += _clients(d.clients)
    out += _edge_exits(d.edge_exits or [], now)
    if d.log_error is not None:
        out += [("", PLAIN), (f"  queue, events and totals from the logs: unknown ({d.log_error})", ALERT)]
        return out
    out += _queued(d, now)
    out += _events(d.events or [], now)
    totals = _totals(d)
    if totals:
        out.append(("", PLAIN))
        out += [(line, PLAIN) for line in _wrap("  totals from the logs: ", totals, "    ")]
    return out


def _totals(d: DaemonStatus) -> List[str]:
    """One entry per counter: its sum, and the non-zero parts where it has a label (exits by status)."""
    by_metric: Dict[str, List[Tuple[str, float]]] = {}
    for c in d.counters or []:
        by_metric.setdefault(c.metric, []).append((" ".join(f"{k} {v}" for k, v in sorted(c.labels.items())), c.value))
    out = []
    for metric, parts in by_metric.items():
        entry = f"{EVENT_COUNTERS.get(metric, metric)} {sum(v for _, v in parts):g}"
        labelled = [f"{k}: {v:g}" for k, v in parts if k and v]
        out.append(entry + (f" ({', '.join(labelled)})" if labelled else ""))
    return out


def _servers(servers: Sequence[ServerStatus], now: float) -> List[Line]:
    if not servers:
        return [("", PLAIN), ("  no MPS server running", PLAIN)]
    rows = [[str(s.pid), _user(s.user, s.uid), s.status or "?", _count(s.clients), _percent(s.active_thread_ratio),
             _per_gpu(s.pinned_memory_limit_bytes), _per_gpu(s.memory_used_bytes), _since(s.start_time, now)]
            for s in servers]
    return _table("  ", ["SERVER", "USER", "STATUS", "CLIENTS", "THREADS", "PINNED LIMIT", "MEMORY", "STARTED"], rows,
                  alert=[s.status == "FAULT" for s in servers])


def _clients(clients: Sequence[ClientStatus]) -> List[Line]:
    if not clients:
        return [("", PLAIN), ("  no client connected", PLAIN)]
    rows = [[str(c.pid), "" if c.server_pid is None else str(c.server_pid), _user(c.user, c.uid), _where(c),
             _client_memory(c), _percent(c.active_thread_ratio), _count(c.priority, "-"), c.command or "?"]
            for c in clients]
    return _table("  ", ["CLIENT", "SERVER", "USER", "POD / CONTAINER", "MEMORY / LIMIT", "THREADS", "PRIORITY",
                         "COMMAND"], rows)


_EDGE_REASONS = {"client_limit": "at its limit", "device_full": "GPU full"}


def _edge_exits(exits: Sequence[EdgeExitStatus], now: float) -> List[Line]:
    """The clients that exited at the edge of memory: their last reading and its age."""
    if not exits:
        return []
    rows = []
    for e in exits:
        reading = _bytes(e.used_bytes) + (f" / {_bytes(e.limit_bytes)}" if e.limit_bytes else " / no limit")
        gpu = _memory(e.gpu_used_bytes, e.gpu_total_bytes)
        how = e.outcome + (f" ({e.detail})" if e.detail else "")
        rows.append([str(e.pid), str(e.gpu), _EDGE_REASONS.get(e.reason, e.reason), how, reading, gpu,
                     f"{_duration(e.reading_age_seconds)} ago", e.pod + (f" {e.container}" if e.container else ""),
                     _datetime(e.seen_gone)])
    out: List[Line] = [("", PLAIN), (f"  EXITS AT THE MEMORY EDGE (the last {len(exits)})", PLAIN)]
    return out + _table("  ", ["EXITED", "GPU", "REASON", "OUTCOME", "LAST READING / LIMIT", "GPU MEMORY",
                               "READING", "POD / CONTAINER", "SEEN GONE"], rows,
                        alert=[e.outcome != "clean" for e in exits])


def _queued(d: DaemonStatus, now: float) -> List[Line]:
    if not d.queued:
        return []
    rows = [[str(q.pid), str(q.uid), q.reason, _duration(q.waiting_seconds), _datetime(q.since)] for q in d.queued]
    return _table("  ", ["QUEUED", "UID", "REASON", "WAITING", "SINCE"], rows, alert=[True] * len(rows))


def _events(events: Sequence[Event], now: float) -> List[Line]:
    if not events:
        return []
    out: List[Line] = [("", PLAIN), (f"  EVENTS (the last {len(events)}, from the logs)", PLAIN)]
    for e in events:
        what = _EVENT_NAMES.get(e.kind, e.kind)
        if e.kind == "left_queue":  # about a client, not a server
            subject = f"client {e.clients[0] if e.clients else '?'}"
        else:
            subject = f"server {e.server_pid if e.server_pid is not None else '?'}"
        text = f"  {_datetime(e.time, millis=True)}  {what:<16} {subject}"
        if e.kind == "left_queue":
            text += f" ({e.detail})" if e.detail else ""
        elif e.kind == "fatal_gpu_error" and e.clients:
            text += ", clients with a sticky error: " + " ".join(map(str, e.clients))
        elif e.kind == "exit_with_clients":
            text += " exited with clients still connected" + (": " + " ".join(map(str, e.clients)) if e.clients else "")
        elif e.kind == "client_rejected":
            text += " refused " + (f"client {e.clients[0]}" if e.clients else "a client") + (f": {e.detail}" if e.detail else "")
        elif e.kind == "client_terminated":
            text += " ended client " + (str(e.clients[0]) if e.clients else "?") + " (terminate_client)"
        elif e.kind == "handoff":
            text += f" ({e.detail})" if e.detail else ""
            text += " shut down for a waiting client of another user"
        elif e.detail:
            text += f": {e.detail}"
        out.append((text + f"  ({_duration(now - e.time)} ago)", ALERT if e.kind not in ("handoff", "left_queue") else PLAIN))
    return out


# ---------------------------------------------------------------- formatting
def _table(indent: str, header: Sequence[str], rows: Sequence[Sequence[str]],
           alert: Optional[Sequence[bool]] = None) -> List[Line]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        return (indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths))).rstrip()

    flags = alert or [False] * len(rows)
    return [("", PLAIN), (fmt(header), HEADING)] + [(fmt(r), ALERT if a else PLAIN) for r, a in zip(rows, flags)]


def _wrap(first: str, entries: Sequence[str], indent: str) -> List[str]:
    """Entries joined by commas, a new line (indented) before one that would pass WIDTH;
    an entry is never cut."""
    lines = [first]
    for i, entry in enumerate(entries):
        entry += "," if i < len(entries) - 1 else ""
        if lines[-1] != first and len(lines[-1]) + 1 + len(entry) > WIDTH:
            lines.append(indent + entry)
        else:
            lines[-1] += ("" if lines[-1].endswith(" ") else " ") + entry
    return lines


def _bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _memory(used: Optional[float], total: Optional[float]) -> str:
    if used is None:
        return "?"
    if not total:
        return _bytes(used)
    return f"{_bytes(used)} of {_bytes(total)} ({used / total:.0%})"


def _per_gpu(values: Mapping[int, float]) -> str:
    if not values:
        return "-"
    if len(values) == 1 and 0 in values:
        return _bytes(values[0])
    return ", ".join(f"gpu{gpu} {_bytes(v)}" for gpu, v in sorted(values.items()))


def _client_memory(c: ClientStatus) -> str:
    """Memory against the limit in force, per GPU the client is on."""
    gpus = sorted(set(c.memory_used_bytes) | set(c.pinned_memory_limit_bytes))
    if not gpus:
        return "-"
    parts = []
    for gpu in gpus:
        used, limit = c.memory_used_bytes.get(gpu), c.pinned_memory_limit_bytes.get(gpu)
        text = f"{_bytes(used)} / {'no limit' if limit is None else _bytes(limit)}"
        if used is not None and limit:
            text += f" ({used / limit:.0%})"
        parts.append(text if gpus == [0] else f"gpu{gpu} {text}")
    return ", ".join(parts)


def _percent(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


def _count(n: Optional[float], unknown: str = "?") -> str:
    return unknown if n is None else f"{n:.0f}"


def _user(user: str, uid: Optional[int]) -> str:
    if user and uid is not None and user != str(uid):
        return f"{user} ({uid})"
    return user or ("?" if uid is None else str(uid))


def _where(c: ClientStatus) -> str:
    if c.pod:
        return f"{c.namespace}/{c.pod}" + (f" {c.container}" if c.container else "")
    parts = ([f"pod {c.pod_uid[:8]}"] if c.pod_uid else []) + ([f"ctr {c.container_id[:12]}"] if c.container_id else [])
    return " ".join(parts) or "-"


def _datetime(t: float, millis: bool = False) -> str:
    text = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
    return text + f".{int(t * 1000) % 1000:03d}" if millis else text


def _since(t: Optional[float], now: float) -> str:
    if t is None:
        return "?"
    return f"{time.strftime('%H:%M:%S', time.gmtime(t))} ({_duration(now - t)} ago)"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:02.0f} min"
    return f"{seconds // 86400:.0f} d {seconds % 86400 // 3600:.0f} h"
