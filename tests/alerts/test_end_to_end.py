"""End to end: the real exporter on a recorded scenario -> a real Prometheus with
our rule file -> a real Alertmanager routed by alerts/alertmanager.example.yml ->
a webhook receiver in this test (tests/support/alertmanager.py).

The exporter runs in a thread on the capture's busy moment (tests/support/
scenarios.py: faked NVML, control daemon and /proc) with a live MPS log directory
this test appends to, so queueing comes out of the real log pipeline:

1. queued client: a client of uid 1500 is pushed to the pending list while uid 0's
   server 1589 refuses to shut down (the capture's 04:22:16 lines) ->
   MpsClientsQueuedBehindOtherUser arrives; the server exits, the client is
   admitted -> it resolves.
2. OOM risk: client 1648 (own limit CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4G) grows
   from 2856 MiB to 3900 MiB (95 %) -> MpsClientNearMemoryLimit arrives with the
   client's labels; it shrinks back -> it resolves.
3. A refused client: server.log says `Failed to accept new client. Maximum number
   of clients (48) reached.` -> MpsClientsRefused arrives.

While each alert fires, the Grafana-managed rule's query (recording rules inlined)
must select the same series. At the end every query of every dashboard must have
numbers to show over the scenario (a range query from its start).
`for:` durations are shortened to FOR and rule groups' own intervals to 1 s in a copy of
the rule file; scrape and rule
evaluation run every second.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from alerts import generate
from dashboards.queries import concrete, queries
from mps_exporter.service import serve
from mps_exporter.wiring import build_readers
from mps_exporter.sources.base import Backends
from tests.fakes.fake_control import FakeClient
from tests.fakes.fake_procfs import FakeProcess as ProcProcess
from tests.fakes.fake_procfs import write_proc
from tests.fakes.fake_pynvml import (
    NVML_GPM_METRIC_SM_UTIL,
    FakeGpu,
    FakeNvml,
    FakeProcess,
)
from tests.support import scenarios
from tests.support.fleet import SUMMED_METRICS, summed_only
from tests.support.alertmanager import WAIT, Webhook, running_alertmanager, with_webhooks
from tests.support.prometheus import Target, free_port, running_prometheus

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FOR = "2s"
MIB = 1 << 20
QUEUED = "MpsClientsQueuedBehindOtherUser"
OOM = "MpsClientNearMemoryLimit"
REFUSED = "MpsClientsRefused"
OUTSIDE = "MpsProcessOutsideMps"
IGNORED = "MpsClientLimitIgnored"


# ------------------------------------------------------------ alertmanager
def alertmanager_config(webhook_url: str) -> dict:
    """The example configuration with each receiver replaced by a webhook to
    /<receiver name>, and notification delays cut to a second."""
    config = with_webhooks(yaml.safe_load((ROOT / "alerts" / "alertmanager.example.yml").read_text()), webhook_url)
    config["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
    return config


# ------------------------------------------------------------ the exporter
class TickingNvml(FakeNvml):
    """The capture's NVML view, with time passing at each scrape: GPM counters and
    per-process utilization samples advance as they would on a live GPU."""

    def nvmlDeviceGetCount(self) -> int:
        now = time.monotonic()
        self.advance(now - getattr(self, "_last_tick", now - 1.0))
        self._last_tick = now
        return super().nvmlDeviceGetCount()


class RecordedNode:
    """The exporter side: the capture's busy moment served by the real exporter,
    with an MPS log directory the scenario steps append to."""

    def __init__(self, tmp: Path) -> None:
        scen = scenarios.busy(tmp, logs=False)
        self.nvml = TickingNvml(scen.nvml.gpus, driver_version=scen.nvml.driver_version, clock_us=scen.nvml.clock_us)
        busy_gpu = self.nvml.gpus[0]
        busy_gpu.gpm_percent = {NVML_GPM_METRIC_SM_UTIL: 70.0}
        # A second GPU, time-sliced between two processes without MPS.
        self.nvml.gpus.append(FakeGpu(
            uuid="GPU-0000abcd-0000-4000-8000-00000000abcd", memory_used=4 << 30,
            compute_processes=[FakeProcess(7001, 1 << 30), FakeProcess(7002, 2 << 30)],
            sm_util_by_pid={7001: (40, 2), 7002: (30, 1)}, util_gpu=90, power_mw=300000, temperature=55))
        self.daemon = scen.daemon
        self.proc_root = scen.proc_root
        self.daemon.servers[0].pinned_limits = {0: "16G"}
        self.daemon.default_pinned_limits = {0: "16G"}
        self.log_dir = tmp / "mps-log"
        self.log_dir.mkdir()
        (self.log_dir / "server.log").write_text("")
        self.cfg = scen.cfg
        self.cfg.collectors["logs"] = True
        self.cfg.daemons[0].log_directory = str(self.log_dir)
        self.cfg.log_timezone = "UTC"
        self.cfg.listen_address = f"127.0.0.1:{free_port()}"
        self._stop, self._ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=serve, daemon=True, kwargs=dict(
            cfg=self.cfg, stop=self._stop, ready=self._ready,
            readers=build_readers(self.cfg, Backends(nvml_module=self.nvml, control_runner=self.daemon, nvml_wait_for_every_answer=True))))
        # The daemon as the capture's run 2 began: uid 0's server 1589 serving the busy clients.
        self.control("Starting control daemon using socket /tmp/mps/pipe/control",
                     "CUDA MPS Control binary version: 13000",
                     # Every control command is logged, the exporter's own included.
                     "Accepting connection...", "NEW UI", "Cmd:get_server_list", "UI closed")
        self.control("Starting new server 1589 for user 0", pid=1589)
        self.control("NEW SERVER 1589: Ready",
                     *(f"NEW CLIENT {pid} from user 0: Server already exists" for pid in (1647, 1648, 1649)))

    @property
    def address(self) -> str:
        return self.cfg.listen_address

    def __enter__(self) -> "RecordedNode":
        self._thread.start()
        assert self._ready.wait(WAIT), "the exporter did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(WAIT)

    def control(self, *messages: str, pid: int = 1419) -> None:
        """Append lines to control.log as the daemon writes them, stamped now (UTC)."""
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        with open(self.log_dir / "control.log", "a", encoding="utf-8") as f:
            f.writelines(f"[{stamp} Control {pid:>5}] {m}\n" for m in messages)

    def server(self, pid: int, *messages: str) -> None:
        """Append lines of server `pid` to server.log, stamped now (UTC)."""
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        with open(self.log_dir / "server.log", "a", encoding="utf-8") as f:
            f.writelines(f"[{stamp} Server {pid:>5}] {m}\n" for m in messages)

    def start_outside_mps(self, pid: int, used: int, uid: int) -> None:
        """A CUDA process on the MPS GPU that reached no control daemon: NVML's compute list only."""
        write_proc(self.proc_root, [ProcProcess(pid, uid=uid, comm="train.py")])
        self.nvml.gpus[0].compute_processes.append(FakeProcess(pid, used))

    def connect_client(self, pid: int, environ: dict) -> None:
        """A new client of server 1589 with `environ` (its own limits)."""
        write_proc(self.proc_root, [ProcProcess(pid, uid=0, environ=environ)])
        gpu = self.nvml.gpus[0]
        gpu.mps_processes.append(FakeProcess(pid, 600 << 20))
        gpu.compute_processes.append(FakeProcess(pid, 600 << 20))
        self.daemon.clients.append(FakeClient(pid, 1589, gpu.uuid))

    def set_client_memory(self, pid: int, used: int) -> None:
        gpu = self.nvml.gpus[0]
        for p in gpu.mps_processes + gpu.compute_processes:
            if p.pid == pid:
                gpu.memory_used += used - p.usedGpuMemory
                p.usedGpuMemory = used


