"""The NVML source against the fake pynvml: recorded H200 answers, synthetic
scenarios and failure injection. Expected values are derived from the capture
JSON or from the scenario's inputs, never copied from the source's output."""

import collections
import contextlib
import copy
import ctypes
import inspect
from typing import List

import pynvml
import pytest

from mps_exporter.sources import nvml as nvml_source
from mps_exporter.sources.nvml import COMPUTE_MODES, GPM_METRICS, DirectLists, NvmlClient, NvmlUnavailable
from tests.fakes import fake_pynvml as fp
from tests.fakes.fake_pynvml import MAX_CLIENT_SHARE, FakeNvml, load_capture



def read_twice(fake, seconds=10.0):
    """A source that has scraped once, then `seconds` later a second time."""
    source = NvmlClient(fake)
    first = source.read()
    fake.advance(seconds)
    return source, first, source.read()


# ------------------------------------------------------ the fake is faithful
def test_fake_constants_and_error_classes_match_real_pynvml():
    names = [n for n in vars(fp) if n.startswith("NVML_") and n != "NVML_VALUE_NOT_AVAILABLE_ulonglong"]
    assert len(names) > 30
    for name in names:
        assert getattr(pynvml, name) == getattr(fp, name), name
    event_types = [n for n in vars(fp) if n.startswith("nvmlEventType")]
    assert "nvmlEventTypeXidCriticalError" in event_types
    for name in event_types:
        assert getattr(pynvml, name) == getattr(fp, name) == getattr(FakeNvml, name), name
    assert fp.NVML_VALUE_NOT_AVAILABLE_ulonglong.value == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    for name, cls in fp.ERROR_CLASSES.items():
        real = getattr(pynvml, name)
        assert real().value == cls().value, name
        assert type(pynvml.NVMLError(real().value)).__name__ == type(fp.NVMLError(cls().value)).__name__
    assert str(fp.NVMLError(fp.NVML_ERROR_NOT_FOUND)) == "Not Found"  # the capture's message


def test_fake_functions_have_real_names_and_parameters():
    functions = [n for n in vars(FakeNvml) if n.startswith("nvml") and callable(getattr(FakeNvml, n))]
    assert "nvmlGpmMetricsGet" in functions and "nvmlDeviceGetProcessUtilization" in functions
    assert {"nvmlEventSetCreate", "nvmlDeviceRegisterEvents", "nvmlEventSetWait_v2", "nvmlEventSetFree"} <= set(functions)
    for name in functions:
        real = inspect.signature(getattr(pynvml, name))
        fake = inspect.signature(getattr(FakeNvml(gpus=[]), name))
        assert list(fake.parameters) == list(real.parameters), name


def test_fake_structs_have_real_field_names():
    real_metrics_get = [f[0] for f in pynvml.c_nvmlGpmMetricsGet_t._fields_]
    assert sorted(vars(fp.c_nvmlGpmMetricsGet_t())) == sorted(real_metrics_get)
    assert sorted(vars(fp.c_nvmlGpmMetric_t())) == sorted(f[0] for f in pynvml.c_nvmlGpmMetric_t._fields_)
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=1)
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    cases = [
        (fake.nvmlDeviceGetMemoryInfo(h), pynvml.c_nvmlMemory_t),
        (fake.nvmlDeviceGetUtilizationRates(h), pynvml.c_nvmlUtilization_t),
        (fake.nvmlDeviceGetComputeRunningProcesses(h)[0], pynvml.c_nvmlProcessInfo_v3_t),
        (fake.nvmlDeviceGetProcessUtilization(h, 0)[0], pynvml.c_nvmlProcessUtilizationSample_t),
        (fake.nvmlGpmQueryDeviceSupport(h), pynvml.c_nvmlGpmSupport_t),
    ]
    event_set = fake.nvmlEventSetCreate()
    fake.nvmlDeviceRegisterEvents(h, fp.nvmlEventTypeXidCriticalError, event_set)
    assert fake.inject_xid(0, 79) == 1
    cases.append((fake.nvmlEventSetWait_v2(event_set, 0), pynvml.c_nvmlEventData_t))
    for obj, real in cases:
        assert sorted(vars(obj)) == sorted(f[0] for f in real._fields_), real.__name__


def test_fake_requires_init_like_nvml():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=0)
    with pytest.raises(fp.NVMLError) as e:
        fake.nvmlDeviceGetCount()
    assert e.value.value == fp.NVML_ERROR_UNINITIALIZED


def test_capture_latency_mode_maps_each_call_to_its_measured_us(monkeypatch):
    doc = load_capture("busy")
    fake = FakeNvml.from_capture("busy", latency=True)
    assert fake.latency_us["nvmlDeviceGetPowerUsage"] == doc["power_mw"]["us"]
    assert fake.latency_us["nvmlDeviceGetUtilizationRates"] == doc["util"]["us"] / 2  # the probe called it twice
    slept = []
    monkeypatch.setattr(fp.time, "sleep", slept.append)
    source = NvmlClient(fake)
    source.read()
    # One scrape makes each captured call once and sleeps its measured time; the first
    # also asks each list how long it is, to size the buffer kept for the next reads.
    lists = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses",
             "nvmlDeviceGetProcessUtilization")
    expected = [us / 1e6 for us in fake.latency_us.values()] + [fake.latency_us[f] / 1e6 for f in lists]
    assert sorted(slept) == pytest.approx(sorted(expected))
    assert pytest.approx(doc["proc_util"]["us"] / 1e6) in slept
    slept.clear()
    source.read()
    assert sorted(s for s in slept if s in [fake.latency_us[f] / 1e6 for f in lists]) == pytest.approx(
        sorted(fake.latency_us[f] / 1e6 for f in lists))  # then one call each


