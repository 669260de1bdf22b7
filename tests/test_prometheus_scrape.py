"""A real Prometheus scrapes the real exporter (`mps-exporter serve` on the
capture's recorded data, tests/support/recorded_exporter.py): over plain HTTP,
and over TLS with basic auth. The targets must be up and the contract's GPU,
daemon, server and client families stored."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import bcrypt
import pytest

from mps_exporter.catalog import METRICS
from tests.support.certs import make_tls_files
from tests.support.prometheus import Target, free_port, running_prometheus, stop_process

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent

# Families of these tables that the recorded busy moment does not produce, and why.
ABSENT_IN_CAPTURE = {
    # GPM needs two samples over an interval on a GPU whose fake supports it.
    "mps_gpu_sm_active_ratio": "no GPM interval yet",
    "mps_gpu_sm_occupancy_ratio": "no GPM interval yet",
    "mps_gpu_tensor_active_ratio": "no GPM interval yet",
    "mps_gpu_dram_active_ratio": "no GPM interval yet",
    "mps_process_sm_utilization_ratio": "the GPU is under MPS: NVML attributes SM time to the server",
    "mps_default_pinned_memory_limit_bytes": "the capture sets no default pinned limit",
    "mps_server_pinned_memory_limit_bytes": "the capture sets no server pinned limit",
    "mps_server_priority": "the capture's server logs no `Server Priority set to N` line",
    "mps_client_limit_ignored": "no client of the capture sets a limit MPS ignores",
    "mps_process_outside_mps_info": "no CUDA process runs beside MPS in the capture",
    "mps_process_outside_mps_memory_used_bytes": "no CUDA process runs beside MPS in the capture",
}
TABLES = ("GPU", "MPS control daemon", "MPS servers", "MPS clients")
EXPECTED = {name for name, spec in METRICS.items() if spec.table in TABLES} - set(ABSENT_IN_CAPTURE)


def wait_for_port(port: int, process: subprocess.Popen, log_file: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the exporter exited with {process.returncode}:\n{log_file.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise AssertionError(f"the exporter did not listen on {port}:\n{log_file.read_text()[-3000:]}")


@contextlib.contextmanager
def recorded_exporter(workdir: Path, name: str, *flags: str):
    """The real exporter as a subprocess on a free port; yields its address."""
    port = free_port()
    log_file = workdir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log_file, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.recorded_exporter",
             "--web.listen-address", f"127.0.0.1:{port}", *flags],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for_port(port, process, log_file)
        yield f"127.0.0.1:{port}"
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    """One Prometheus scraping a plain exporter and a TLS + basic auth one
    (once with the right password, once with a wrong one). One server for all
    jobs: Prometheus 2.x applies new targets only every 5 s."""
    tmp = tmp_path_factory.mktemp("scrape")
    files = make_tls_files(str(tmp))
    hashed = bcrypt.hashpw(b"scrape-pass", bcrypt.gensalt(4)).decode()
    web_config = tmp / "web.yml"
    web_config.write_text(f"tls_server_config:\n  cert_file: {files.server_cert}\n  key_file: {files.server_key}\n"
                          f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    with recorded_exporter(tmp, "plain") as plain, \
            recorded_exporter(tmp, "secure", "--web.config.file", str(web_config)) as secure:
        https = {"scheme": "https", "ca_file": files.ca_cert}
        targets = [
            Target(plain, job="plain"),
            Target(secure, job="secure", basic_auth=("prometheus", "scrape-pass"), **https),
            Target(secure, job="wrong-password", basic_auth=("prometheus", "nope"), **https),
        ]
        with running_prometheus(tmp, targets) as prom:
            yield prom


def stored(prom, job: str) -> set:
    return set(prom.metric_names(f'{{job="{job}"}}'))


def test_plain_http_scrape(scrape):
    prom = scrape
    prom.wait_for_target_up("plain")
    names = stored(prom, "plain")
    missing = EXPECTED - names
    assert not missing, f"contract families not stored: {sorted(missing)}"
    assert prom.query('mps_exporter_collector_success{job="plain", collector="nvml"}')[0]["value"][1] == "1"


def test_tls_and_basic_auth_scrape(scrape):
    prom = scrape
    targets = prom.wait_for_target_up("secure")
    assert targets[0]["scrapeUrl"].startswith("https://")
    missing = EXPECTED - stored(prom, "secure")
    assert not missing, f"contract families not stored over TLS: {sorted(missing)}"


def test_wrong_password_is_refused(scrape):
    prom = scrape
    assert prom.wait_for('up{job="wrong-password"} == 0')[0]["value"][1] == "0"
    target = next(t for t in prom.targets() if t["labels"]["job"] == "wrong-password")
    assert "401" in target["lastError"]
    assert stored(prom, "wrong-password") <= {"up", "scrape_duration_seconds", "scrape_samples_scraped",
                                              "scrape_samples_post_metric_relabeling", "scrape_series_added"}
