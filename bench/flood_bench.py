"""Hostile HTTP clients: mps-exporter beside node_exporter 1.5.0, the same web config.

Cases (each against a fresh server of each kind, on loopback):

- silent: the server starts with its soft file limit at 1024 (systemd's default) and
  1,100 connections are opened that send nothing; then 20 scrapes of /metrics, each on
  a new connection, one every 0.1 s. `--hard-limit` also pins the hard limit at 1024,
  so the limit cannot be raised and the server must shed connections itself;
- idle: 2,000 keep-alive connections each ask for /-/healthy once and stay open; then
  the same 20 scrapes;
- corners: malformed requests (HTTP/9.9, PRI *, HTTP/0.9, no Host, Content-Length -1,
  a header without a colon, ...): the status each server answers and how long it took;
- password: the web config's only user is replaced by another while the server runs;
  how long until the old password gets 401 and the new one 200 (TLS + basic auth);
- tls-hello: 200 connections a second (`--hello-rate`) for 12 s (`--hello-seconds`)
  each send a whole TLS ClientHello and then nothing (the handshake hangs), while 20
  scrapes over TLS are made beside them; the reference in the same run is the same
  flood against plain HTTP, each connection sending an unfinished request head. It
  prints side scrapes answered within 1 s, their p50/max, and the server's RSS before,
  at its peak and after the flood (the flood's sockets closed, 3 s of quiet).

For the flood cases it prints scrapes answered within 100 ms and their p50/max, the
server's CPU use while the flood is held (a share of one core, over the scrape window
and over 2 s of quiet), its threads and its RSS. Numbers, not a pass/fail; the load
average is printed beside them (other work on the machine skews timings).

    python3 bench/flood_bench.py [--silent 1100] [--idle 2000] [--hard-limit]
        [--cases silent idle corners password tls-hello] [--hello-rate 200] [--hello-seconds 12]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import resource
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from load_bench import WebSetup, connection, fetch, pct, start  # noqa: E402
from report import load_average  # noqa: E402
from tests.support.certs import make_tls_files  # noqa: E402
from tests.support.prometheus import free_port, stop_process  # noqa: E402

KINDS = ("mps-exporter", "node_exporter")
LIBRARIES = ("cheroot", "waitress")  # bench/library_server.py (load_bench.start): plain HTTP, pip-installed by hand
SOFT_LIMIT = 1024

# (name, bytes): the corner cases of issue 26, and two that must still be served.
CORNERS: List[Tuple[str, bytes]] = [
    ("GET HTTP/9.9", b"GET /metrics HTTP/9.9\r\nHost: x\r\n\r\n"),
    ("PRI * HTTP/2.0", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("HTTP/0.9 (GET /)", b"GET /\r\n"),
    ("HTTP/1.1 without Host", b"GET /metrics HTTP/1.1\r\n\r\n"),
    ("Content-Length: -1", b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"),
    ("header line without colon", b"GET /metrics HTTP/1.1\r\nHost: x\r\nBogus header\r\n\r\n"),
    ("two Host headers", b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n"),
    ("Transfer-Encoding: gzip", b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n"),
    ("bad method token", b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("1 MiB request line", b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("HTTP/1.0 without Host", b"GET / HTTP/1.0\r\n\r\n"),
    ("folded header line", b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n  b\r\nConnection: close\r\n\r\n"),
]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> Dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Threads", "VmRSS"):
                out[key] = int(value.split()[0])
    return out


def scrapes(port: int, setup: WebSetup, count: int = 20, interval: float = 0.1,
            errors: Optional[List[str]] = None) -> List[Optional[float]]:
    """Seconds each scrape took (a new connection each), None for a failure (said in `errors`)."""
    took: List[Optional[float]] = []
    for _ in range(count):
        started = time.monotonic()
        try:
            conn = connection(port, setup, timeout=5)
            status = fetch(conn, setup, "/metrics")
            conn.close()
            took.append(time.monotonic() - started if status == 200 else None)
            if status != 200 and errors is not None:
                errors.append(f"HTTP {status}")
        except OSError as e:
            took.append(None)
            if errors is not None:
                errors.append(f"{type(e).__name__} after {time.monotonic() - started:.2f} s")
        time.sleep(interval)
    return took


def flood(kind: str, setup: WebSetup, how: str, count: int,
          hard_limit: bool) -> Dict[str, object]:
    port = free_port()
    hard = SOFT_LIMIT if hard_limit else resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = start(kind, port, setup, (SOFT_LIMIT, hard))
    held: List[socket.socket] = []
    try:
        before = proc_status(proc.pid)
        opened = time.monotonic()
        for _ in range(count):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                break
            held.append(s)
            if how == "idle":
                wrapped = setup.context.wrap_socket(s, server_hostname="localhost") if setup.context else s
                held[-1] = wrapped
                auth = "".join(f"{k}: {v}\r\n" for k, v in setup.headers.items())
                try:
                    wrapped.sendall(f"GET /-/healthy HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
                    wrapped.recv(65536)
                except OSError:
                    pass
        open_seconds = time.monotonic() - opened
        time.sleep(0.5)
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        took = scrapes(port, setup)
        cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(2.0)
        cpu2, t2 = cpu_seconds(proc.pid), time.monotonic()
        during = proc_status(proc.pid)
        ok = [t for t in took if t is not None]
        return {
            "connections held": len(held), "seconds to open them": round(open_seconds, 2),
            "scrapes ok within 100 ms": f"{sum(t <= 0.1 for t in ok)}/{len(took)}",
            "scrape p50 / max, ms": f"{pct(ok, 50) * 1000:.1f} / {max(ok) * 1000:.1f}" if ok else "-",
            "CPU while scraping, % of a core": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
            "CPU at rest under the flood, % of a core": round(100 * (cpu2 - cpu1) / (t2 - t1), 1),
            "threads before / during": f"{before['Threads']} / {during['Threads']}",
            "RSS before / during, MB": f"{before['VmRSS'] / 1024:.0f} / {during['VmRSS'] / 1024:.0f}",
        }
    finally:
        for s in held:
            s.close()
        stop_process(proc)


def corners(kind: str, setup: WebSetup) -> Dict[str, object]:
    port = free_port()
    proc = start(kind, port, setup)
    out: Dict[str, object] = {}
    try:
        for name, data in CORNERS:
            started = time.monotonic()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                    try:
                        s.sendall(data)
                    except OSError:
                        pass
                    line = s.makefile("rb").readline(200).split(b"\r\n")[0]
                status = line.split(b" ")[1].decode() if line.startswith(b"HTTP/") else f"no status line {line[:30]!r}"
            except OSError as e:
                status = f"{type(e).__name__}"
            out[name] = f"{status} ({time.monotonic() - started:.2f} s)"
    finally:
        stop_process(proc)
    return out


def password_change(kind: str, tmp: str) -> Dict[str, object]:
    """Replace the only user, then poll both passwords every 20 ms."""
    import bcrypt

    files = make_tls_files(tmp, prefix=f"{kind}-")
    context = ssl.create_default_context(cafile=files.ca_cert)
    path = os.path.join(tmp, f"{kind}-web.yml")

    def write(user: str, password: str) -> None:
        hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(10)).decode()
        with open(path + ".new", "w", encoding="utf-8") as f:
            f.write(f"tls_server_config:\n  cert_file: {files.server_cert}\n  key_file: {files.server_key}\n"
                    f"basic_auth_users:\n  {user}: '{hashed}'\n")
        os.replace(path + ".new", path)

    def header(user: str, password: str) -> Dict[str, str]:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    write("old", "old-password")
    old = WebSetup("old", path, context, header("old", "old-password"))
    new = WebSetup("new", path, context, header("new", "new-password"))
    port = free_port()
    proc = start(kind, port, old)
    try:
        write("new", "new-password")
        changed = time.monotonic()
        old_refused: Optional[float] = None
        new_accepted: Optional[float] = None
        while time.monotonic() - changed < 10 and (old_refused is None or new_accepted is None):
            for setup, which in ((old, "old"), (new, "new")):
                conn = connection(port, setup, timeout=5)
                status = fetch(conn, setup, "/metrics")
                conn.close()
                if which == "old" and status == 401 and old_refused is None:
                    old_refused = time.monotonic() - changed
                if which == "new" and status == 200 and new_accepted is None:
                    new_accepted = time.monotonic() - changed
            time.sleep(0.02)
        return {"old password refused after, s": f"{old_refused:.2f}" if old_refused is not None else "> 10",
                "new password accepted after, s": f"{new_accepted:.2f}" if new_accepted is not None else "> 10"}
    finally:
        stop_process(proc)


def client_hello() -> bytes:
    """The first flight of a TLS client (a whole ClientHello), as a client sends it."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