# --------------------------------------------------------- recorded answers
@pytest.mark.parametrize("name", ["idle", "busy", "many"])
def test_every_gpu_field_from_the_capture(name):
    doc = load_capture(name)
    v = {k: e["v"] for k, e in doc.items() if isinstance(e, dict) and "v" in e}
    reading = NvmlClient(FakeNvml.from_capture(name)).read()
    assert reading.driver_version == v["driver"] == "580.159.04"
    assert len(reading.gpus) == v["count"]
    gpu = reading.gpus[0]
    assert gpu.up and gpu.index == 0
    assert gpu.name == v["name"] and gpu.uuid == v["uuid"]
    assert gpu.compute_mode == "default" and v["compute_mode"] == 0
    assert gpu.mig_enabled is (v["mig_mode"][0] == 1)
    assert gpu.memory_total_bytes == v["mem"]["total"]
    assert gpu.memory_used_bytes == v["mem"]["used"]
    assert gpu.utilization_ratio == pytest.approx(v["util_gpu"] / 100)
    assert gpu.memory_utilization_ratio == pytest.approx(v["util_mem"] / 100)
    assert gpu.power_watts == pytest.approx(v["power_mw"] / 1000)
    assert gpu.temperature_celsius == v["temp"]
    assert [(p.pid, p.used_bytes) for p in gpu.compute_processes] == [(p["pid"], p["usedGpuMemory"]) for p in v["compute_procs"]]
    assert [(p.pid, p.used_bytes) for p in gpu.mps_clients] == [(p["pid"], p["usedGpuMemory"]) for p in v["mps_procs"]]
    if doc["proc_util"]["ok"]:
        expected = [(s["pid"], s["smUtil"] / 100, s["timeStamp"]) for s in v["proc_util"]]
    else:
        assert "NotFound" in v["proc_util"]  # idle: NVML has no sample, and that is no error
        expected = []
    assert [(u.pid, pytest.approx(u.sm_ratio), u.timestamp_us) for u in gpu.process_utilization] == expected
    assert gpu.activity == {}  # GPM needs a previous sample


def test_busy_capture_has_the_server_in_compute_processes_but_not_among_clients():
    gpu = NvmlClient(FakeNvml.from_capture("busy")).read().gpus[0]
    server = {p.pid for p in gpu.compute_processes} - {p.pid for p in gpu.mps_clients}
    assert server == {u.pid for u in gpu.process_utilization} == {1589}


def test_many_capture_lists_every_client():
    doc = load_capture("many")
    gpu = NvmlClient(FakeNvml.from_capture("many")).read().gpus[0]
    assert len(gpu.mps_clients) == len(doc["mps_procs"]["v"]) > 20
    assert len(gpu.compute_processes) == len(gpu.mps_clients) + 1


# ---------------------------------------------------------------- scenarios
def test_eight_gpus_by_forty_eight_clients():
    reading = NvmlClient(FakeNvml.synthetic(gpus=8, clients_per_gpu=48)).read()
    assert [g.index for g in reading.gpus] == list(range(8))
    assert len({g.uuid for g in reading.gpus}) == 8
    pids = set()
    for g in reading.gpus:
        assert g.up and len(g.mps_clients) == 48 and len(g.compute_processes) == 49
        # (k + 1) steps of memory, the step cut so that the 48 fit: within MAX_CLIENT_SHARE of the GPU
        step = g.mps_clients[0].used_bytes
        assert [c.used_bytes for c in g.mps_clients] == [(k + 1) * step for k in range(48)]
        assert sum(c.used_bytes for c in g.mps_clients) <= MAX_CLIENT_SHARE * g.memory_total_bytes
        assert [u.pid for u in g.process_utilization] == [4000]  # under MPS only the server has utilization
        pids |= {c.pid for c in g.mps_clients}
    assert len(pids) == 8 * 48


def test_a_process_list_that_stays_equal_is_given_again_as_the_very_same_list():
    # What is joined from it is then known unchanged by identity (join._clients_inputs).
    nvml = FakeNvml.synthetic(gpus=2, clients_per_gpu=3)
    client = NvmlClient(nvml, wait_for_every_answer=True)
    first = client.read()
    nvml.advance(1.0)  # utilization moves, the lists do not
    again = client.read()
    for a, b in zip(first.gpus, again.gpus):
        assert a is not b and a.mps_clients is b.mps_clients and a.compute_processes is b.compute_processes
    nvml.gpus[1].mps_processes[0].usedGpuMemory += 1 << 20  # one client's memory on GPU 1 moves
    moved = client.read()
    assert moved.gpus[0].mps_clients is first.gpus[0].mps_clients
    assert moved.gpus[1].mps_clients is not first.gpus[1].mps_clients
    assert moved.gpus[1].mps_clients[0].used_bytes == first.gpus[1].mps_clients[0].used_bytes + (1 << 20)


