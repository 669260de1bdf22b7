"""Run the real Prometheus server (Debian's `prometheus` package) in a test.

    from tests.support.prometheus import Target, running_prometheus

    with running_prometheus(tmp_path, [Target("127.0.0.1:10138")]) as prom:
        prom.wait_for_target_up()
        assert prom.query("up")[0]["value"][1] == "1"

It listens on a free 127.0.0.1 port with its data in a temporary directory,
scrapes and evaluates every second (both adjustable), optionally loads rule
files and sends alerts to an Alertmanager, and is always stopped on the way
out. Failures carry the tail of Prometheus' own log.

Without the `prometheus` binary the test is skipped, except under CI (the
`CI` environment variable set), where a missing binary is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import yaml
from tests.support.tools import require

STARTUP_TIMEOUT = 30.0


@dataclass(frozen=True)
class Target:
    """One target of a scrape job (targets with the same job share one scrape config)."""

    address: str  # host:port
    job: str = "mps"
    metrics_path: str = "/metrics"
    scheme: str = "http"
    basic_auth: Optional[Tuple[str, str]] = None  # (user, password)
    ca_file: Optional[str] = None
    server_name: Optional[str] = None
    cert_file: Optional[str] = None  # client certificate, for client_auth_type
    key_file: Optional[str] = None
    labels: Optional[Dict[str, str]] = None

    def scrape_config(self, interval: str) -> dict:
        job: dict = {
            "job_name": self.job,
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "metrics_path": self.metrics_path,
            "scheme": self.scheme,
            "static_configs": [{"targets": [self.address], **({"labels": self.labels} if self.labels else {})}],
        }
        if self.basic_auth:
            job["basic_auth"] = {"username": self.basic_auth[0], "password": self.basic_auth[1]}
        tls = {k: v for k, v in (("ca_file", self.ca_file), ("server_name", self.server_name),
                                 ("cert_file", self.cert_file), ("key_file", self.key_file)) if v}
        if tls:
            job["tls_config"] = tls
        return job



def stop_process(process: "subprocess.Popen", grace_seconds: float = 10) -> None:
    """SIGTERM (the servers' clean shutdown), then SIGKILL if it does not end in time."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(grace_seconds)

def prometheus_binary() -> str:
    return require("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _seconds(interval: float) -> str:
    return f"{int(round(interval * 1000))}ms"


def build_config(targets: Sequence[Target], rule_files: Sequence[str] = (), alertmanager_url: Optional[str] = None,
                 scrape_interval: float = 1.0, evaluation_interval: float = 1.0) -> dict:
    config: dict = {
        "global": {"scrape_interval": _seconds(scrape_interval), "evaluation_interval": _seconds(evaluation_interval)},
        "scrape_configs": [],
    }
    jobs: Dict[str, dict] = {}
    for t in targets:  # targets of one job share its scrape config (they must agree on it)
        job = t.scrape_config(_seconds(scrape_interval))
        if t.job in jobs:
            jobs[t.job]["static_configs"] += job["static_configs"]
        else:
            jobs[t.job] = job
            config["scrape_configs"].append(job)
    if rule_files:
        config["rule_files"] = [os.path.abspath(f) for f in rule_files]
    if alertmanager_url:
        url = urllib.parse.urlsplit(alertmanager_url)
        config["alerting"] = {"alertmanagers": [{
            "scheme": url.scheme or "http",
            "path_prefix": url.path or "/",
            "static_configs": [{"targets": [url.netloc]}],
        }]}
    return config


class Prometheus:
    """A started Prometheus; use `running_prometheus()` to get one."""

    def __init__(self, workdir: str, config: dict, extra_flags: Sequence[str] = ()):
        self.workdir = workdir
        self.extra_flags = list(extra_flags)
        self.config_file = os.path.join(workdir, "prometheus.yml")
        self.log_file = os.path.join(workdir, "prometheus.log")
        with open(self.config_file, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        self.port = 0
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_file, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self, timeout: float = STARTUP_TIMEOUT) -> None:
        binary = prometheus_binary()
        for _attempt in range(3):  # the free port can be taken between probe and bind
            self.port = free_port()
            data = os.path.join(self.workdir, f"data-{self.port}")
            with open(self.log_file, "ab") as log:
                self.process = subprocess.Popen(
                    [binary, f"--config.file={self.config_file}", f"--storage.tsdb.path={data}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=info", *self.extra_flags],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir)
            if self._wait_ready(timeout):
                return
            self.stop()
            if "address already in use" not in self.log_tail():
                break
        raise AssertionError(f"prometheus did not become ready; its log:\n{self.log_tail()}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    # ------------------------------------------------------------ HTTP API
    api_timeout = 10.0  # seconds; the fleet benchmark's loaded machine needs more

    def api(self, path: str, **params: str) -> object:
        """GET /api/v1/<path>; returns `data`, raises on an API error."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=self.api_timeout) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"prometheus API {path} failed: {e.code} {e.read()[:500]!r}") from e
        if body.get("status") != "success":
            raise AssertionError(f"prometheus API {path}: {body}")
        return body["data"]

    def query(self, expr: str) -> List[dict]:
        """Instant query; returns the result vector (list of {metric, value})."""
        data = self.api("query", query=expr)
        return data["result"]

    def targets(self) -> List[dict]:
        return self.api("targets", state="active")["activeTargets"]

    def alerts(self) -> List[dict]:
        return self.api("alerts")["alerts"]

    def rules(self) -> List[dict]:
        return self.api("rules")["groups"]

    def metric_names(self, match: str) -> List[str]:
        """Names of every series matching `match` stored so far, including
        series that have since gone stale (unlike an instant query)."""
        return self.api("label/__name__/values", **{"match[]": match})

    def wait_for_target_up(self, job: Optional[str] = None, timeout: float = 30.0) -> List[dict]:
        """Wait until every active target (of `job`, if given) has been scraped
        successfully; returns those targets. On timeout the error names each
        target's health and last scrape error."""
        deadline = time.monotonic() + timeout
        targets: List[dict] = []
        while time.monotonic() < deadline:
            targets = [t for t in self.targets() if job is None or t["labels"].get("job") == job]
            if targets and all(t["health"] == "up" for t in targets):
                return targets
            time.sleep(0.2)
        summary = "; ".join(f"{t['scrapeUrl']}: {t['health']} ({t.get('lastError') or 'no error'})" for t in targets)
        raise AssertionError(f"targets not up after {timeout}s: {summary or 'no targets'}\n{self.log_tail(10)}")

    def wait_for(self, expr: str, timeout: float = 30.0) -> List[dict]:
        """Poll `expr` until it returns a non-empty result; returns it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.2)
        raise AssertionError(f"query {expr!r} stayed empty for {timeout}s")


@contextlib.contextmanager
def running_prometheus(workdir, targets: Sequence[Target] = (), *, rule_files: Sequence[str] = (),
                       alertmanager_url: Optional[str] = None, scrape_interval: float = 1.0,
                       evaluation_interval: float = 1.0, extra_flags: Sequence[str] = ()) -> Iterator[Prometheus]:
    """Start Prometheus in `workdir` (e.g. pytest's tmp_path); stop it on exit.
    extra_flags go to the command line, e.g. "--rules.alert.resend-delay=1s"."""
    prom = Prometheus(str(workdir), build_config(targets, rule_files, alertmanager_url,
                                                 scrape_interval, evaluation_interval), extra_flags)
    try:
        prom.start()
        yield prom
    finally:
        prom.stop()
