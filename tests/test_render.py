"""The join of sources into the contract's families (render.py), on the busy
moment of the capture: server 1589, clients 1647/1648/1649 (nvml_busy.json,
ctl_busy.txt), with limits added the way clients set them in their environment."""

import dataclasses

import pytest

from mps_exporter.model import (DaemonReading, GpuReading, NvmlReading, ProcessFacts, ProcessMemory,
                                ProcessUtilization, PsEntry, ServerFacts)
from mps_exporter.render import Outcome, Snapshot, render, sharing_mode

UUID = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"


def busy_gpu(**overrides):
    # Values from nvml_busy.json.
    gpu = GpuReading(index=0, uuid=UUID, up=True, name="NVIDIA H200", compute_mode="default",
                     memory_total_bytes=150754820096, memory_used_bytes=14927462400, utilization_ratio=1.0,
                     memory_utilization_ratio=0.06, power_watts=699.221, temperature_celsius=60,
                     compute_processes=[ProcessMemory(1589, 69206016), ProcessMemory(1647, 9437184000),
                                        ProcessMemory(1649, 1769996288), ProcessMemory(1648, 2994733056)],
                     mps_clients=[ProcessMemory(1647, 9437184000), ProcessMemory(1649, 1769996288),
                                  ProcessMemory(1648, 2994733056)],
                     process_utilization=[ProcessUtilization(1589, 0.93, 1795234905892190)])
    for k, v in overrides.items():
        setattr(gpu, k, v)
    return gpu


def busy_daemon(**overrides):
    dev = "GPU-a20825ef-ef8f-4f37"
    d = DaemonReading(name="default", up=True, pipe_directory="/tmp/mps/pipe", log_directory="/tmp/mps/log",
                      version="13000", default_active_thread_percentage=100.0,
                      servers=[ServerFacts(1589, "ACTIVE", 100.0, {})],
                      clients=[PsEntry(1649, 7, 1589, dev, "4026531836", "python3"),
                               PsEntry(1648, 8, 1589, dev, "4026531836", "python3"),
                               PsEntry(1647, 6, 1589, dev, "4026531836", "python3")])
    for k, v in overrides.items():
        setattr(d, k, v)
    return d


def processes():
    return {
        1589: ProcessFacts(1589, uid=0, user="root", command="nvidia-cuda-mps", start_time_seconds=1795234884.0),
        1647: ProcessFacts(1647, uid=0, user="root", command="python3", start_time_seconds=1795234898.0),
        1648: ProcessFacts(1648, uid=0, user="root", command="python3", start_time_seconds=1795234898.1,
                           environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G"},
                           container_id="c" * 64, pod_uid="1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718"),
        1649: ProcessFacts(1649, uid=0, user="root", command="python3", start_time_seconds=1795234898.2),
    }


def snapshot(**kw):
    base = dict(now=1795234906.0, nvml=NvmlReading("580.159.04", [busy_gpu()]), daemons=[busy_daemon()],
                processes=processes(), outcomes={"nvml": Outcome(True, 0.002), "control": Outcome(True, 0.006)})
    base.update(kw)
    return Snapshot(**base)


def samples(snap):
    """{(name, frozenset(labels)): value} of the rendered families."""
    out = {}
    for fam in render(snap).families():
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(result, name, /, **labels):
    matches = [v for (n, ls), v in result.items() if n == name and all((k, str(x)) in ls for k, x in labels.items())]
    assert len(matches) == 1, f"{name} {labels}: {len(matches)} matches"
    return matches[0]


def absent(result, name, /, **labels):
    return not [1 for (n, ls) in result if n == name and all((k, str(x)) in ls for k, x in labels.items())]


def test_gpu_table():
    r = samples(snapshot())
    g = dict(gpu="0", uuid=UUID)
    assert value(r, "mps_gpu_up", **g) == 1
    assert value(r, "mps_gpu_info", **g, name="NVIDIA H200", driver_version="580.159.04", compute_mode="default", mig_mode="disabled") == 1
    assert value(r, "mps_gpu_memory_total_bytes", **g) == 150754820096
    assert value(r, "mps_gpu_memory_used_bytes", **g) == 14927462400
    assert value(r, "mps_gpu_utilization_ratio", **g) == 1.0
    assert value(r, "mps_gpu_power_watts", **g) == pytest.approx(699.221)
    assert value(r, "mps_gpu_sharing_mode", **g, mode="mps") == 1
    assert value(r, "mps_gpu_compute_processes", **g) == 4
    # Under MPS there is no per-process SM number: the server has it all.
    assert absent(r, "mps_process_sm_utilization_ratio")
    assert absent(r, "mps_gpu_sm_active_ratio")  # no GPM sample yet