def test_newer_utilization_samples_at_the_same_ratios_are_the_last_list_again():
    # The readings then compare equal and a scrape reuses their encoding (render.readings_key).
    nvml = FakeNvml.synthetic(gpus=2, clients_per_gpu=3)
    client = NvmlClient(nvml, wait_for_every_answer=True)
    first = client.read()
    assert all(g.process_utilization for g in first.gpus)
    nvml.advance(15.0)  # newer samples, same processes, same ratios
    again = client.read()
    for a, b in zip(first.gpus, again.gpus):
        assert b.process_utilization is a.process_utilization
    server = again.gpus[1].process_utilization[0].pid
    nvml.gpus[1].sm_util_by_pid[server] = (41, 3)  # GPU 1's server now at 41 %
    nvml.advance(15.0)
    moved = client.read()
    assert moved.gpus[0].process_utilization is first.gpus[0].process_utilization
    assert moved.gpus[1].process_utilization is not first.gpus[1].process_utilization
    assert [u.sm_ratio for u in moved.gpus[1].process_utilization] == [0.41]
    assert moved.gpus[1].process_utilization[0].timestamp_us > first.gpus[1].process_utilization[0].timestamp_us


@pytest.mark.parametrize("name, fields, values", [
    ("c_nvmlProcessInfo_v3_t", nvml_source.PID_AND_MEMORY, [(4242, 1 << 30), (7, 0), (2**32 - 1, 2**64 - 1)]),
    ("c_nvmlProcessInfo_v2_t", nvml_source.PID_AND_MEMORY, [(4242, 1 << 30), (7, 0), (2**32 - 1, 2**64 - 1)]),
    ("c_nvmlProcessUtilizationSample_t", nvml_source.PID_TIME_AND_SM,
     [(4242, 1_700_000_000_000_000, 37), (7, 0, 0), (2**32 - 1, 2**64 - 1, 100)]),
])
def test_rows_are_unpacked_by_the_real_structs_layout(name, fields, values):
    struct = getattr(pynvml, name)  # nvidia-ml-py's own: the layout the driver fills
    assert nvml_source._unpackable(struct, fields)
    rows = (struct * 3)()
    for row, row_values in zip(rows, values):
        for field, value in zip(fields, row_values):
            setattr(row, field, value)
        for other, _ in struct._fields_:
            if other not in fields:
                setattr(row, other, 0xABCD)  # the other fields are skipped, whatever they hold
    assert nvml_source._rows(rows, 3, struct, fields) == values
    assert nvml_source._rows(rows, 0, struct, fields) == []


def test_a_struct_whose_fields_are_out_of_order_or_not_integers_is_not_unpacked():
    assert not nvml_source._unpackable(pynvml.c_nvmlProcessUtilizationSample_t, ("timeStamp", "pid"))
    assert not nvml_source._unpackable(pynvml.c_nvmlProcessInfo_v3_t, ("pid", "noSuchField"))
    assert not nvml_source._unpackable(pynvml.c_nvmlMemory_t, ("total", "used", "free"))  # used lies after free
    assert nvml_source._unpackable(pynvml.c_nvmlMemory_t, ("total", "free", "used"))
    assert not nvml_source._unpackable(pynvml.c_nvmlGpmMetric_t, ("metricId", "value"))  # a double


def test_time_sliced_gpu_has_per_process_utilization():
    gpu = NvmlClient(FakeNvml.synthetic(gpus=1, clients_per_gpu=3, mps=False)).read().gpus[0]
    assert gpu.mps_clients == []
    assert {u.pid: u.sm_ratio for u in gpu.process_utilization} == {p.pid: pytest.approx(0.30) for p in gpu.compute_processes}


@pytest.mark.parametrize("mode", sorted(COMPUTE_MODES))
def test_compute_modes_are_lowercase_names(mode):
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=0)
    fake.gpus[0].compute_mode = mode
    expected = {fp.NVML_COMPUTEMODE_DEFAULT: "default", fp.NVML_COMPUTEMODE_EXCLUSIVE_THREAD: "exclusive_thread",
                fp.NVML_COMPUTEMODE_PROHIBITED: "prohibited", fp.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "exclusive_process"}
    assert NvmlClient(fake).read().gpus[0].compute_mode == expected[mode]


@pytest.mark.parametrize("mig, enabled", [((1, 1), True), ((0, 1), False), (None, False)])
def test_mig_mode(mig, enabled):
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=0)
    fake.gpus[0].mig_mode = mig  # None: a GPU without MIG answers NOT_SUPPORTED
    gpu = NvmlClient(fake).read().gpus[0]
    assert gpu.up and gpu.mig_enabled is enabled


def test_compute_and_mig_mode_are_read_again_after_modes_seconds(monkeypatch):
    import mps_exporter.sources.nvml as nvml_module

    clock = [1000.0]
    monkeypatch.setattr(nvml_module.time, "monotonic", lambda: clock[0])
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=0)
    client = NvmlClient(fake)
    assert client.read().gpus[0].compute_mode == "default"
    fake.gpus[0].compute_mode = fp.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS  # as nvidia-smi -c 3 does
    fake.gpus[0].mig_mode = (1, 1)
    clock[0] += nvml_module.MODES_SECONDS - 1
    gpu = client.read().gpus[0]
    assert (gpu.compute_mode, gpu.mig_enabled) == ("default", False)  # not asked again yet
    clock[0] += 1
    gpu = client.read().gpus[0]
    assert (gpu.compute_mode, gpu.mig_enabled) == ("exclusive_process", True)


