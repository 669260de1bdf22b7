"""The scale-out backend of docs/deploy.md on one machine, from Debian's `victoria-metrics`
package: one VictoriaMetrics store, vmagent scrapers that split the targets between them
(-promscrape.cluster.membersCount / memberNum) and remote-write to it, and vmalert
evaluating rule files against it and writing recorded series back.

    with running_victoria_metrics(tmp) as vm, \\
            running_vmagents(tmp, vm, targets, members=2) as agents, \\
            running_vmalert(tmp, vm, [rules]) as alert:
        vm.query("up")

Every process listens on a free 127.0.0.1 port, keeps its data under `tmp`, and is
stopped on the way out; a failure to start names the process and its log's tail.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, List, Sequence

import yaml

from tests.support.prometheus import free_port, stop_process
from tests.support.tools import require


@dataclass
class Service:
    name: str
    url: str
    process: subprocess.Popen
    log: Path

    def get(self, path: str, **params: str) -> bytes:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}" + (f"?{query}" if query else ""), timeout=10) as resp:
            return resp.read()

    def api(self, path: str, **params: str) -> dict:
        """GET a Prometheus-style JSON API; returns `data`."""
        try:
            body = json.loads(self.get(f"/api/v1/{path}", **params))
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{self.name} {path}: {e.code} {e.read()[:500]!r}") from e
        assert body.get("status") == "success", f"{self.name} {path}: {body}"
        return body["data"]

    def query(self, expr: str) -> List[dict]:
        return self.api("query", query=expr)["result"]

    def metric(self, name: str) -> float:
        """Sum of a metric on the service's own /metrics page."""
        total = 0.0
        for line in self.get("/metrics").decode().splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def _running(name: str, workdir: Path, args: Sequence[str], ready_path: str = "/health",
             timeout: float = 30.0) -> Iterator[Service]:
    binary = require(name)
    port = free_port()
    log = workdir / f"{name}-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, f"-httpListenAddr=127.0.0.1:{port}", *args], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)
    service = Service(name, f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                service.get(ready_path)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"{name} did not start:\n{service.log_tail()}") from None
                time.sleep(0.1)
        yield service
    finally:
        stop_process(proc)


@contextlib.contextmanager
def running_victoria_metrics(workdir: Path) -> Iterator[Service]:
    # -search.latencyOffset: answer with samples up to now, not 30 s ago (tests wait for seconds).
    with _running("victoria-metrics", workdir, [f"-storageDataPath={workdir / 'vm-data'}", "-retentionPeriod=1d",
                                                "-search.latencyOffset=0s", "-loggerLevel=WARN"]) as vm:
        yield vm


@contextlib.contextmanager
def running_vmagents(workdir: Path, vm: Service, targets: Sequence[str], members: int = 2,
                     job: str = "mps-exporter", interval: str = "1s") -> Iterator[List[Service]]:
    """`members` vmagents sharing the scrape of `targets` (each scrapes about 1/members)."""
    config = workdir / "vmagent-scrape.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": [{
        "job_name": job, "scrape_interval": interval, "scrape_timeout": interval,
        "static_configs": [{"targets": list(targets)}]}]}))
    with contextlib.ExitStack() as stack:
        agents = [stack.enter_context(_running("vmagent", workdir, [
            f"-promscrape.config={config}", f"-remoteWrite.url={vm.url}/api/v1/write",
            f"-remoteWrite.tmpDataPath={workdir / f'vmagent-{i}'}", "-remoteWrite.flushInterval=1s",
            f"-promscrape.cluster.membersCount={members}", f"-promscrape.cluster.memberNum={i}",
            "-loggerLevel=WARN"])) for i in range(members)]
        yield agents


@contextlib.contextmanager
def _alertmanager_sink() -> Iterator[str]:
    """Accepts vmalert's notifications and drops them (this vmalert has no -notifier.blackhole)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def running_vmalert(workdir: Path, vm: Service, rule_files: Sequence[str], interval: str = "1s") -> Iterator[Service]:
    """vmalert evaluating `rule_files` against VictoriaMetrics, recording into it."""
    with _alertmanager_sink() as sink, \
            _running("vmalert", workdir, [*(f"-rule={f}" for f in rule_files), f"-datasource.url={vm.url}",
                                          f"-remoteWrite.url={vm.url}", f"-evaluationInterval={interval}",
                                          f"-notifier.url={sink}", "-loggerLevel=WARN"]) as alert:
        yield alert