def test_server_table():
    r = samples(snapshot())
    sp = dict(daemon="default", server_pid="1589")
    assert value(r, "mps_server_info", **sp, uid="0", user="root") == 1
    assert value(r, "mps_server_status", **sp, status="ACTIVE") == 1
    assert value(r, "mps_server_clients", **sp) == 3
    assert value(r, "mps_server_active_thread_ratio", **sp) == 1.0
    assert value(r, "mps_server_memory_used_bytes", **sp, gpu="0", uuid=UUID) == 69206016
    assert value(r, "mps_server_sm_utilization_ratio", **sp, gpu="0") == pytest.approx(0.93)
    assert value(r, "mps_server_start_time_seconds", **sp) == 1795234884.0
    assert absent(r, "mps_server_pinned_memory_limit_bytes")


def test_client_table_and_effective_limits():
    r = samples(snapshot(daemons=[busy_daemon(servers=[ServerFacts(1589, "ACTIVE", 50.0, {0: 2 << 30})])]))
    assert value(r, "mps_client_info", pid="1648", server_pid="1589", uid="0", user="root", command="python3",
                 pid_namespace="4026531836", container_id="c" * 64) == 1
    assert value(r, "mps_client_memory_used_bytes", pid="1647", gpu="0", uuid=UUID) == 9437184000
    # 1648 set its own limit (4 GiB) in its env: that one applies, not the server's 2 GiB.
    assert value(r, "mps_client_pinned_memory_limit_bytes", pid="1648", gpu="0") == 4 << 30
    assert value(r, "mps_client_pinned_memory_limit_bytes", pid="1647", gpu="0") == 2 << 30
    # Thread ratio: the smaller of the client's own (25) and the server's (50).
    assert value(r, "mps_client_active_thread_ratio", pid="1648") == 0.25
    assert value(r, "mps_client_active_thread_ratio", pid="1647") == 0.5
    assert value(r, "mps_client_start_time_seconds", pid="1649") == 1795234898.2


def test_log_start_times_win_over_proc(monkeypatch):
    # Only the join is under test here; the log families are the log pipeline's tests.
    monkeypatch.setattr("mps_exporter.render.render_log_metrics", lambda *a: None)

    class LogServer:
        start_time, uid, active_thread_percentage, pinned_limits, running = 1795234880.5, 0, 100.0, {}, True
        priority = None

    class Logs:
        servers = {1589: LogServer()}
        client_start_times = {1647: 1795234897.75}
        client_limits: dict = {}
        state_file_errors = None

    r = samples(snapshot(logs={"default": Logs()}))
    assert value(r, "mps_server_start_time_seconds", server_pid="1589") == 1795234880.5
    assert value(r, "mps_client_start_time_seconds", pid="1647") == 1795234897.75
    # With the daemon gone silent, the logs' running server still gets its table rows.
    r = samples(snapshot(logs={"default": Logs()}, daemons=[busy_daemon(up=True, error="timeout", servers=[], clients=[])]))
    assert value(r, "mps_server_info", server_pid="1589", uid="0") == 1
    assert value(r, "mps_server_active_thread_ratio", server_pid="1589") == 1.0


def test_daemon_down_keeps_gpu_memory_and_claims_no_client():
    down = busy_daemon(up=False, servers=[], clients=[], version="", default_active_thread_percentage=None)
    r = samples(snapshot(daemons=[down]))
    assert value(r, "mps_control_daemon_up", daemon="default") == 0
    assert absent(r, "mps_server_info")
    assert value(r, "mps_gpu_memory_used_bytes", gpu="0") > 0
    # NVML still lists the MPS clients, but a daemon that is down has none: a SIGKILLed
    # daemon's clients outlive it, each a client of nothing (issue 38).
    assert absent(r, "mps_client_info") and absent(r, "mps_client_memory_used_bytes")