def test_used_gpu_memory_none_stays_none():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=2)
    fake.gpus[0].mps_processes[0].usedGpuMemory = None
    fake.gpus[0].compute_processes[1].usedGpuMemory = None
    gpu = NvmlClient(fake).read().gpus[0]
    assert gpu.mps_clients[0].used_bytes is None and gpu.mps_clients[1].used_bytes == 2 * (512 << 20)
    assert gpu.compute_processes[1].used_bytes is None


def test_raw_value_not_available_becomes_none():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=1)
    fake.convert_not_available = False  # a wrapper that passes NVML's sentinel through
    fake.gpus[0].mps_processes[0].usedGpuMemory = fp.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    assert NvmlClient(fake).read().gpus[0].mps_clients[0].used_bytes is None


# ----------------------------------------------------------------- failures
@pytest.mark.parametrize("failing", ["*", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMemoryInfo",
                                     "nvmlDeviceGetMPSComputeRunningProcesses"])
def test_error_on_one_gpu_of_several_marks_only_that_gpu_down(failing):
    fake = FakeNvml.synthetic(gpus=3, clients_per_gpu=2)
    fake.gpus[1].errors[failing] = fp.NVML_ERROR_GPU_IS_LOST
    gpus = NvmlClient(fake).read().gpus
    assert [g.up for g in gpus] == [True, False, True]
    assert gpus[1].mps_clients == [] and gpus[1].memory_total_bytes is None
    for i in (0, 2):
        assert gpus[i].uuid == fake.gpus[i].uuid and len(gpus[i].mps_clients) == 2


def test_a_handle_is_asked_once_per_gpu_and_again_after_the_gpu_failed():
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    source = NvmlClient(fake)
    for _ in range(3):
        assert all(g.up for g in source.read().gpus)
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 2
    fake.gpus[1].errors["nvmlDeviceGetMemoryInfo"] = fp.NVML_ERROR_GPU_IS_LOST
    assert [g.up for g in source.read().gpus] == [True, False]
    del fake.gpus[1].errors["nvmlDeviceGetMemoryInfo"]
    assert [g.up for g in source.read().gpus] == [True, True]
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 3  # GPU 1's asked anew
    source.close()
    source.read()  # NVML initialised again: handles of before are stale
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 5


def test_gpu_down_after_a_good_scrape_keeps_its_identity():
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    source = NvmlClient(fake)
    source.read()
    fake.gpus[0].errors["*"] = fp.NVML_ERROR_GPU_IS_LOST
    gpu = source.read().gpus[0]
    assert not gpu.up and gpu.uuid == fake.gpus[0].uuid


@pytest.mark.parametrize("function, field", [
    ("nvmlDeviceGetPowerUsage", "power_watts"),
    ("nvmlDeviceGetTemperature", "temperature_celsius"),
])
def test_optional_field_error_drops_only_that_field(function, field):
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=2)
    fake.gpus[0].errors[function] = fp.NVML_ERROR_NOT_SUPPORTED
    gpu = NvmlClient(fake).read().gpus[0]
    assert gpu.up and getattr(gpu, field) is None
    others = {"power_watts": fake.gpus[0].power_mw / 1000, "temperature_celsius": fake.gpus[0].temperature}
    others.pop(field)
    for name, value in others.items():
        assert getattr(gpu, name) == pytest.approx(value)
    assert len(gpu.mps_clients) == 2 and gpu.process_utilization


def test_process_utilization_error_drops_only_utilization():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=2)
    fake.gpus[0].errors["nvmlDeviceGetProcessUtilization"] = fp.NVML_ERROR_NO_PERMISSION
    gpu = NvmlClient(fake).read().gpus[0]
    assert gpu.up and gpu.process_utilization == [] and gpu.power_watts is not None


