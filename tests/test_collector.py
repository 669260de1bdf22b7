"""The whole collector on recorded and synthetic scenarios: golden exposition,
promtool, failure isolation, 48 clients on 8 GPUs, single-flight scrapes.

The golden file is written by `make generate` (tests/support/golden.py); review its diff.
"""

import re
import shutil
import subprocess
import threading
import time

import pytest

from prometheus_client.exposition import generate_latest

from mps_exporter.collector import MpsCollector, SingleFlight, build_registry
from mps_exporter.config import DaemonConfig
from mps_exporter.wiring import build_collector
from mps_exporter.sources.base import Reader
from tests.fakes.fake_pynvml import FakeNvml
from tests.support import scenarios
from tests.support.golden import GOLDEN, exposition, normalized
from tests.support.tools import require

def series(text: str, name: str) -> list:
    return [l for l in text.splitlines() if l.startswith(name + "{") or l.startswith(name + " ")]


def test_busy_capture_golden(tmp_path):
    text = normalized(exposition(scenarios.busy(tmp_path).collector()))
    assert text == GOLDEN.read_text(), f"exposition differs from {GOLDEN}: `make generate` to accept, review the diff"


def test_promtool_check_metrics_is_clean(tmp_path):
    text = exposition(scenarios.busy(tmp_path).collector())
    res = subprocess.run([require("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "" and res.stderr.strip() == "", res.stdout + res.stderr


def test_48_clients_on_8_gpus(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=8, clients_per_gpu=6)
    text = exposition(scen.collector())
    assert len(series(text, "mps_gpu_up")) == 8
    assert len(series(text, "mps_client_info")) == 48
    assert len(series(text, "mps_client_memory_used_bytes")) == 48
    assert 'mps_server_clients{daemon="default",server_pid="4000"} 48.0' in text
    # the server runs on every GPU: one memory series per GPU
    assert len(series(text, "mps_server_memory_used_bytes")) == 8
    assert len(series(text, 'mps_gpu_sharing_mode')) == 8 and all('mode="mps"' in l for l in series(text, "mps_gpu_sharing_mode"))


def test_no_gpu_fails_only_nvml(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=2)
    scen.nvml = FakeNvml.no_driver()
    text = exposition(scen.collector())
    assert 'mps_exporter_collector_success{collector="nvml"} 0.0' in text
    assert 'mps_exporter_collector_success{collector="control"} 1.0' in text
    assert series(text, "mps_gpu_up") == []
    assert 'mps_control_daemon_up{daemon="default"} 1.0' in text
    assert len(series(text, "mps_client_info")) == 2


def test_hung_daemon_fails_only_control(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=2)
    scen.daemon.hang_seconds = 5
    scen.cfg.command_timeout = 0.05
    text = exposition(scen.collector())
    assert 'mps_exporter_collector_success{collector="control"} 0.0' in text
    assert 'mps_exporter_collector_success{collector="nvml"} 1.0' in text
    assert 'mps_control_daemon_up{daemon="default"} 0.0' in text
    assert len(series(text, "mps_client_memory_used_bytes")) == 2  # NVML still answers for the clients


def test_a_set_command_in_control_log_shows_the_new_limit_in_the_next_scrape(tmp_path):
    """Limits are cached for facts_refresh_seconds (every command costs a process and five
    control.log lines), but a `Cmd:set_*` line read from control.log makes the next
    collection read them again: a changed limit shows at once, not a minute later."""
    scen = scenarios.busy(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("control.log", "server.log"):
        shutil.copy(scenarios.CAPTURE / name, logs / name)
    scen.cfg.daemons = [DaemonConfig("default", "/tmp/mps/pipe", str(logs))]
    readers = scen.readers()
    collector = build_collector(scen.cfg, readers)
    limit = 'mps_server_pinned_memory_limit_bytes{daemon="default",gpu="0",server_pid="1589"}'
    assert series(exposition(collector), "mps_server_pinned_memory_limit_bytes") == []
    scen.daemon.servers[0].pinned_limits = {0: "3G"}  # what set_device_pinned_mem_limit 1589 0 3G does
    before = len(scen.daemon.received)
    assert series(exposition(collector), "mps_server_pinned_memory_limit_bytes") == []  # cached
    assert not any(c.startswith("get_device_pinned_mem_limit") for c in scen.daemon.received[before:])
    with open(logs / "control.log", "a", encoding="utf-8") as f:
        f.write("[2026-11-21 04:24:00.000 Control  1419] Cmd:get_server_list\n")  # a read changes nothing
    readers["logs"].catch_up()
    assert series(exposition(collector), "mps_server_pinned_memory_limit_bytes") == []
    with open(logs / "control.log", "a", encoding="utf-8") as f:
        f.write("[2026-11-21 04:24:01.000 Control  1419] Cmd:set_device_pinned_mem_limit 1589 0 3G\n")
    readers["logs"].catch_up()
    assert series(exposition(collector), "mps_server_pinned_memory_limit_bytes") == [f"{limit} {3 * 2**30:.9e}"]


def test_nvml_error_on_one_gpu_of_several(tmp_path):
    from tests.fakes import fake_pynvml

    scen = scenarios.synthetic(tmp_path, gpus=3, clients_per_gpu=1)
    scen.nvml.gpus[1].errors["nvmlDeviceGetMemoryInfo"] = fake_pynvml.NVML_ERROR_GPU_IS_LOST
    text = exposition(scen.collector())
    ups = {re.search(r'gpu="(\d)"', l).group(1): l.split()[-1] for l in series(text, "mps_gpu_up")}
    assert ups == {"0": "1.0", "1": "0.0", "2": "1.0"}
    assert len(series(text, "mps_gpu_memory_used_bytes")) == 2


def test_concurrent_scrapes_share_one_collection():
    calls = []

    class SlowNvml:
        def read(self):
            calls.append(1)
            time.sleep(0.3)
            raise RuntimeError("no GPU")

    slow = SlowNvml()
    collector = MpsCollector({"nvml": Reader(lambda ctx: slow.read())})
    results = []
    threads = [threading.Thread(target=lambda: results.append(list(collector.collect()))) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 5 and len(calls) == 1
    # and the next scrape after it runs again
    collector.collect()
    assert len(calls) == 2


def test_single_flight_hands_errors_to_every_waiter():
    gate = threading.Event()

    def boom():
        gate.wait(1)
        raise ValueError("x")

    sf = SingleFlight(boom)
    errors = []

    def call():
        try:
            sf()
        except ValueError as e:
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gate.set()
    for t in threads:
        t.join()
    assert len(errors) == 3


TABLES = ("GPU", "MPS control daemon", "MPS servers", "MPS clients")


def test_every_gpu_daemon_server_and_client_metric_comes_out_of_recorded_data(tmp_path):
    """Every metric of the four source tables appears, from the capture's busy moment
    with the limits of its `limits` step (limits.txt: default pinned limit 2G, thread
    percentage 25) and a second scrape (GPM needs two samples), plus a GPU without MPS
    (per-process utilization is real only there)."""
    from mps_exporter.catalog import METRICS

    scen = scenarios.busy(tmp_path)
    scen.daemon.default_pinned_limits = {0: "2G"}
    scen.daemon.default_active_thread_percentage = 25.0
    scen.daemon.servers[0].pinned_limits = {0: "2G"}
    scen.daemon.servers[0].active_thread_percentage = 25.0
    collector = scen.collector()
    exposition(collector)
    scen.nvml.advance(15)
    text = exposition(collector)
    plain = scenarios.synthetic(tmp_path / "plain", gpus=1, clients_per_gpu=2)
    plain.nvml = FakeNvml.synthetic(gpus=1, clients_per_gpu=2, mps=False)
    plain.daemon.servers, plain.daemon.clients = [], []
    text += exposition(plain.collector())
    text += exposition(server_priority_scenario(tmp_path / "priority", 1).collector())
    text += exposition(scenarios.outside_mps(tmp_path / "outside").collector())
    text += exposition(ignored_limit_scenario(tmp_path / "ignored").collector())
    wanted = {n for n, spec in METRICS.items() if spec.table in TABLES}
    missing = sorted(n for n in wanted if not series(text, n))
    assert not missing, missing
    # 1647 runs in no pod: empty names
    assert ('mps_client_pinned_memory_limit_bytes{container="",daemon="default",gpu="0",namespace="",pid="1647",'
            'pod=""} 2.147483648e+09') in text
    assert 'mps_client_active_thread_ratio{container="",daemon="default",namespace="",pid="1647",pod=""} 0.25' in text
    assert 'mps_gpu_sharing_mode{gpu="0",mode="time_slicing"' in text


def test_first_collection_asks_the_daemon_about_every_gpu(tmp_path):
    """The control daemon's per-device limits need NVML's GPUs: on the very first
    collection the control read waits for NVML (later ones use the GPUs already known)."""
    for _ in range(5):  # the sources run concurrently: a race would show on some run
        scen = scenarios.synthetic(tmp_path, gpus=3, clients_per_gpu=1, clients_per_pod=1)
        text = exposition(scen.collector())
        assert len(series(text, "mps_server_pinned_memory_limit_bytes")) == 3


def test_the_served_registry_has_the_process_metrics(tmp_path):
    text = generate_latest(build_registry(scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1).collector())).decode()
    cpu = series(text, "process_cpu_seconds_total")
    assert len(cpu) == 1 and float(cpu[0].split()[-1]) > 0
    assert series(text, "process_resident_memory_bytes") and series(text, "mps_gpu_up")


def server_priority_scenario(tmp_path, priority: int) -> "scenarios.Scenario":
    """Server 4000 with one client (pid 5000, no CUDA_MPS_CLIENT_PRIORITY), logged `Server
    Priority set to <priority>` at its start; the daemon's default is 0 now."""
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "control.log").write_text("[2026-11-21 04:00:00.000 Control   100] Starting new server 4000 for user 0\n")
    (logs / "server.log").write_text(f"[2026-11-21 04:00:00.100 Server  4000] Server Priority set to {priority}\n")
    scen.cfg.daemons = [DaemonConfig("default", "/tmp/mps/pipe", str(logs))]
    scen.cfg.collectors["logs"] = True
    scen.log_directory = logs
    return scen


def test_a_process_outside_mps_is_published_with_its_memory_and_user(tmp_path):
    text = exposition(scenarios.outside_mps(tmp_path).collector())
    g = 'gpu="0",uuid="' + FakeNvml.synthetic(gpus=1).gpus[0].uuid + '"'
    assert series(text, "mps_gpu_processes_outside_mps") == [f"mps_gpu_processes_outside_mps{{{g}}} 1.0"]
    uuid = FakeNvml.synthetic(gpus=1).gpus[0].uuid
    assert series(text, "mps_process_outside_mps_memory_used_bytes") == [
        f'mps_process_outside_mps_memory_used_bytes{{gpu="0",pid="6000",uuid="{uuid}"}} 1.4680064e+09']
    (info,) = series(text, "mps_process_outside_mps_info")
    assert 'pid="6000"' in info and 'uid="1500"' in info and 'command="train.py"' in info
    assert series(text, "mps_gpu_sharing_mode") == [f'mps_gpu_sharing_mode{{gpu="0",mode="mixed",uuid="{uuid}"}} 1.0']
    assert 'pid="6000"' not in "".join(series(text, "mps_client_info"))


def ignored_limit_scenario(tmp_path) -> "scenarios.Scenario":
    """One GPU; its client set CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G,1=4G (device 1 does not
    exist for it: MPS enforced no limit at all, issue 24)."""
    from tests.fakes.fake_procfs import FakeProcess as ProcProcess, write_proc

    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1)
    client = scen.daemon.clients[0].pid
    write_proc(scen.proc_root, [ProcProcess(client, uid=1000 + client % 7,
                                            environ={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G,1=4G"})])
    return scen


def test_a_limit_cuda_drops_is_ignored_and_none_is_in_force(tmp_path):
    scen = ignored_limit_scenario(tmp_path)
    text = exposition(scen.collector())
    pid = scen.daemon.clients[0].pid
    (ignored,) = series(text, "mps_client_limit_ignored")
    assert all(x in ignored for x in (f'pid="{pid}"', 'limit="pinned_memory"', 'reason="invisible_device"'))
    (source,) = series(text, "mps_client_limit_source")
    assert f'pid="{pid}"' in source and 'pinned_memory="none"' in source
    assert series(text, "mps_client_pinned_memory_limit_bytes") == []


def test_a_client_without_its_own_priority_runs_at_its_servers(tmp_path):
    """`set_default_client_priority 1`, a server started (`Server Priority set to 1`), then
    the default set back to 0: the server's clients still run at 1 (issue 24)."""
    scen = server_priority_scenario(tmp_path, 1)
    text = exposition(scen.collector())
    client = next(c.pid for c in scen.daemon.clients)
    assert series(text, "mps_default_client_priority") == ['mps_default_client_priority{daemon="default"} 0.0']
    assert series(text, "mps_server_priority") == ['mps_server_priority{daemon="default",server_pid="4000"} 1.0']
    assert series(text, "mps_client_priority") == [
        f'mps_client_priority{{container="",daemon="default",namespace="",pid="{client}",pod=""}} 1.0']
    older = server_priority_scenario(tmp_path / "older", 0)
    older.daemon.default_client_priority = None  # a daemon without the command: no default, no failure
    text = exposition(older.collector())
    assert 'mps_exporter_collector_success{collector="control"} 1.0' in text
    assert series(text, "mps_default_client_priority") == []
    assert series(text, "mps_client_priority") == [
        f'mps_client_priority{{container="",daemon="default",namespace="",pid="{client}",pod=""}} 0.0']


def test_client_priority_from_its_environment_and_the_pid_namespace_label(tmp_path):
    """Client 1648 runs with CUDA_MPS_CLIENT_PRIORITY=1; 1647 and 1649 set none and run at
    the daemon's default, 0 (their server's log lines are past: the capture ends after it exits).
    The PID namespace `ps` shows is `pid_namespace`; `namespace` is the Kubernetes one (1648's pod's)."""
    text = exposition(scenarios.busy(tmp_path).collector())
    bare = 'container="",daemon="default",namespace="",'
    assert series(text, "mps_client_priority") == [
        f'mps_client_priority{{{bare}pid="1647",pod=""}} 0.0',
        'mps_client_priority{container="trainer",daemon="default",namespace="ml-team",pid="1648",'
        'pod="trainer-7d9c6b5f4-x2k8p"} 1.0',
        f'mps_client_priority{{{bare}pid="1649",pod=""}} 0.0']
    info = series(text, "mps_client_info")
    assert len(info) == 3 and all('pid_namespace="4026531836"' in s for s in info)
    assert sorted(re.search(r'[{,]namespace="([^"]*)"', s).group(1) for s in info) == ["", "", "ml-team"]


def test_describe_gives_every_declared_family_empty_and_name_filters_use_it(tmp_path):
    from mps_exporter.catalog import METRICS

    collector = scenarios.busy(tmp_path).collector()
    described = collector.describe()
    assert len(described) == len(METRICS) and all(not family.samples for family in described)
    assert {"mps_gpu_up", "mps_server_starts"} <= {family.name for family in described}  # counters without _total
    registry = build_registry(collector, process=False)
    # client_python's duplicate check sees the names now ...
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(scenarios.busy(tmp_path / "again").collector())
    # ... and its restricted registry (`/metrics?name[]=...`) finds the collector by them.
    text = generate_latest(registry.restricted_registry(["mps_gpu_up", "mps_server_starts_total"])).decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    assert names == {"mps_gpu_up", "mps_server_starts_total"}