def test_an_unlisted_nvml_client_goes_to_the_daemon_whose_pipe_it_uses():
    """A client `ps` did not list (it connected after it): the daemon whose pipe directory
    its CUDA_MPS_PIPE_DIRECTORY names claims it; another daemon's client on the same GPU,
    with the exporter watching one daemon only, is nobody's here (issue 38's churn run)."""
    mine, other = (1, 2), (1, 3)
    daemon = busy_daemon(clients=[c for c in busy_daemon().clients if c.pid != 1649], pipe_identity=mine)
    procs = {1649: ProcessFacts(1649, mps_pipe=mine)}
    r = samples(snapshot(daemons=[daemon], processes=procs))
    assert value(r, "mps_client_info", pid="1649", server_pid="") == 1
    procs = {1649: ProcessFacts(1649, mps_pipe=other)}
    r = samples(snapshot(daemons=[daemon], processes=procs))
    assert absent(r, "mps_client_info", pid="1649")
    assert value(r, "mps_client_info", pid="1648") == 1  # the listed ones are the daemon's whatever
    procs = {1649: ProcessFacts(1649)}  # its pipe cannot be told: the only daemon's, as before
    r = samples(snapshot(daemons=[daemon], processes=procs))
    assert value(r, "mps_client_info", pid="1649", server_pid="") == 1


def test_failed_gpu_reports_up_zero_only():
    r = samples(snapshot(nvml=NvmlReading("580.159.04", [busy_gpu(), GpuReading(index=1, uuid="GPU-2", up=False)])))
    assert value(r, "mps_gpu_up", gpu="1") == 0
    assert absent(r, "mps_gpu_memory_used_bytes", gpu="1")
    assert value(r, "mps_gpu_up", gpu="0") == 1


def test_collector_outcomes():
    r = samples(snapshot(outcomes={"nvml": Outcome(False, 0.0001), "control": Outcome(True, 0.006)}))
    assert value(r, "mps_exporter_collector_success", collector="nvml") == 0
    assert value(r, "mps_exporter_collector_success", collector="control") == 1
    assert value(r, "mps_exporter_collector_duration_seconds", collector="control") == 0.006


@pytest.mark.parametrize("gpu_kw,mode", [
    (dict(mig_enabled=True), "mig"),
    (dict(mps_clients=[], compute_processes=[]), "idle"),
    (dict(mps_clients=[], compute_processes=[ProcessMemory(5, 1)]), "exclusive"),
    (dict(mps_clients=[], compute_processes=[ProcessMemory(5, 1), ProcessMemory(6, 1)]), "time_slicing"),
    (dict(mps_clients=[], compute_processes=[ProcessMemory(1589, 1)]), "mps"),  # a server with no client yet
])
def test_sharing_mode(gpu_kw, mode):
    assert sharing_mode(busy_gpu(**gpu_kw), {1589}, {}) == mode


def test_per_process_utilization_without_mps():
    gpu = busy_gpu(mps_clients=[], compute_processes=[ProcessMemory(5, 1), ProcessMemory(6, 1)],
                   process_utilization=[ProcessUtilization(5, 0.4, 10), ProcessUtilization(5, 0.6, 20),
                                        ProcessUtilization(6, 0.3, 15)])
    r = samples(snapshot(nvml=NvmlReading("580", [gpu]), daemons=[]))
    assert value(r, "mps_process_sm_utilization_ratio", pid="5") == 0.6  # the newest sample
    assert value(r, "mps_process_sm_utilization_ratio", pid="6") == 0.3


def test_process_without_a_new_sample_was_idle():
    # 6 has no sample since the last scrape: NVML lists only processes that used the SMs.
    gpu = busy_gpu(mps_clients=[], compute_processes=[ProcessMemory(5, 1), ProcessMemory(6, 1)],
                   process_utilization=[ProcessUtilization(5, 0.4, 10)])
    r = samples(snapshot(nvml=NvmlReading("580", [gpu]), daemons=[]))
    assert value(r, "mps_process_sm_utilization_ratio", pid="6") == 0.0
    # the same for the MPS server: an idle server reads 0, its series does not vanish
    r = samples(snapshot(nvml=NvmlReading("580", [busy_gpu(process_utilization=[])])))
    assert value(r, "mps_server_sm_utilization_ratio", server_pid="1589", gpu="0") == 0.0


# ------------------------------------------------------- --mps.client-granularity
def _samples(tmp_path, mode, **kw):
    from tests.support import scenarios

    scen = scenarios.synthetic(tmp_path / mode, **kw)
    scen.cfg.client_granularity = mode
    return [s for family in scen.collector().collect() for s in family.samples], scen