@pytest.mark.parametrize("code, message", [(fp.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
                                           (fp.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found")])
def test_no_driver_raises_clearly_and_init_is_retried(code, message):
    fake = FakeNvml.no_driver(code)
    source = NvmlClient(fake)
    for _ in range(2):
        with pytest.raises(NvmlUnavailable, match=f"NVML cannot initialise: {message}") as err:
            source.read()
        # issue 43: a user trying it on a laptop learns where the demo is
        assert "for a demo without a GPU: mps-exporter replay" in str(err.value)
    assert fake.calls["nvmlInit"] == 2
    # The driver comes back (module loaded, GPU attached): the next scrape works.
    del fake.errors["nvmlInit"]
    fake.gpus.append(fp.FakeGpu())
    assert [g.up for g in source.read().gpus] == [True]
    source.read()
    assert fake.calls["nvmlInit"] == 3  # initialised once, not per scrape


def test_nvml_lost_mid_life_reinitialises_next_scrape():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=1)
    source = NvmlClient(fake)
    source.read()
    fake.errors["nvmlDeviceGetCount"] = fp.NVML_ERROR_UNKNOWN
    with pytest.raises(NvmlUnavailable, match="Unknown Error"):
        source.read()
    del fake.errors["nvmlDeviceGetCount"]
    assert source.read().gpus[0].up
    assert fake.calls["nvmlInit"] == 2


def test_default_module_is_pynvml_imported_lazily(monkeypatch):
    fake = FakeNvml.no_driver()
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    source = NvmlClient()
    assert fake.calls["nvmlInit"] == 0  # nothing happens before the first scrape
    with pytest.raises(NvmlUnavailable):
        source.read()
    assert fake.calls["nvmlInit"] == 1


def test_real_pynvml_without_a_gpu_raises_nvml_unavailable():
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    with pytest.raises(NvmlUnavailable, match="NVML cannot initialise"):
        NvmlClient().read()


# --------------------------------------------------- per-process utilization
def test_last_seen_timestamp_advances_between_scrapes():
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    asked = []
    entry_point = fake._nvmlGetFunctionPointer

    def recorded(name):
        call = entry_point(name)
        if name != "nvmlDeviceGetProcessUtilization":
            return call
        return lambda h, samples, count, ts: asked.append((h.index, ts.value)) or call(h, samples, count, ts)
    fake._nvmlGetFunctionPointer = recorded
    source = NvmlClient(fake)
    first = source.read().gpus[0].process_utilization
    t1 = fake.clock_us
    assert [u.timestamp_us for u in first] == [t1]
    # No new sample since: NVML answers NOT_FOUND, which is no error.
    second = source.read().gpus[0]
    assert second.up and second.process_utilization == []
    fake.advance(5)
    third = source.read().gpus[0].process_utilization
    # A newer sample at the same ratio serves the same series: the list served before, its
    # sample time and all; the next ask starts after the newer sample all the same.
    assert third is first
    fake.advance(5)
    source.read()
    # Each GPU keeps its own last-seen (the first read asks twice: the count, then the samples).
    assert [ts for i, ts in asked if i == 0] == [0, 0, t1, t1, t1 + 5_000_000]
    assert [ts for i, ts in asked if i == 1] == [0, 0, t1, t1, t1 + 5_000_000]


def test_newest_sample_per_pid_wins():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=1)
    source = NvmlClient(fake)
    source.read()
    fake.advance(1)
    fake.gpus[0].sm_util_by_pid[4000] = (40, 1)
    fake.advance(1)
    util = source.read().gpus[0].process_utilization
    assert [(u.pid, u.sm_ratio, u.timestamp_us) for u in util] == [(4000, pytest.approx(0.40), fake.clock_us)]


# ---------------------------------------------------------------------- GPM
def test_gpm_absent_first_then_computed_over_the_interval():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=1)
    gpu = fake.gpus[0]
    gpu.gpm_percent = {fp.NVML_GPM_METRIC_SM_UTIL: 20.0, fp.NVML_GPM_METRIC_SM_OCCUPANCY: 10.0,
                       fp.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 0.0, fp.NVML_GPM_METRIC_DRAM_BW_UTIL: 50.0}
    source = NvmlClient(fake)
    assert source.read().gpus[0].activity == {}
    fake.advance(10)
    gpu.gpm_percent[fp.NVML_GPM_METRIC_SM_UTIL] = 60.0
    gpu.gpm_percent[fp.NVML_GPM_METRIC_ANY_TENSOR_UTIL] = 30.0
    fake.advance(30)
    activity = source.read().gpus[0].activity
    # 10 s at 20 % then 30 s at 60 %: (200 + 1800) / 40 = 50 %.
    assert activity == {"sm_active": pytest.approx(0.50), "sm_occupancy": pytest.approx(0.10),
                        "tensor_active": pytest.approx(30 * 30 / 40 / 100), "dram_active": pytest.approx(0.50)}
    fake.advance(5)
    # The next interval starts at the previous scrape: only the 60 % part.
    assert source.read().gpus[0].activity["sm_active"] == pytest.approx(0.60)


def test_gpm_unsupported_gpu_has_no_activity_and_no_samples():
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    fake.gpus[1].gpm_supported = False
    source, _, second = read_twice(fake)
    assert second.gpus[0].activity["sm_active"] == pytest.approx(0.60)
    assert second.gpus[1].activity == {} and second.gpus[1].up
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 2  # asked once per GPU, not per scrape
    assert fake.calls["nvmlGpmSampleAlloc"] == 2


@pytest.mark.parametrize("code", [fp.NVML_ERROR_NOT_SUPPORTED, fp.NVML_ERROR_FUNCTION_NOT_FOUND])
def test_gpm_query_refused_means_unsupported(code):
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=1)
    fake.gpus[0].errors["nvmlGpmQueryDeviceSupport"] = code
    _, _, second = read_twice(fake)
    assert second.gpus[0].up and second.gpus[0].activity == {}
    assert fake.live_gpm_samples == []


def test_gpm_samples_are_freed():
    fake = FakeNvml.synthetic(gpus=3, clients_per_gpu=1)
    source = NvmlClient(fake)
    source.read()
    assert len(fake.live_gpm_samples) == 3  # one kept per GPU for the next interval
    for _ in range(5):
        fake.advance(15)
        source.read()
        # and the one before it, which the next sample is taken into: no alloc per round
        assert len(fake.live_gpm_samples) == 6 and fake.calls["nvmlGpmSampleAlloc"] == 6
    assert fake.calls["nvmlGpmSampleFree"] == 0
    fake.gpus[2].errors["nvmlGpmSampleGet"] = fp.NVML_ERROR_UNKNOWN
    assert source.read().gpus[2].activity == {}
    assert len(fake.live_gpm_samples) == 5  # the failed sample was freed, the previous one kept
    source.close()
    assert fake.live_gpm_samples == [] and fake.calls["nvmlShutdown"] == 1
    assert source.read().gpus[0].activity == {}  # re-initialised: a fresh first sample