# What a hanging plain-HTTP client sends: a request head without its blank line.
UNFINISHED_HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"


def hello_flood(kind: str, setup: WebSetup, rate: int, seconds: float,
                scrape_count: int = 20) -> Dict[str, object]:
    """`rate` connections a second for `seconds`, each sending one opening (a TLS
    ClientHello, or an unfinished HTTP head) and then nothing, held until the end;
    `scrape_count` scrapes spread over the flood on new connections."""
    port = free_port()
    proc = start(kind, port, setup, (SOFT_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held: List[socket.socket] = []
    opening = client_hello() if setup.context is not None else UNFINISHED_HEAD
    stop = threading.Event()
    peak = [0]

    def sample() -> None:
        while not stop.wait(0.1):
            with contextlib.suppress(OSError):
                peak[0] = max(peak[0], proc_status(proc.pid)["VmRSS"])

    def pour() -> None:
        began = time.monotonic()
        n = 0
        while not stop.is_set() and n < rate * seconds:
            wait = began + n / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            n += 1
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=1)
                s.sendall(opening)
            except OSError:
                continue
            held.append(s)

    try:
        for _ in range(10):  # a few scrapes first: RSS "before" is a serving exporter's
            conn = connection(port, setup, timeout=5)
            fetch(conn, setup, "/metrics")
            conn.close()
        time.sleep(0.5)
        before = proc_status(proc.pid)
        peak[0] = before["VmRSS"]
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        pourer = threading.Thread(target=pour, daemon=True)
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        pourer.start()
        time.sleep(1.0)
        errors: List[str] = []
        took = scrapes(port, setup, count=scrape_count, interval=max(0.0, (seconds - 2.0) / scrape_count),
                       errors=errors)
        pourer.join()
        cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
        during = proc_status(proc.pid)
        sent = len(held)
        for s in held:
            s.close()
        held.clear()
        time.sleep(3.0)
        stop.set()
        sampler.join()
        after = proc_status(proc.pid)
        ok = [t for t in took if t is not None]
        rss0, rss1 = before["VmRSS"] / 1024, after["VmRSS"] / 1024
        return {
            "hanging connections opened": sent,
            "scrapes ok within 1 s": f"{sum(t <= 1.0 for t in ok)}/{len(took)}",
            "scrape p50 / max, ms": f"{pct(ok, 50) * 1000:.1f} / {max(ok) * 1000:.1f}" if ok else "-",
            "failed scrapes": "; ".join(errors) or "none",
            "CPU during the flood, % of a core": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
            "threads before / during": f"{before['Threads']} / {during['Threads']}",
            "RSS before / peak / after, MB": f"{rss0:.0f} / {peak[0] / 1024:.0f} / {rss1:.0f}",
            "RSS after vs before": f"{100 * (rss1 - rss0) / rss0:+.1f} %",
        }
    finally:
        stop.set()
        for s in held:
            s.close()
        stop_process(proc)


def table(title: str, results: Dict[str, Dict[str, object]]) -> None:
    print(f"\n### {title}\n")
    print("| | " + " | ".join(results) + " |")
    print("| --- |" + " --- |" * len(results))
    rows = next(iter(results.values())).keys()
    for row in rows:
        print(f"| {row} | " + " | ".join(str(r.get(row, "")) for r in results.values()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--silent", type=int, default=1100)
    ap.add_argument("--idle", type=int, default=2000)
    ap.add_argument("--hard-limit", action="store_true", help="also pin the hard file limit at 1024")
    ap.add_argument("--tls", action="store_true", help="TLS for the flood cases (no auth)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS + LIBRARIES)
    ap.add_argument("--cases", nargs="+", default=["silent", "idle", "corners", "password", "tls-hello"],
                    choices=["silent", "idle", "corners", "password", "tls-hello"])
    ap.add_argument("--hello-rate", type=int, default=200, help="tls-hello: connections a second")
    ap.add_argument("--hello-seconds", type=float, default=12.0, help="tls-hello: how long the flood lasts")
    args = ap.parse_args()
    want = args.silent + args.idle + int(args.hello_rate * args.hello_seconds) + 200
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    print(f"load average before: {load_average()}; cores: {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="mps-flood-") as tmp:
        setup = WebSetup("plain HTTP", None, None, {})
        if args.tls:
            files = make_tls_files(tmp)
            config_file = os.path.join(tmp, "web-tls.yml")
            with open(config_file, "w", encoding="utf-8") as f:
                f.write(f"tls_server_config:\n  cert_file: {files.server_cert}\n  key_file: {files.server_key}\n")
            setup = WebSetup("TLS", config_file, ssl.create_default_context(cafile=files.ca_cert), {})
        limit = f"soft file limit {SOFT_LIMIT}" + (f", hard {SOFT_LIMIT}" if args.hard_limit else "")
        cases: Dict[str, Callable[[str], Dict[str, object]]] = {
            "silent": lambda kind: flood(kind, setup, "silent", args.silent, args.hard_limit),
            "idle": lambda kind: flood(kind, setup, "idle", args.idle, args.hard_limit),
            "corners": lambda kind: corners(kind, WebSetup("plain HTTP", None, None, {})),
            "password": lambda kind: password_change(kind, tmp),
        }
        titles = {"silent": f"{args.silent} silent connections, {setup.name}, {limit}",
                  "idle": f"{args.idle} idle keep-alive connections, {setup.name}, {limit}",
                  "corners": "HTTP corner cases: status (time to answer)",
                  "password": "web config: the only user replaced (TLS + basic auth, bcrypt cost 10)"}
        for case in args.cases:
            if case == "tls-hello":
                continue
            table(titles[case], {kind: cases[case](kind) for kind in args.kinds})
        if "tls-hello" in args.cases:
            files = make_tls_files(tmp, prefix="hello-")
            tls_file = os.path.join(tmp, "web-hello.yml")
            with open(tls_file, "w", encoding="utf-8") as f:
                f.write(f"tls_server_config:\n  cert_file: {files.server_cert}\n  key_file: {files.server_key}\n")
            tls = WebSetup("TLS", tls_file, ssl.create_default_context(cafile=files.ca_cert), {})
            plain = WebSetup("plain HTTP", None, None, {})
            results: Dict[str, Dict[str, object]] = {}
            for kind in args.kinds:
                results[f"{kind}, TLS: hanging ClientHellos"] = hello_flood(kind, tls, args.hello_rate,
                                                                             args.hello_seconds)
                results[f"{kind}, plain HTTP: hanging request heads"] = hello_flood(kind, plain, args.hello_rate,
                                                                                     args.hello_seconds)
            table(f"{args.hello_rate} hanging openings a second for {args.hello_seconds:g} s, "
                  "20 scrapes beside them (the scrapes use the flood's protocol)", results)
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