def _total(samples, name):
    return sum(s.value for s in samples if s.name == name)


def test_pod_granularity_sums_clients_per_server_and_pod(tmp_path):
    """8 GPUs x 48 clients, each in its own pod but the last: no pid label, and the same
    memory, limits and client count in sums (one series per pod and GPU)."""
    client, scen = _samples(tmp_path, "client", gpus=8, clients_per_gpu=48, clients_per_pod=1)
    pod, _ = _samples(tmp_path, "pod", gpus=8, clients_per_gpu=48, clients_per_pod=1)
    assert not any("pid" in s.labels for s in pod)
    # (The queue and the exits at the memory edge are counted per daemon, not per client.)
    assert not any(s.name.startswith("mps_client_")
                   and not s.name.startswith(("mps_client_queue", "mps_client_exits_at_memory_limit")) for s in pod)
    assert _total(pod, "mps_pod_clients") == 8 * 48 == sum(1 for s in client if s.name == "mps_client_info")
    assert _total(pod, "mps_pod_client_memory_used_bytes") == _total(client, "mps_client_memory_used_bytes") > 0
    assert _total(pod, "mps_pod_client_pinned_memory_limit_bytes") == \
        _total(client, "mps_client_pinned_memory_limit_bytes") > 0
    # One series per pod; the bare process is counted under pod_uid "".
    pods = {s.labels["pod_uid"]: s.value for s in pod if s.name == "mps_pod_clients"}
    assert len(pods) == 8 * 48 and pods[""] == 1 and set(pods) - {""} == {u for u, _ in scen.pods.values()}
    assert not any(s.name.startswith("mps_server_client_") for s in pod)


def test_server_granularity_sums_clients_per_server(tmp_path):
    """The same clients summed per server and GPU: no pid or pod label; the same memory and
    limits in sums; the fullest client's memory / limit per server and GPU, as computed
    from the per-client series."""
    client, _ = _samples(tmp_path, "client", gpus=8, clients_per_gpu=48, clients_per_pod=1)
    server, _ = _samples(tmp_path, "server", gpus=8, clients_per_gpu=48, clients_per_pod=1)
    assert not any({"pid", "pod_uid"} & set(s.labels) for s in server)
    assert not any(s.name.startswith(("mps_client_info", "mps_client_memory", "mps_pod_")) for s in server)
    assert _total(server, "mps_server_client_memory_used_bytes") == _total(client, "mps_client_memory_used_bytes") > 0
    assert _total(server, "mps_server_client_pinned_memory_limit_bytes") == \
        _total(client, "mps_client_pinned_memory_limit_bytes") > 0
    server_of = {s.labels["pid"]: s.labels["server_pid"] for s in client if s.name == "mps_client_info"}
    limit = {(s.labels["pid"], s.labels["gpu"]): s.value for s in client
             if s.name == "mps_client_pinned_memory_limit_bytes"}
    expected = {}
    for s in client:
        if s.name == "mps_client_memory_used_bytes" and limit.get((s.labels["pid"], s.labels["gpu"])):
            key = (server_of[s.labels["pid"]], s.labels["gpu"])
            expected[key] = max(expected.get(key, 0.0), s.value / limit[(s.labels["pid"], s.labels["gpu"])])
    fullest = {(s.labels["server_pid"], s.labels["gpu"]): s.value for s in server
               if s.name == "mps_server_client_pinned_memory_usage_max_ratio"}
    assert fullest == expected and len(fullest) == 8
    # A sum hides what the max shows: the per-server ratio of sums is below the fullest client.
    assert any(v > _total([s for s in server if s.labels.get("gpu") == g], "mps_server_client_memory_used_bytes")
               / _total([s for s in server if s.labels.get("gpu") == g], "mps_server_client_pinned_memory_limit_bytes")
               for (_, g), v in fullest.items())


@pytest.mark.parametrize("clients_per_pod", [0, 1, 6])
def test_server_granularity_cuts_an_8x48_node_by_4x(tmp_path, clients_per_pod):
    """Issue 19: 8 GPUs x 48 clients, outside pods, one pod each, or six to a pod: at least
    4x fewer series at --mps.client-granularity server, and the clients all counted."""
    client, _ = _samples(tmp_path, "client", gpus=8, clients_per_gpu=48, clients_per_pod=clients_per_pod)
    server, _ = _samples(tmp_path, "server", gpus=8, clients_per_gpu=48, clients_per_pod=clients_per_pod)
    assert len(client) >= 4 * len(server), (len(client), len(server))
    assert _total(server, "mps_server_clients") == 8 * 48