def test_gpm_metrics_error_drops_activity_but_keeps_the_gpu():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=1)
    fake.errors["nvmlGpmMetricsGet"] = fp.NVML_ERROR_UNKNOWN
    _, _, second = read_twice(fake)
    assert second.gpus[0].up and second.gpus[0].activity == {}
    assert len(fake.live_gpm_samples) == 2  # the new sample, and the one before for the next


def test_driver_before_r510_falls_back_to_v2_process_calls():
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=2)
    fake.driver_before_r510 = True
    gpus = NvmlClient(fake).read().gpus
    assert all(g.up and len(g.mps_clients) == 2 and len(g.compute_processes) == 3 for g in gpus)
    assert fake.calls["nvmlDeviceGetMPSComputeRunningProcesses_v2"] == 4  # two GPUs: the count, then the list
    assert issubclass(pynvml.NVMLLibraryMismatchError, Exception)
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)  # why the source catches it apart


def test_a_gpu_that_stays_down_is_warned_about_once(caplog):
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    fake.gpus[1].errors["*"] = fp.NVML_ERROR_GPU_IS_LOST
    source = NvmlClient(fake)
    with caplog.at_level("WARNING", logger="mps_exporter.sources.nvml"):
        for _ in range(3):
            source.read()
        del fake.gpus[1].errors["*"]
        assert source.read().gpus[1].up
        fake.gpus[1].errors["*"] = fp.NVML_ERROR_GPU_IS_LOST
        source.read()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["NVML error on GPU 1: GPU is lost"] * 2  # down, up again, down again


def test_gpus_are_read_side_by_side():
    """Each GPU's memory call waits until every GPU's has begun: read one after
    another, the first would wait for ever (the barrier breaks after 10 s)."""
    import threading

    nvml = FakeNvml.synthetic(gpus=3, clients_per_gpu=1)
    barrier = threading.Barrier(3, timeout=10)

    def latency(fn: str, gpu: int) -> float:
        if fn == "nvmlDeviceGetMemoryInfo":
            barrier.wait()
        return 0.0

    nvml.latency_of = latency
    reading = NvmlClient(nvml).read()
    assert [g.index for g in reading.gpus] == [0, 1, 2] and all(g.up for g in reading.gpus)


def test_gpm_calls_of_several_gpus_never_overlap():
    """Driver 580 dies of SIGSEGV when two threads are inside GPM calls (issue 38). The
    fake holds each GPM sample open until a second GPM call enters or 0.3 s pass, so
    without the exporter's lock four GPUs overlap in every run."""
    nvml = FakeNvml.synthetic(gpus=4, clients_per_gpu=1)
    nvml.gpm_hold_s = 0.3
    source = NvmlClient(nvml)
    source.gpm.wait_seconds = 30.0  # each GPU's activity of this round, however slow the fake
    source.gpus.wait_seconds = 30.0
    source.read()
    nvml.advance(1.0)
    reading = source.read()
    assert nvml.gpm_overlaps == []
    assert [sorted(g.activity) for g in reading.gpus] == [sorted(k for k, _ in GPM_METRICS)] * 4
    assert nvml.calls["nvmlGpmMetricsGet"] == 4


