"""A real Prometheus scrapes the exporter: over plain HTTP, and over TLS with
basic auth. The target must be up and the expected families stored."""

from __future__ import annotations

import contextlib
import threading

import bcrypt
import pytest
from prometheus_client import CollectorRegistry

from mps_exporter import web
from mps_exporter.families import FamilyBuilder
from tests.support.certs import make_tls_files
from tests.support.prometheus import Target, free_port, running_prometheus

pytestmark = pytest.mark.slow

FAMILIES = {"mps_gpu_up", "mps_gpu_memory_used_bytes", "mps_control_daemon_up", "mps_server_clients"}


class ContractSample:
    def collect(self):
        out = FamilyBuilder()
        out.add("mps_gpu_up", 1, gpu="0", uuid="GPU-0")
        out.add("mps_gpu_memory_used_bytes", 4 << 30, gpu="0", uuid="GPU-0")
        out.add("mps_control_daemon_up", 1, daemon="default")
        out.add("mps_server_clients", 3, daemon="default", server_pid="4242")
        return out.families()


@contextlib.contextmanager
def exporter(web_config_file=None):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ContractSample())
    config = web.load_web_config(str(web_config_file)) if web_config_file else None
    address = f"127.0.0.1:{free_port()}"
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=web.serve, args=(registry, address, "/metrics", config),
                              kwargs={"ready": ready, "stop": stop}, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield address
    finally:
        stop.set()
        thread.join(10)


def stored_families(prom, job: str) -> set:
    return {r["metric"]["__name__"] for r in prom.query(f'count by (__name__) ({{job="{job}"}})')}


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    """One Prometheus scraping a plain exporter and a TLS + basic auth one
    (once with the right password, once with a wrong one). One server for all
    jobs: Prometheus 2.x applies new targets only every 5 s."""
    tmp = tmp_path_factory.mktemp("scrape")
    files = make_tls_files(str(tmp))
    hashed = bcrypt.hashpw(b"scrape-pass", bcrypt.gensalt(4)).decode()
    web_config = tmp / "web.yml"
    web_config.write_text(f"tls_server_config:\n  cert_file: {files.server_cert}\n  key_file: {files.server_key}\n"
                          f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    with exporter() as plain, exporter(web_config) as secure:
        https = {"scheme": "https", "ca_file": files.ca_cert}
        targets = [
            Target(plain, job="plain"),
            Target(secure, job="secure", basic_auth=("prometheus", "scrape-pass"), **https),
            Target(secure, job="wrong-password", basic_auth=("prometheus", "nope"), **https),
        ]
        with running_prometheus(tmp, targets) as server:
            yield server


def test_plain_http_scrape(prom):
    prom.wait_for_target_up("plain")
    assert FAMILIES <= stored_families(prom, "plain")
    assert prom.query('mps_server_clients{job="plain"}')[0]["value"][1] == "3"


def test_tls_and_basic_auth_scrape(prom):
    targets = prom.wait_for_target_up("secure")
    assert targets[0]["scrapeUrl"].startswith("https://")
    assert FAMILIES <= stored_families(prom, "secure")


def test_wrong_password_is_refused(prom):
    assert prom.wait_for('up{job="wrong-password"} == 0')[0]["value"][1] == "0"
    target = next(t for t in prom.targets() if t["labels"]["job"] == "wrong-password")
    assert "401" in target["lastError"]