def test_a_process_outside_mps_on_an_mps_gpu():
    """Issue 24: a CUDA process whose CUDA_MPS_PIPE_DIRECTORY reaches no daemon runs beside
    MPS on the same GPU (1.4 GiB; nvidia-smi lists it, NVML's MPS list does not)."""
    gpu = busy_gpu()
    gpu.compute_processes = gpu.compute_processes + [ProcessMemory(7777, 1468006400)]
    procs = {**processes(), 7777: ProcessFacts(7777, uid=1500, user="alice", command="python3",
                                               pod_uid="0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9")}
    r = samples(snapshot(nvml=NvmlReading("580.159.04", [gpu]), processes=procs))
    g = dict(gpu="0", uuid=UUID)
    assert value(r, "mps_gpu_sharing_mode", **g, mode="mixed") == 1
    assert value(r, "mps_gpu_processes_outside_mps", **g) == 1
    assert value(r, "mps_process_outside_mps_memory_used_bytes", **g, pid="7777") == 1468006400
    assert value(r, "mps_process_outside_mps_info", **g, pid="7777", uid="1500", user="alice", command="python3",
                 pod_uid="0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9") == 1
    assert absent(r, "mps_client_info", pid="7777")
    # The MPS server and its clients are no outsiders; a GPU MPS does not serve has none.
    r = samples(snapshot())
    assert value(r, "mps_gpu_processes_outside_mps", **g) == 0 and absent(r, "mps_process_outside_mps_info")
    plain = busy_gpu(mps_clients=[], compute_processes=[ProcessMemory(5, 1), ProcessMemory(6, 1)])
    r = samples(snapshot(nvml=NvmlReading("580.159.04", [plain]), daemons=[busy_daemon(servers=[], clients=[])]))
    assert value(r, "mps_gpu_processes_outside_mps", **g) == 0


def test_a_client_limit_cuda_drops_is_published_as_ignored_not_in_force():
    """`0=2G,1=4G` with one GPU visible: MPS enforced no pinned limit at all (issue 24)."""
    procs = processes()
    procs[1648] = ProcessFacts(1648, uid=0, user="root", command="python3",
                               environ={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G,1=4G",
                                        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "abc"})
    r = samples(snapshot(processes=procs))
    c = dict(daemon="default", pid="1648")
    assert absent(r, "mps_client_pinned_memory_limit_bytes", **c)
    assert value(r, "mps_client_limit_ignored", **c, limit="pinned_memory", reason="invisible_device") == 1
    assert value(r, "mps_client_limit_ignored", **c, limit="active_threads", reason="not_a_number") == 1
    assert value(r, "mps_client_limit_source", **c, pinned_memory="none", active_threads="server_now",
                 priority="none") == 1
    assert value(r, "mps_client_active_thread_ratio", **c) == 1.0
    # The GPU-<uuid prefix> form binds.
    procs[1648] = dataclasses.replace(procs[1648], environ={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "GPU-a20825ef=2G"})
    r = samples(snapshot(processes=procs))
    assert value(r, "mps_client_pinned_memory_limit_bytes", **c, gpu="0") == 2 << 30
    assert value(r, "mps_client_limit_source", **c, pinned_memory="client") == 1
    assert absent(r, "mps_client_limit_ignored", **c)