# ------------------------------------------------------------------ the test
def assert_grafana_rule_finds(prom, alertname: str, labels: dict) -> None:
    """The Grafana-managed rule's query (recording rules inlined) selects the same
    series in this Prometheus as the Prometheus rule that fired."""
    rules = json.loads((ROOT / generate.GRAFANA_RULES).read_text())
    rule = next(r for g in rules["groups"] for r in g["rules"] if r["title"] == alertname)
    expr = next(q["model"]["expr"] for q in rule["data"] if q["refId"] == "A")
    found = [{k: v for k, v in r["metric"].items() if k != "__name__"} for r in prom.query(expr)]
    series = {k: v for k, v in labels.items() if k not in ("alertname", "severity")}
    assert series in found, f"{alertname}: Grafana's query found {found}"


def _has_numbers(matrix: dict) -> bool:
    return any(value != "NaN" for series in matrix["result"] for _, value in series["values"])


def test_alerts_reach_the_receiver_and_dashboards_have_data(tmp_path):
    rules = tmp_path / "rules.yml"
    rules.write_text(generate.prometheus_rules(for_override=FOR, interval_override="1s"))
    webhook = Webhook()
    try:
        with running_alertmanager(tmp_path, alertmanager_config(webhook.url)) as am_url, \
                RecordedNode(tmp_path) as node, \
                running_prometheus(tmp_path, [Target(node.address, job="mps-exporter")], rule_files=[str(rules)],
                                   alertmanager_url=am_url) as prom:
            prom.wait_for_target_up()
            instance = node.address
            started = time.time()

            # 0. Server 1589's start as the logs tell it: the priority its clients run at.
            node.control("Starting new server 1589 for user 0", pid=1589)
            node.server(1589, "Server Priority set to 0")
            deadline = time.monotonic() + 30
            while not prom.query("mps_server_priority") and time.monotonic() < deadline:
                time.sleep(0.5)

            # 1. A client of another user queues behind server 1589.
            node.control("NEW CLIENT 2483 from user 1500: Server is not ready, push client to pending list",
                         "Try shutting down server 1589, backoff is disabled",
                         "Server 1589 has 2 active worker threads. Server will not shutdown.")
            alert = webhook.wait_for("ticket", QUEUED, "firing")
            assert_grafana_rule_finds(prom, QUEUED, alert["labels"])
            assert alert["labels"] == {
                "alertname": QUEUED, "severity": "warning", "job": "mps-exporter", "instance": instance,
                "daemon": "default", "reason": "user_switch"}
            assert alert["annotations"]["description"].startswith(
                f"1 client(s) of MPS control daemon default on {instance} have waited")
            assert alert["annotations"]["runbook_url"].endswith("#mpsclientsqueuedbehindotheruser")

            # ... until the server drains and the client is admitted by uid 1500's new server.
            node.control("Try shutting down server 1589, backoff is enabled", "Server 1589 exited with status 0")
            node.control("Starting new server 2521 for user 1500", pid=2521)
            node.control("NEW SERVER 2521: Ready", "NEW CLIENT 2483 from user 1500: Server already exists")
            resolved = webhook.wait_for("ticket", QUEUED, "resolved")
            assert resolved["labels"] == alert["labels"]

            # 2. Client 1648 nears its own 4 GiB pinned limit.
            node.set_client_memory(1648, 3900 * MIB)
            alert = webhook.wait_for("ticket", OOM, "firing")
            labels = alert["labels"]
            assert_grafana_rule_finds(prom, OOM, labels)
            assert {k: labels[k] for k in ("alertname", "severity", "instance", "daemon", "pid", "gpu",
                                           "server_pid", "user", "command")} == {
                "alertname": OOM, "severity": "warning", "instance": instance, "daemon": "default",
                "pid": "1648", "gpu": "0", "server_pid": "1589", "user": "root", "command": "python3"}
            # The busy scenario runs 1648 in a Kubernetes pod: the alert names it.
            assert labels["pod_uid"] == scenarios.POD_UID and labels["container_id"] == scenarios.CONTAINER_ID
            # 3900 MiB of 4096 MiB.
            assert "uses 95.21% of its pinned device memory limit" in alert["annotations"]["description"]

            node.set_client_memory(1648, 2856 * MIB)
            assert webhook.wait_for("ticket", OOM, "resolved")["labels"] == labels

            # 3. Server 2521 refuses a client at MPS's client limit (the line as an H100 wrote it).
            node.server(2521, "Failed to accept new client. Maximum number of clients (48) reached.")
            alert = webhook.wait_for("ticket", REFUSED, "firing")
            assert_grafana_rule_finds(prom, REFUSED, alert["labels"])
            assert alert["labels"] == {"alertname": REFUSED, "severity": "warning", "job": "mps-exporter",
                                       "instance": instance, "daemon": "default", "reason": "client_limit"}

            # 4. A CUDA process that missed the pipe directory runs on the MPS GPU (issue 24).
            node.start_outside_mps(7100, 1468006400, uid=1500)
            alert = webhook.wait_for("ticket", OUTSIDE, "firing")
            assert_grafana_rule_finds(prom, OUTSIDE, alert["labels"])
            assert {k: alert["labels"][k] for k in ("pid", "gpu", "uid", "command")} == {
                "pid": "7100", "gpu": "0", "uid": "1500", "command": "train.py"}

            # 5. A client whose own pinned limit names a device it cannot see (the node has two
            # GPUs): CUDA drops it.
            node.connect_client(1650, {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G,2=4G"})
            alert = webhook.wait_for("ticket", IGNORED, "firing")
            assert_grafana_rule_finds(prom, IGNORED, alert["labels"])
            assert {k: alert["labels"][k] for k in ("pid", "server_pid", "limit", "reason")} == {
                "pid": "1650", "server_pid": "1589", "limit": "pinned_memory", "reason": "invisible_device"}

            # Nothing else fired on this node, and nothing paged.
            names = {s.split(":")[1] for s in webhook.summary()}
            assert names == {QUEUED, OOM, REFUSED, OUTSIDE, IGNORED}, webhook.summary()

            # Every dashboard query has data to show over the scenario: at least one
            # number (not NaN) in a range query from its start to now.
            # (The Kubernetes dashboard needs kube-state-metrics, the per-pod and per-server sums
            # an exporter with --mps.client-granularity pod or server: test_kubernetes_fleet.py.)
            # (A daemon that knows every command answers none with `Unknown command`: the
            # counter of those shows on older drivers only, tests/test_control_older_drivers.py.)
            empty = [f"{q.dashboard} / {q.panel} / {q.ref_id}: {q.expr}" for q in queries()
                     if q.dashboard != "kubernetes" and not any(summed_only(q.expr, mode) for mode in SUMMED_METRICS)
                     and not any(m in q.expr for m in ("mps_exporter_control_commands_unknown_total",
                                                         "mps_gpu_xid_errors_total", "mps_gpu_xid_last_seen"))
                     and not _has_numbers(prom.api("query_range", query=concrete(q.expr, rate_interval="10s"),
                                                  start=str(started), end=str(time.time()), step="1"))]
            assert empty == []
    finally:
        webhook.close()
