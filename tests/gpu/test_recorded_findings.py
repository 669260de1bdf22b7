"""What the real GPU taught, pinned down on recorded data (runs without a GPU).

Control replies (recorded/h200-580-replies.json, from the live run): with no MPS
server, `ps` prints "Server not found"; the exporter failed its control collector
on it and lost the daemon defaults until a server started.

GPU memory used: NVML's v1 memory call counts memory the driver reserves; the v2
call and nvidia-smi do not. The capture holds both answers of one moment
(nvml_busy.json `mem`, `mem_v2`) and nvidia-smi's view a second later
(nvidia-smi-busy.txt: "13621MiB / 143771MiB"), so the exporter must report v2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mps_exporter.config import DaemonConfig
from mps_exporter.sources.control import ControlClient, DaemonReader, parse_pinned_limit, parse_ps
from mps_exporter.sources.nvml import NvmlClient
from tests.fakes.fake_control import CAPTURE
from tests.fakes.fake_pynvml import FakeNvml, NVMLError, load_capture

MIB = 2**20
NVML_MEMORY_V2 = 0x02000028  # pynvml.nvmlMemory_v2
NVML_ERROR_FUNCTION_NOT_FOUND = 13


class NvmlWithMemoryV2(FakeNvml):
    """The capture's GPU, answering the memory call in v1 or v2 as the real one did."""

    nvmlMemory_v2 = NVML_MEMORY_V2
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    v2_missing = False

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        doc = load_capture("busy")
        if version is None:
            m = doc["mem"]["v"]
            return type("c_nvmlMemory_t", (), dict(total=m["total"], used=m["used"], free=m["free"]))
        if self.v2_missing:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        assert version == NVML_MEMORY_V2
        m = doc["mem_v2"]["v"]
        return type("c_nvmlMemory_v2_t", (), dict(total=m["total"], used=m["used"], free=m["free"],
                                                  reserved=m["reserved"]))


def smi_busy_used_mib() -> int:
    text = (CAPTURE / "nvidia-smi-busy.txt").read_text()
    return int(re.search(r"(\d+)MiB / \d+MiB", text).group(1))


def test_gpu_memory_used_is_what_nvidia_smi_shows():
    gpu = NvmlClient(NvmlWithMemoryV2.from_capture("busy")).read().gpus[0]
    assert gpu.memory_used_bytes / MIB == pytest.approx(smi_busy_used_mib(), abs=1)  # 13621 MiB
    v1 = load_capture("busy")["mem"]["v"]["used"]
    assert abs(v1 / MIB - smi_busy_used_mib()) > 600  # the reserved memory v1 would have added


def test_gpu_memory_falls_back_to_v1_where_v2_is_missing():
    nvml = NvmlWithMemoryV2.from_capture("busy")
    nvml.v2_missing = True
    gpu = NvmlClient(nvml).read().gpus[0]
    assert gpu.up and gpu.memory_used_bytes == load_capture("busy")["mem"]["v"]["used"]


# ------------------------------------------------------------- control replies
REPLIES = json.loads((Path(__file__).resolve().parent / "recorded" / "h200-580-replies.json").read_text())["replies"]


class RecordedDaemon:
    """A control runner answering from the live run's replies; `servers` picks the scene."""

    def __init__(self, servers: str) -> None:
        self.servers = servers
        self.sent = []

    def __call__(self, argv, stdin_text, env, timeout):
        line = stdin_text.strip()
        self.sent.append(line)
        verb = line.split()[0] if line else argv[-1]
        if verb == "-v":
            return 0, "CUDA MPS Control for Linux/Unix/QNX. Binary version: 13000\n"
        if verb == "get_server_list":
            return 0, self.servers
        if verb == "ps":
            return 0, REPLIES["ps (no server)" if not self.servers else "ps (3 clients)"]
        if verb == "get_default_client_priority":  # not recorded: answered as a daemon without it would
            return 0, f'Unknown command "{verb}"\n'
        key = {"get_default_active_thread_percentage": "get_default_active_thread_percentage (none set)",
               "get_default_device_pinned_mem_limit": "get_default_device_pinned_mem_limit 0 (none set)",
               "get_server_status": "get_server_status <server> (busy)",
               "get_active_thread_percentage": "get_active_thread_percentage <server> (none set)",
               "get_device_pinned_mem_limit": "get_device_pinned_mem_limit <server> 0 (none set)"}[verb]
        return 0, REPLIES[key]


def read_daemon(servers: str):
    daemon = RecordedDaemon(servers)
    source = DaemonReader(DaemonConfig("default", "/tmp/p", "/tmp/l"), ControlClient("/tmp/p", runner=daemon))
    return source.read([0]), daemon


def test_ps_without_a_server_is_no_clients():
    assert parse_ps(REPLIES["ps (no server)"]) == []
    assert [e.pid for e in parse_ps(REPLIES["ps (3 clients)"])] == [1215, 1214, 1213]


def test_daemon_without_servers_reads_cleanly_with_its_defaults():
    reading, daemon = read_daemon("")
    assert reading.up and reading.error is None
    assert reading.clients == [] and reading.servers == []
    assert reading.default_active_thread_percentage == 100.0  # "100.0\n"
    assert reading.default_pinned_limits == {}  # "" (control.log alone says "No default ... limit set")
    assert "get_default_active_thread_percentage" in daemon.sent


def test_server_limits_as_printed_live():
    reading, _ = read_daemon("1262\n")
    [server] = reading.servers
    assert (server.pid, server.status, server.active_thread_percentage, server.pinned_limits) == (1262, "ACTIVE", 100.0, {})
    assert {c.pid for c in reading.clients} == {1213, 1214, 1215}
    assert parse_pinned_limit(REPLIES["get_device_pinned_mem_limit <server> 0 (default set)"]) == 4 * 2**30
    assert parse_pinned_limit(REPLIES["get_device_pinned_mem_limit <server> 0 (none set)"]) is None


# ------------------------------------------------------- two GPUs, one server
def two_gpu_mixed_phase() -> FakeNvml:
    """The mixed phase on two H200s (reports/dual-h200-run1.json): server 3044 holds 66 MiB on
    both GPUs; clients 2947 (2696 MiB) and 2949 (1770 MiB) run on GPU 0, 2948 (8840 MiB) on
    GPU 1. nvidia-smi and the compute lists name each client once; the MPS lists name all three
    on both GPUs, with 0 bytes where a client has no context."""
    from tests.fakes.fake_pynvml import FakeGpu, FakeProcess

    mib = lambda n: n * MIB  # noqa: E731
    here = {0: {2947: 2696, 2949: 1770}, 1: {2948: 8840}}
    gpus = []
    for index, uuid in ((0, "GPU-571e44ad-c20e-3f79-ce01-1903e788989b"), (1, "GPU-019e0308-9fbe-cc20-4d5b-6ffb3db72083")):
        compute = [FakeProcess(3044, mib(66))] + [FakeProcess(pid, mib(m)) for pid, m in here[index].items()]
        mps = [FakeProcess(pid, mib(here[index].get(pid, 0))) for pid in (2947, 2948, 2949)]
        gpus.append(FakeGpu(uuid=uuid, compute_processes=compute, mps_processes=mps))
    return FakeNvml(gpus)


def test_mps_clients_only_on_the_gpu_they_run_on():
    reading = NvmlClient(two_gpu_mixed_phase()).read()
    listed = {g.index: {p.pid: p.used_bytes // MIB for p in g.mps_clients} for g in reading.gpus}
    assert listed == {0: {2947: 2696, 2949: 1770}, 1: {2948: 8840}}  # as nvidia-smi --query-compute-apps
