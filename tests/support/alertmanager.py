"""Run the real Alertmanager (Debian's `prometheus-alertmanager`) with every receiver
replaced by a webhook to a sink in this process, which records each notification.

    webhook = Webhook()
    with running_alertmanager(tmp_path, with_webhooks(config, webhook.url)) as am_url:
        ...
        webhook.wait_for("ticket", "MpsClientsRefused", "firing")
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple

import yaml

from tests.support.prometheus import free_port, stop_process
from tests.support.tools import require

WAIT = 30.0  # seconds a notification or Alertmanager's start may take


class Notification(NamedTuple):
    """One alert of one webhook notification: the receiver (the URL's path), when it came
    (unix time), the alert as Alertmanager sent it."""

    receiver: str
    received: float
    alert: Dict[str, Any]


class Webhook:
    """Collects Alertmanager's webhook notifications."""

    def __init__(self) -> None:
        self.notifications: List[Notification] = []
        self._lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                now = time.time()
                with hook._lock:
                    hook.notifications += [Notification(self.path.strip("/"), now, a) for a in body["alerts"]]
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def received(self) -> List[Notification]:
        with self._lock:
            return list(self.notifications)

    def wait_for(self, receiver: str, alertname: str, status: str, timeout: float = WAIT) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n in self.received():
                if n.receiver == receiver and n.alert["labels"]["alertname"] == alertname and n.alert["status"] == status:
                    return n.alert
            time.sleep(0.2)
        raise AssertionError(f"no {status} {alertname} at {receiver} within {timeout}s; got {self.summary()}")

    def summary(self) -> List[str]:
        return [f"{n.receiver}:{n.alert['labels']['alertname']}:{n.alert['status']}" for n in self.received()]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def with_webhooks(config: Dict[str, Any], webhook_url: str) -> Dict[str, Any]:
    """`config` with each receiver replaced by a webhook to <webhook_url>/<receiver name>."""
    return {**config, "receivers": [{"name": r["name"], "webhook_configs": [
        {"url": f"{webhook_url}/{r['name']}", "send_resolved": True}]} for r in config["receivers"]]}


@contextlib.contextmanager
def running_alertmanager(workdir: Path, config: Dict[str, Any]) -> Iterator[str]:
    """Alertmanager on a free 127.0.0.1 port with `config`, no cluster; yields its URL."""
    binary = shutil.which("alertmanager") or require("prometheus-alertmanager")
    (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(workdir / "alertmanager.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'alertmanager.yml'}", f"--storage.path={workdir / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(f"{url}/-/ready", proc, workdir / "alertmanager.log")
            yield url
        finally:
            stop_process(proc)


def wait_http(url: str, proc: "subprocess.Popen[bytes]", log_path: Path, timeout: float = WAIT) -> None:
    """Wait until `url` answers 200 while `proc` runs; raise with the log's tail if not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} not ready; log:\n{log_path.read_text(errors='replace')[-3000:]}")
