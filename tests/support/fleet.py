"""A fleet on one machine: replay exporters on loopback ports, and kube-state-metrics
as a static exposition in its real format.

    bundle = record_bundle(tmp, scenarios.synthetic(tmp, gpus=2, clients_per_gpu=3, clients_per_pod=2))
    with running_replays([bundle] * 5, tmp) as addresses, serving_text(kube_state_metrics(pods)) as ksm:
        ...

`record_bundle` runs the real `capture` on a scenario's faked sources (with a
control.log, so the log-derived series exist); `running_replays` starts one
`mps-exporter replay --loop` process per bundle, each on its own free port.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Sequence

from mps_exporter.capture import capture
from mps_exporter.wiring import build_readers
from tests.support.prometheus import free_port, stop_process
from tests.support.scenarios import Scenario

# What only an exporter at each summing --mps.client-granularity serves.
SUMMED_METRICS = {"pod": re.compile(r"\bmps_pod_client"), "server": re.compile(r"\bmps_server_client_(memory|pinned)")}
# Series only --mps.client-granularity client serves: a query that reads one beside a summed
# series (the client memory ratio: `mps_client_... or mps_pod_client_...`) has data there too.
PER_CLIENT = re.compile(r"\bmps_client_")


def summed_only(expr: str, mode: str) -> bool:
    """Whether `expr` reads series of --mps.client-granularity `mode` (pod, server) alone."""
    return bool(SUMMED_METRICS[mode].search(expr)) and not PER_CLIENT.search(expr)

# A control daemon's log: a server for uid 1000 started, then a client of uid 2000
# waits for it to drain: every replayed node has one client queued.
CONTROL_LOG = (
    "[2026-01-05 10:00:00.000 Control  1419] Starting control daemon using socket /tmp/mps/pipe/control\n"
    "[2026-01-05 10:00:00.001 Control  1419] CUDA MPS Control binary version: 13000\n"
    "[2026-01-05 10:00:01.000 Control  4000] Starting new server 4000 for user 1000\n"
    "[2026-01-05 10:00:01.500 Control  1419] NEW SERVER 4000: Ready\n"
    "[2026-01-05 10:00:02.000 Control  1419] NEW CLIENT 9999 from user 2000: Server is not ready, "
    "push client to pending list\n"
)


@dataclass(frozen=True)
class Pod:
    namespace: str
    pod: str
    uid: str
    container: str
    container_id: str  # as kube-state-metrics writes it: with the runtime prefix
    node: str


def record_bundle(tmp: Path, scen: Scenario, seconds: float = 2.0, interval: float = 0.5) -> Path:
    """A capture bundle of the scenario's sources, logs included."""
    log_dir = tmp / "mps-log"
    log_dir.mkdir(exist_ok=True)
    (log_dir / "control.log").write_text(CONTROL_LOG)
    (log_dir / "server.log").write_text("")
    cfg = scen.cfg
    cfg.daemons[0].log_directory = str(log_dir)
    cfg.collectors["logs"] = True
    out = tmp / "bundles"
    out.mkdir(exist_ok=True)
    cfg.capture.out, cfg.capture.duration_seconds, cfg.capture.interval_seconds = str(out), seconds, interval
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        assert capture(cfg, readers=build_readers(cfg, scen.backends(), recorded=True)) == 0
    (bundle,) = out.iterdir()
    return bundle


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_replays(bundles: Sequence[Path], workdir: Path, timeout: float = 60.0,
                    flags: Sequence[str] = ()) -> Iterator[List[str]]:
    """One replay exporter per bundle, looping, each on a free 127.0.0.1 port and with
    `flags` (e.g. --mps.client-granularity server); their addresses."""
    procs: List[subprocess.Popen] = []
    addresses: List[str] = []
    logs = []
    try:
        for i, bundle in enumerate(bundles):
            address = f"127.0.0.1:{free_port()}"
            log = open(workdir / f"replay-{i}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "mps_exporter.cli", "replay", str(bundle), "--loop",
                 f"--web.listen-address={address}", "--log.level=warn", *flags],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            addresses.append(address)
        deadline = time.monotonic() + timeout
        for i, (proc, address) in enumerate(zip(procs, addresses)):
            while not _answers(f"http://{address}/-/healthy"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"replay {i} on {address} did not start: "
                                         f"{(workdir / f'replay-{i}.log').read_text(errors='replace')[-2000:]}")
                time.sleep(0.1)
        yield addresses
    finally:
        for proc in procs:
            stop_process(proc)
        for log in logs:
            log.close()


@contextlib.contextmanager
def serving_text(text: str) -> Iterator[str]:
    """A static /metrics page in the Prometheus text format; its host:port."""
    body = text.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def renamed_bundle(bundle: Path, out: Path, renames: Dict[str, str]) -> Path:
    """A copy of `bundle` with strings replaced (pod UIDs, container ids): the same
    node, other pods."""
    text = gzip.decompress(bundle.read_bytes()).decode()
    for old, new in renames.items():
        text = text.replace(old, new)
    out.write_bytes(gzip.compress(text.encode(), compresslevel=1))
    return out


def kube_state_metrics(pods: Iterable[Pod]) -> str:
    """kube_pod_info and kube_pod_container_info as kube-state-metrics v2 serves them
    (HELP text, label names and order of its /metrics page)."""
    info = ["# HELP kube_pod_info [STABLE] Information about pod.", "# TYPE kube_pod_info gauge"]
    containers = ["# HELP kube_pod_container_info [STABLE] Information about a container in a pod.",
                  "# TYPE kube_pod_container_info gauge"]
    for i, p in enumerate(pods):
        info.append(
            f'kube_pod_info{{namespace="{p.namespace}",pod="{p.pod}",uid="{p.uid}",host_ip="10.0.0.{i % 250 + 1}",'
            f'pod_ip="10.244.{i // 250}.{i % 250 + 1}",node="{p.node}",created_by_kind="ReplicaSet",'
            f'created_by_name="{p.pod.rsplit("-", 1)[0]}",priority_class="",host_network="false"}} 1')
        containers.append(
            f'kube_pod_container_info{{namespace="{p.namespace}",pod="{p.pod}",uid="{p.uid}",'
            f'container="{p.container}",image_spec="registry.example/{p.container}:1",'
            f'image="registry.example/{p.container}:1",image_id="registry.example/{p.container}@sha256:{"0" * 64}",'
            f'container_id="{p.container_id}"}} 1')
    return "\n".join(info + containers) + "\n"
