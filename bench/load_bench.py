"""HTTP under load: mps-exporter beside node_exporter, under the same web config.

For each server and each web config (plain HTTP; TLS with basic auth) it measures:

- burst: N clients (default 200) connect at the same moment and each asks for the
  landing page once; the time until the last one has its answer, and how many were
  answered within 1 s;
- back-to-back: 200 requests one after another on one keep-alive connection: p50/p99;
- load: N keep-alive clients request the landing page as fast as they can for a few
  seconds (wrk, Debian package `wrk`): requests/s and p50/p99, and beside them a normal
  scrape of /metrics once a second on its own keep-alive connection, as Prometheus
  scrapes: its p50 and worst latency under that load, and at rest before.

mps-exporter serves the shipped MPS session (`replay`); node_exporter its default
collectors (Debian package `prometheus-node-exporter`). Only loopback addresses are
used, every loop is bounded, and both servers are stopped at the end.

    python3 bench/load_bench.py [--clients 200] [--seconds 10]

Prints a Markdown table; numbers, not a pass/fail.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import os
import re
import resource
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.certs import make_tls_files  # noqa: E402
from tests.support.prometheus import free_port, stop_process  # noqa: E402

USER, PASSWORD = "prometheus", "load-bench-password"
BCRYPT_COST = 10


@dataclass
class WebSetup:
    name: str
    config_file: Optional[str]  # None: no web config
    context: Optional[ssl.SSLContext]  # client side, for TLS
    headers: Dict[str, str]


def web_setups(tmp: str) -> List[WebSetup]:
    import bcrypt

    files = make_tls_files(tmp)
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()
    tls_auth = os.path.join(tmp, "web-tls-auth.yml")
    with open(tls_auth, "w", encoding="utf-8") as f:
        f.write(f"tls_server_config:\n  cert_file: {files.server_cert}\n  key_file: {files.server_key}\n"
                f"basic_auth_users:\n  {USER}: '{hashed}'\n")
    auth = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
    return [
        WebSetup("plain HTTP", None, None, {}),
        WebSetup(f"TLS + basic auth (bcrypt cost {BCRYPT_COST})", tls_auth,
                 ssl.create_default_context(cafile=files.ca_cert), auth),
    ]


def start(kind: str, port: int, setup: WebSetup, nofile: Optional[Tuple[int, int]] = None) -> subprocess.Popen:
    """mps-exporter (replay), node_exporter or a library (bench/library_server.py) on
    loopback, once it answers; nofile: its (soft, hard) RLIMIT_NOFILE."""
    web = ["--web.config.file", setup.config_file] if setup.config_file else []
    if kind in ("cheroot", "waitress"):
        cmd = [sys.executable, str(ROOT / "bench" / "library_server.py"), kind, str(port)]
    elif kind == "mps-exporter":
        cmd = [sys.executable, "-m", "mps_exporter.cli", "replay", "--web.listen-address", f"127.0.0.1:{port}",
               "--log.level", "warn", *web]
    else:
        program = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
        if program is None:
            sys.exit("node_exporter is not installed: apt-get install prometheus-node-exporter")
        cmd = [program, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn", *web]

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=limit)
    deadline = time.monotonic() + 30
    while True:
        try:
            request_once(port, setup, "/metrics" if kind in ("cheroot", "waitress") else "/")
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                sys.exit(f"{kind} did not start: {' '.join(cmd)}")
            time.sleep(0.2)


def connection(port: int, setup: WebSetup, timeout: float = 30) -> http.client.HTTPConnection:
    if setup.context is not None:
        return http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=setup.context)
    return http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)


def fetch(conn: http.client.HTTPConnection, setup: WebSetup, path: str) -> int:
    conn.request("GET", path, headers=setup.headers)
    resp = conn.getresponse()
    resp.read()
    return resp.status


def request_once(port: int, setup: WebSetup, path: str, timeout: float = 5) -> int:
    conn = connection(port, setup, timeout=timeout)
    try:
        return fetch(conn, setup, path)
    finally:
        conn.close()


def burst(port: int, setup: WebSetup, clients: int) -> Dict[str, float]:
    """Every client connects at the same moment; seconds from that moment to each answer."""
    gate = threading.Barrier(clients + 1, timeout=60)
    times: List[float] = []
    failures: List[str] = []
    lock = threading.Lock()
    start_at = [0.0]

    def client() -> None:
        try:
            gate.wait()
            status = request_once(port, setup, "/", timeout=30)
            with lock:
                times.append(time.perf_counter() - start_at[0]) if status == 200 else failures.append(str(status))
        except Exception as e:  # a refused or reset connection is a result here, not a crash
            with lock:
                failures.append(type(e).__name__)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    start_at[0] = time.perf_counter()
    gate.wait()
    for t in threads:
        t.join(60)
    return {"answered": len(times), "within_1s": sum(t <= 1.0 for t in times),
            "last_s": max(times) if times else float("nan"), "failed": len(failures)}


def back_to_back(port: int, setup: WebSetup, requests: int = 200) -> Dict[str, float]:
    conn = connection(port, setup)
    lat = []
    try:
        fetch(conn, setup, "/")  # the handshake is not part of it
        for _ in range(requests):
            t0 = time.perf_counter()
            assert fetch(conn, setup, "/") == 200
            lat.append(time.perf_counter() - t0)
    finally:
        conn.close()
    return {"p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3}


def pct(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class Scraper:
    """A normal scrape of /metrics every `interval` seconds on one keep-alive connection."""

    def __init__(self, port: int, setup: WebSetup, interval: float = 1.0) -> None:
        self.port, self.setup, self.interval = port, setup, interval
        self.latencies: List[float] = []
        self.statuses: List[int] = []
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = connection(self.port, self.setup)
        try:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                conn.request("GET", "/metrics", headers=self.setup.headers)
                resp = conn.getresponse()
                body = resp.read()
                self.latencies.append(time.perf_counter() - t0)
                self.statuses.append(resp.status)
                self.bytes = len(body)
                self._stop.wait(self.interval)
        finally:
            conn.close()

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def wrk(port: int, setup: WebSetup, clients: int, seconds: int) -> Dict[str, float]:
    program = shutil.which("wrk")
    if program is None:
        sys.exit("wrk is not installed: apt-get install wrk")
    scheme = "https" if setup.context is not None else "http"
    headers = [arg for name, value in setup.headers.items() for arg in ("-H", f"{name}: {value}")]
    out = subprocess.run([program, "-t2", f"-c{clients}", f"-d{seconds}s", "--timeout", "10s", "--latency",
                          *headers, f"{scheme}://127.0.0.1:{port}/"],
                         capture_output=True, text=True, timeout=seconds + 60).stdout
    return {"rps": float(_find(r"Requests/sec:\s+([\d.]+)", out)),
            "p50_ms": _ms(_find(r"^\s+50%\s+(\S+)", out)), "p99_ms": _ms(_find(r"^\s+99%\s+(\S+)", out)),
            "errors": float(sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
                            + int(_find(r"Non-2xx or 3xx responses: (\d+)", out, "0")))}


def _find(pattern: str, text: str, default: Optional[str] = None) -> str:
    m = re.search(pattern, text, re.MULTILINE)
    if m is None:
        if default is not None:
            return default
        raise SystemExit(f"wrk output without {pattern!r}:\n{text}")
    return m.group(1)


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def measure(kind: str, setup: WebSetup, clients: int, seconds: int) -> Dict[str, float]:
    port = free_port()
    proc = start(kind, port, setup)
    try:
        with Scraper(port, setup, interval=0.2) as rest:  # at rest: 5 scrapes a second for 3 s
            time.sleep(3)
        result: Dict[str, float] = {"rest_p50_ms": statistics.median(rest.latencies) * 1e3,
                                    "scrape_bytes": rest.bytes}
        result.update({f"burst_{k}": v for k, v in burst(port, setup, clients).items()})
        result.update({f"b2b_{k}": v for k, v in back_to_back(port, setup).items()})
        with Scraper(port, setup) as loaded:
            result.update({f"load_{k}": v for k, v in wrk(port, setup, clients, seconds).items()})
        result["scrape_p50_ms"] = statistics.median(loaded.latencies) * 1e3
        result["scrape_max_ms"] = max(loaded.latencies) * 1e3
        result["scrape_not_200"] = float(sum(s != 200 for s in loaded.statuses))
    finally:
        stop_process(proc)
    return result


ROWS: List[tuple] = [
    ("burst: answered within 1 s", lambda r, n: f"{r['burst_within_1s']:.0f} of {n}"),
    ("burst: last answer, s", lambda r, n: f"{r['burst_last_s']:.2f}"),
    ("burst: failed", lambda r, n: f"{r['burst_failed']:.0f}"),
    ("back-to-back keep-alive p50 / p99, ms", lambda r, n: f"{r['b2b_p50_ms']:.2f} / {r['b2b_p99_ms']:.2f}"),
    ("load: requests/s", lambda r, n: f"{r['load_rps']:.0f}"),
    ("load: p50 / p99, ms", lambda r, n: f"{r['load_p50_ms']:.1f} / {r['load_p99_ms']:.1f}"),
    ("load: errors and non-2xx", lambda r, n: f"{r['load_errors']:.0f}"),
    ("scrape at rest p50, ms", lambda r, n: f"{r['rest_p50_ms']:.1f}"),
    ("scrape under load p50 / worst, ms", lambda r, n: f"{r['scrape_p50_ms']:.1f} / {r['scrape_max_ms']:.1f}"),
    ("scrape under load not 200", lambda r, n: f"{r['scrape_not_200']:.0f}"),
    ("exposition bytes", lambda r, n: f"{r['scrape_bytes']:.0f}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=int, default=10, help="length of the wrk load (default 10)")
    parser.add_argument("--only", choices=["plain", "tls"], help="one web config instead of both")
    parser.add_argument("--servers", default="mps-exporter,node_exporter", help="comma-separated (default both)")
    args = parser.parse_args()
    servers = args.servers.split(",")
    with tempfile.TemporaryDirectory(prefix="load-bench-") as tmp:
        for setup in web_setups(tmp):
            if args.only and (setup.context is not None) != (args.only == "tls"):
                continue
            results = {kind: measure(kind, setup, args.clients, args.seconds) for kind in servers}
            print(f"\n{setup.name}, {args.clients} clients, {args.seconds} s of load, {os.cpu_count()} cores, "
                  f"load average {os.getloadavg()[0]:.1f} at the end\n")
            print("| | " + " | ".join(servers) + " |\n|" + " --- |" * (len(servers) + 1))
            fmt: Callable[[Dict[str, float], int], str]
            for label, fmt in ROWS:
                print(f"| {label} | " + " | ".join(fmt(results[k], args.clients) for k in servers) + " |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