class InlineGpm:
    """Each GPU's GPM work in a thread of its own, side by side, as before issue 38."""

    def activities(self, works):
        import threading

        out = {}

        def run(index, work):
            try:
                out[index] = work()
            except BaseException as e:  # handed back as GpmSampler does
                out[index] = e

        threads = [threading.Thread(target=run, args=item) for item in works.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def forget(self):
        pass


def test_the_fake_catches_gpm_calls_that_overlap(monkeypatch):
    """The test above fails if the serialization is removed: with GPM in each GPU's own
    thread and no lock, the fake sees two GPM calls at once and the read raises as the
    process would die."""
    monkeypatch.setattr(nvml_source, "GPM_LOCK", contextlib.nullcontext())
    nvml = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    nvml.gpm_hold_s = 5.0
    source = NvmlClient(nvml)
    source.gpm = InlineGpm()
    with pytest.raises(fp.GpmCallsOverlap):
        source.read()
    assert nvml.gpm_overlaps and all(a.startswith("nvmlGpm") and b.startswith("nvmlGpm") for a, b in nvml.gpm_overlaps)


def test_a_gpu_in_a_gpm_call_holds_up_no_other_gpu_s_readings():
    """GPM comes last in a GPU's read: GPU 0's GPM sample, held until GPU 1 has read its
    process utilization (its last call before GPM), does not wait for ever."""
    import threading

    nvml = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    gpu1_read = threading.Event()

    def latency(fn: str, gpu: int) -> float:
        if fn == "nvmlDeviceGetProcessUtilization" and gpu == 1:
            gpu1_read.set()
        if fn == "nvmlGpmSampleGet" and gpu == 0:
            assert gpu1_read.wait(timeout=10), "GPU 1's readings waited for GPU 0's GPM call"
        return 0.0

    nvml.latency_of = latency
    nvml.entry_points = False  # the public utilization call, which passes through _enter
    reading = NvmlClient(nvml).read()
    assert all(g.up for g in reading.gpus) and nvml.gpm_overlaps == []


def test_a_gpm_call_that_hangs_holds_up_no_reading_and_its_result_comes_next_round():
    """GPU 0's nvmlGpmSampleGet blocks until the test releases it (a storm's 0.49 s, made
    endless): the read still returns, every GPU up, with the last activity each had; once
    released, the next read serves the activity the blocked work computed."""
    import threading

    nvml = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    source = NvmlClient(nvml)
    source.gpm.wait_seconds = 30.0
    source.read()  # first samples
    nvml.advance(1.0)
    before = source.read()
    assert all(g.activity for g in before.gpus)
    inside, release = threading.Event(), threading.Event()

    def latency(fn: str, gpu: int) -> float:
        if fn == "nvmlGpmSampleGet" and gpu == 0:
            inside.set()
            release.wait(30)
        return 0.0

    nvml.latency_of = latency
    source.gpm.wait_seconds = 0.0  # not a timing: "do not wait" (the event keeps the work in line)
    for g in nvml.gpus:
        g.gpm_percent = {k: v / 2 for k, v in g.gpm_percent.items()}
    nvml.advance(1.0)
    during = source.read()
    assert inside.wait(30) and not release.is_set()
    assert all(g.up for g in during.gpus)
    assert during.gpus[0].activity == before.gpus[0].activity  # its last one, while its work hangs
    release.set()
    source.gpm.drain()
    nvml.latency_of = None
    after = source.read()  # takes the released round's results
    assert after.gpus[0].activity["sm_active"] < before.gpus[0].activity["sm_active"]
    assert nvml.gpm_overlaps == []


def test_a_gpu_whose_read_hangs_stands_in_with_its_last_reading():
    """GPU 1's memory call blocks until the test releases it (a storm's slow calls, made
    endless): the read of every GPU still returns, GPU 1 as last read; no second read of
    GPU 1 starts beside the one in flight; once released, the next read serves what the
    blocked read found."""
    import threading

    nvml = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    source = NvmlClient(nvml)
    before = source.read()
    inside, release = threading.Event(), threading.Event()

    def latency(fn: str, gpu: int) -> float:
        if fn == "nvmlDeviceGetMemoryInfo" and gpu == 1:
            inside.set()
            release.wait(30)
        return 0.0

    nvml.latency_of = latency
    source.gpus.wait_seconds = 0.0  # "do not wait": the event keeps GPU 1's read in flight
    nvml.gpus[0].temperature = nvml.gpus[1].temperature = 71
    during = source.read()
    assert inside.wait(30) and not release.is_set()
    assert during.gpus[1] is before.gpus[1]  # the stand-in
    again = source.read()  # GPU 1's read is still in flight: not asked a second time
    assert again.gpus[1] is before.gpus[1] and nvml.calls["nvmlDeviceGetMemoryInfo"] <= 2 + 2 + 1
    release.set()
    source.gpus.drain()
    nvml.latency_of = None
    source.gpus.wait_seconds = 30.0
    after = source.read()
    assert [g.temperature_celsius for g in after.gpus] == [71.0, 71.0]


def test_close_leaves_a_hung_read_behind_in_a_daemon_thread(monkeypatch):
    """An NVML call that never returns must not keep the exporter from exiting: close()
    does not wait for it past CLOSE_WAIT_SECONDS (0 here), and its thread is a daemon
    thread, which the interpreter does not join at exit."""
    import threading

    monkeypatch.setattr(nvml_source, "CLOSE_WAIT_SECONDS", 0.0)
    nvml = FakeNvml.synthetic(gpus=2, clients_per_gpu=1)
    source = NvmlClient(nvml)
    source.read()
    inside, release = threading.Event(), threading.Event()
    hung = []

    def latency(fn: str, gpu: int) -> float:
        if fn == "nvmlDeviceGetMemoryInfo" and gpu == 1:
            hung.append(threading.current_thread())
            inside.set()
            release.wait(30)
        return 0.0

    nvml.latency_of = latency
    source.gpus.wait_seconds = 0.0
    source.read()
    assert inside.wait(30)
    source.close()  # returns although GPU 1's read is still inside NVML
    assert not release.is_set() and hung and all(t.daemon and t.is_alive() for t in hung)
    release.set()
    for t in hung:
        t.join(30)
    assert not any(t.is_alive() for t in hung)  # it ends once its call returns


def test_a_client_nobody_closed_takes_its_threads_with_it():
    """The GPU and GPM threads end when their NvmlClient is collected, closed or not (tests
    and benchmarks make thousands); several GPUs asking for GPM at once start one thread."""
    import gc
    import threading

    started: List[threading.Thread] = []  # this test's clients' own: other tests' collectors may run beside
    for _ in range(20):
        source = NvmlClient(FakeNvml.synthetic(gpus=4, clients_per_gpu=1))
        source.read()
        source.read()
        assert [t.name for t in source.gpm.threads] == ["mps-read-gpm"]
        assert sorted(t.name for t in source.gpus.threads) == [f"mps-read-nvml-{i}" for i in range(4)]
        started += source.gpm.threads + source.gpus.threads
        del source
        gc.collect()
    for t in started:
        t.join(30)
    assert [t.name for t in started if t.is_alive()] == []


# ------------------------------------------- list calls straight into NVML
LISTS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMPSComputeRunningProcesses_v3",
         "nvmlDeviceGetProcessUtilization")