@pytest.mark.parametrize("granularity", ["pod", "server"])
def test_ignored_client_limits_are_counted_per_server_without_per_client_series(granularity):
    procs = processes()
    for pid in (1647, 1648):
        procs[pid] = ProcessFacts(pid, uid=0, user="root", command="python3",
                                  environ={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G,1=4G"})
    out = {}
    for fam in render(snapshot(processes=procs), granularity).families():
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    assert value(out, "mps_server_clients_limit_ignored", daemon="default", server_pid="1589", limit="pinned_memory",
                 reason="invisible_device") == 2
    assert absent(out, "mps_client_limit_ignored") and absent(out, "mps_client_limit_source")


def test_a_gpus_series_are_its_last_samples_where_their_value_stayed():
    # emit_gpu with the render's memo: a value that stayed is the very sample again, one that
    # moved keeps its labels; -0.0 is no 0.0, NaN no number, another GPU (UUID) no reuse.
    from mps_exporter.families import FamilyBuilder
    from mps_exporter.join import gpu_row
    from mps_exporter.render import ClientTableMemo, emit_gpu

    memo = ClientTableMemo()

    def emitted(**overrides):
        g = busy_gpu(**overrides)
        out = FamilyBuilder()
        emit_gpu(out, gpu_row(g, "580.65.06", {}, {1589}, {1647, 1648, 1649}, {}),
                 memo.gpus.setdefault((g.index, g.uuid), {}))
        return {name: samples[0] for name, samples in out.parts() if len(samples) == 1}

    first = emitted()
    second = emitted(power_watts=650.5)
    power = second["mps_gpu_power_watts"]
    assert power.value == 650.5 and power.labels == {"gpu": "0", "uuid": UUID}
    assert second["mps_gpu_power_watts"] is not first["mps_gpu_power_watts"]
    alone = [name for name, sample in first.items() if sample.labels.keys() == {"gpu", "uuid"}]
    assert len(alone) == 10 and all(second[name] is first[name] for name in alone if name != "mps_gpu_power_watts")
    assert str(emitted(memory_utilization_ratio=-0.0)["mps_gpu_memory_utilization_ratio"].value) == "-0.0"
    assert str(emitted(memory_utilization_ratio=0.0)["mps_gpu_memory_utilization_ratio"].value) == "0.0"
    assert "mps_gpu_temperature_celsius" not in emitted(temperature_celsius=float("nan"))
    assert emitted()["mps_gpu_temperature_celsius"].value == 60
    other = "GPU-00000000-0000-0000-0000-000000000000"
    assert emitted(uuid=other)["mps_gpu_up"].labels == {"gpu": "0", "uuid": other}
    # and a render without the memo writes the same text
    plain = FamilyBuilder()
    emit_gpu(plain, gpu_row(busy_gpu(), "580.65.06", {}, {1589}, {1647, 1648, 1649}, {}))
    assert {name: samples[0] for name, samples in plain.parts() if len(samples) == 1} == emitted()


def test_a_daemons_log_families_are_last_times_while_its_snapshot_stays_and_nobody_waits(monkeypatch):
    # The pipeline publishes a new snapshot when lines change it; with a client queued the
    # oldest wait follows the clock, so that snapshot is rendered at every scrape.
    from mps_exporter import render as render_module
    from mps_exporter.families import FamilyBuilder
    from mps_exporter.model import LogSnapshot, PendingClient
    from mps_exporter.render import ClientTableMemo

    real = render_module.render_log_metrics
    rendered_for = []
    monkeypatch.setattr(render_module, "render_log_metrics",
                        lambda out, daemon, snap, now: rendered_for.append(now) or real(out, daemon, snap, now))
    memo = ClientTableMemo()

    def families(snap, now, with_memo=True):
        out = FamilyBuilder()
        if with_memo:
            memo.render_logs(out, {"default": snap}, now)
        else:
            real(out, "default", snap, now)
        return [(name, [(s.labels, s.value) for s in samples]) for name, samples in out.parts()]

    quiet = LogSnapshot(counts={"mps_server_faults_total": 2}, commands={"ps": 7})
    assert families(quiet, 100.0) == families(quiet, 100.0, with_memo=False)
    assert families(quiet, 160.0) == families(quiet, 160.0, with_memo=False) and rendered_for == [100.0]
    moved = LogSnapshot(counts={"mps_server_faults_total": 3}, commands={"ps": 7})  # a new line: a new snapshot
    assert families(moved, 175.0) == families(moved, 175.0, with_memo=False) and rendered_for == [100.0, 175.0]
    waiting = LogSnapshot(pending=[PendingClient(pid=4242, uid=1500, reason="user_switch", pushed_at=150.0)],
                          queued={"user_switch": 1, "client_limit": 0})
    at_160, at_190 = families(waiting, 160.0), families(waiting, 190.0)
    assert at_160 == families(waiting, 160.0, with_memo=False) and at_190 == families(waiting, 190.0, with_memo=False)
    assert at_160 != at_190 and rendered_for[-2:] == [160.0, 190.0]  # the oldest wait: 10 s, then 40 s