def test_installed_pynvml_has_what_the_direct_list_calls_use():
    assert DirectLists(pynvml).usable
    for name in ("c_nvmlProcessInfo_v3_t", "c_nvmlProcessInfo_v2_t", "c_nvmlProcessUtilizationSample_t"):
        assert [f[0] for f in getattr(fp, name)._fields_] == [f[0] for f in getattr(pynvml, name)._fields_], name
        assert ctypes.sizeof(getattr(fp, name)) == ctypes.sizeof(getattr(pynvml, name)), name


def test_each_list_is_one_call_once_its_buffer_is_sized():
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=3)
    source = NvmlClient(fake)
    source.read()
    assert [fake.entry_point_calls[f] for f in LISTS] == [4, 4, 4]  # per GPU: the count, then the list
    for _ in range(3):
        fake.advance(1)
        source.read()
    assert [fake.entry_point_calls[f] for f in LISTS] == [10, 10, 10]  # then one call a GPU


@pytest.mark.parametrize("before_r510", [False, True])
def test_each_entry_point_is_looked_up_once_whatever_the_rounds_and_gpus(before_r510):
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=3)
    fake.driver_before_r510 = before_r510  # its _v3 lookups fail: _v2, asked once too
    looked_up = collections.Counter()

    def lookup(name: str):
        looked_up[name] += 1
        return fake._function_pointer(name)
    fake._nvmlGetFunctionPointer = lookup
    source = NvmlClient(fake, wait_for_every_answer=True)
    for _ in range(3):
        fake.advance(1)
        assert all(len(g.mps_clients) == 3 for g in source.read().gpus)
    lists = [f[:-3] for f in LISTS[:2]]
    versions = [f + "_v3" for f in lists] + ([f + "_v2" for f in lists] if before_r510 else [])
    assert looked_up == dict.fromkeys([*versions, "nvmlDeviceGetProcessUtilization"], 1)


def test_a_list_that_outgrows_its_buffer_is_read_whole():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=2)
    source = NvmlClient(fake)
    assert len(source.read().gpus[0].mps_clients) == 2
    gpu = fake.gpus[0]
    newcomers = [fp.FakeProcess(20000 + k, (k + 1) << 20) for k in range(40)]  # past 2 * 2 + 5
    gpu.mps_processes += newcomers
    gpu.compute_processes += copy.deepcopy(newcomers)
    calls = fake.entry_point_calls["nvmlDeviceGetMPSComputeRunningProcesses_v3"]
    clients = source.read().gpus[0].mps_clients
    assert [(p.pid, p.used_bytes) for p in clients] == [(p.pid, p.usedGpuMemory) for p in gpu.mps_processes]
    assert fake.entry_point_calls["nvmlDeviceGetMPSComputeRunningProcesses_v3"] == calls + 2  # short, then whole
    gpu.mps_processes[:] = gpu.mps_processes[:1]  # fewer again: the larger buffer serves
    assert [p.pid for p in source.read().gpus[0].mps_clients] == [gpu.mps_processes[0].pid]
    assert fake.entry_point_calls["nvmlDeviceGetMPSComputeRunningProcesses_v3"] == calls + 3


@pytest.mark.parametrize("scenario", ["busy", "many", "idle"])
def test_direct_list_calls_read_what_pynvml_s_functions_read(scenario):
    readings = []
    for entry_points in (True, False):
        fake = FakeNvml.from_capture(scenario)
        fake.entry_points = entry_points
        source = NvmlClient(fake)
        first = source.read()
        fake.advance(2)
        readings.append((first, source.read()))
    assert readings[0] == readings[1]
    busy = [g for pair in readings for reading in pair for g in reading.gpus if g.mps_clients]
    assert busy or scenario == "idle"  # the comparison saw clients where the capture has them


def test_an_error_from_a_direct_list_call_is_nvml_s_error():
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=2)
    fake.gpus[1].errors["nvmlDeviceGetMPSComputeRunningProcesses"] = fp.NVML_ERROR_GPU_IS_LOST
    gpus = NvmlClient(fake).read().gpus
    assert [g.up for g in gpus] == [True, False]


def test_a_rounds_gpm_work_is_one_job_after_every_gpus_other_readings():
    """One hand-off to the GPM thread a round, not one per GPU, and a GPU's GPM calls never
    beside another NVML call of the round (on the H200 that cost GPM several times the CPU)."""
    nvml = FakeNvml.synthetic(gpus=4, clients_per_gpu=2)
    source = NvmlClient(nvml)
    source.gpus.wait_seconds = source.gpm.wait_seconds = None  # every answer waited for: no stand-ins
    order: List[str] = []
    nvml.latency_of = lambda fn, gpu: order.append(fn) or 0.0
    source.read()
    submitted: List[int] = []
    worker = source.gpm._workers[0]
    real_submit = worker.submit
    worker.submit = lambda fn: submitted.append(1) or real_submit(fn)  # type: ignore[method-assign]
    for _ in range(3):
        order.clear()
        nvml.advance(1.0)
        reading = source.read()
        assert all(g.activity for g in reading.gpus)
        gpm = [i for i, fn in enumerate(order) if fn.startswith("nvmlGpm")]
        others = [i for i, fn in enumerate(order) if not fn.startswith("nvmlGpm")]
        assert gpm and others and max(others) < min(gpm), order
    assert len(submitted) == 3
