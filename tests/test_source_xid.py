"""The Xid source: NVML's Xid events counted per GPU and code by a thread of its own.

The fake NVML's event sets are queues: `inject_xid` puts an event in, the watcher's
nvmlEventSetWait_v2 takes it out. Tests wait for the watcher to have taken events in
(`wait_for_events`, a condition), never for wall-clock time; the timeouts only bound
a test that would otherwise hang.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client.exposition import generate_latest

from mps_exporter.codec import decode, encode
from mps_exporter.config import Config
from mps_exporter.contract import OTHER
from mps_exporter.families import FamilyBuilder
from mps_exporter.model import Snapshot
from mps_exporter.sources import xid as xid_source
from mps_exporter.sources.base import Backends
from mps_exporter.sources.xid import MAX_XID_CODES, XidReading, XidUnavailable, XidWatcher, render_xid
from tests.fakes import fake_pynvml as fp
from tests.fakes.fake_pynvml import FakeNvml

BOUND = 10.0  # seconds a test may wait for the thread (its close too) before it fails


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def started():
    """A watcher over two synthetic GPUs, its thread running (closed after the test)."""
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=0)
    clock = Clock()
    watcher = XidWatcher(fake, clock=clock, wait_ms=50)
    watcher.start()
    _wait_registered(watcher)
    yield fake, watcher, clock
    watcher.close(timeout=BOUND)


def _wait_registered(watcher: XidWatcher, setups: int = 1) -> None:
    """The thread has registered its GPUs: an event injected now is received."""
    assert watcher.wait_until(lambda: watcher.setups >= setups, BOUND), "the watcher did not register its GPUs"


def _wait_waiting(fake: FakeNvml, waits: int) -> None:
    """The thread has begun its `waits`-th wait: with no event queued it stays in it."""
    deadline = time.monotonic() + BOUND
    while fake.calls["nvmlEventSetWait_v2"] < waits:
        assert time.monotonic() < deadline, "the watcher did not wait"
        time.sleep(0.001)


def _by_gpu(reading: XidReading):
    return {g.index: {code: (c.count, c.last_seen) for code, c in g.xids.items()} for g in reading.gpus}


def _exposition(reading: XidReading) -> str:
    out = FamilyBuilder()
    render_xid(out, reading)

    class Registry:
        def collect(self):
            return out.families()

    return generate_latest(Registry()).decode()


# ------------------------------------------------------------ counting
def test_counts_per_gpu_and_code_with_the_last_time_seen(started):
    fake, watcher, clock = started
    assert fake.inject_xid(0, 79) == 1
    assert watcher.wait_for_events(1, BOUND)
    clock.now += 30
    fake.inject_xid(0, 79)
    fake.inject_xid(1, 13)
    assert watcher.wait_for_events(3, BOUND)
    reading = watcher.read()
    assert [(g.index, g.uuid, g.registered) for g in reading.gpus] == [
        (0, fake.gpus[0].uuid, True), (1, fake.gpus[1].uuid, True)]
    assert _by_gpu(reading) == {0: {"79": (2, 1_800_000_030.0)}, 1: {"13": (1, 1_800_000_030.0)}}
    text = _exposition(reading)
    assert f'mps_gpu_xid_errors_total{{gpu="0",uuid="{fake.gpus[0].uuid}",xid="79"}} 2.0' in text
    assert f'mps_gpu_xid_last_seen_timestamp_seconds{{gpu="1",uuid="{fake.gpus[1].uuid}",xid="13"}} 1.80000003e+09' in text
    assert f'mps_gpu_xid_events_registered{{gpu="1",uuid="{fake.gpus[1].uuid}"}} 1.0' in text


def test_a_read_is_a_copy_and_asks_nvml_nothing(started):
    fake, watcher, _clock = started
    fake.inject_xid(0, 48)
    assert watcher.wait_for_events(1, BOUND)
    calls = sum(fake.calls.values()) - fake.calls["nvmlEventSetWait_v2"]
    first = watcher.read()
    first.gpus[0].xids["48"].count = 1000
    assert watcher.read().gpus[0].xids["48"].count == 1
    assert sum(fake.calls.values()) - fake.calls["nvmlEventSetWait_v2"] == calls


def test_other_event_types_are_not_xids(started):
    fake, watcher, _clock = started
    # Registered for Xid events only: a double-bit ECC event reaches no set.
    assert fake.inject_xid(0, 1, eventType=fp.nvmlEventTypeDoubleBitEccError) == 0
    fake.inject_xid(0, 31)
    assert watcher.wait_for_events(1, BOUND)
    assert _by_gpu(watcher.read())[0] == {"31": (1, 1_800_000_000.0)}


# ------------------------------------------------------------ registration
def test_a_gpu_without_xid_events_says_so_in_one_series():
    fake = FakeNvml.synthetic(gpus=2, clients_per_gpu=0)
    fake.gpus[1].errors["nvmlDeviceRegisterEvents"] = fp.NVML_ERROR_NOT_SUPPORTED
    watcher = XidWatcher(fake, clock=Clock(), wait_ms=50)
    watcher.catch_up()
    try:
        reading = watcher.read()
        assert [(g.index, g.registered) for g in reading.gpus] == [(0, True), (1, False)]
        assert "Not Supported" in reading.gpus[1].error
        text = _exposition(reading)
        assert f'mps_gpu_xid_events_registered{{gpu="1",uuid="{fake.gpus[1].uuid}"}} 0.0' in text
        assert f'mps_gpu_xid_events_registered{{gpu="0",uuid="{fake.gpus[0].uuid}"}} 1.0' in text
        assert fake.inject_xid(1, 79) == 0  # nobody listens on GPU 1
    finally:
        watcher.close(timeout=BOUND)


def test_no_gpu_registered_stops_the_thread_and_says_so():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=0)
    fake.gpus[0].errors["nvmlDeviceRegisterEvents"] = fp.NVML_ERROR_NO_PERMISSION
    watcher = XidWatcher(fake, clock=Clock(), wait_ms=50)
    watcher.start()
    watcher._thread.join(BOUND)
    assert not watcher.running  # nothing to wait for
    assert [(g.registered, g.error) for g in watcher.read().gpus] == [
        (False, "cannot register its Xid events: Insufficient Permissions")]
    assert fake.event_sets[0].freed
    watcher.close(timeout=BOUND)
    assert fake._init_count == 0


def test_nvml_that_cannot_initialise_fails_the_read():
    watcher = XidWatcher(FakeNvml.no_driver(), clock=Clock())
    watcher.catch_up()
    with pytest.raises(XidUnavailable, match="NVML cannot initialise"):
        watcher.read()
    watcher.close(timeout=BOUND)


def test_not_started_reads_as_no_gpu():
    watcher = XidWatcher(FakeNvml.synthetic(gpus=1, clients_per_gpu=0))
    assert watcher.read() == XidReading([])
    assert _exposition(watcher.read()) == ""


# ------------------------------------------------------------ lifecycle
def test_close_stops_the_thread_frees_the_set_and_shuts_nvml_down(started):
    fake, watcher, _clock = started
    thread = watcher._thread
    assert thread.is_alive() and fake._init_count == 1
    watcher.close(timeout=BOUND)
    assert not thread.is_alive()
    assert fake.event_sets[0].freed and fake._init_count == 0
    watcher.close(timeout=BOUND)  # twice is fine
    assert fake.calls["nvmlShutdown"] == 1


def test_close_does_not_wait_out_a_long_wait_the_thread_ends_it_itself():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=0)
    watcher = XidWatcher(fake, clock=Clock(), wait_ms=600_000)  # the test ends it with an event
    watcher.start()
    _wait_registered(watcher)
    _wait_waiting(fake, 1)
    thread = watcher._thread
    watcher.close(timeout=0.01)  # returns: the thread stays in its wait
    assert thread.is_alive() and not watcher.running
    assert not fake.event_sets[0].freed and fake._init_count == 1
    watcher.close()  # again: still no wait
    fake.inject_xid(0, 79)  # ends the wait: the thread sees close, frees the set
    thread.join(BOUND)
    assert not thread.is_alive()
    assert fake.event_sets[0].freed and fake._init_count == 0
    watcher.start()  # a new thread, a new set
    _wait_registered(watcher, setups=2)
    assert watcher.running and not fake.event_sets[1].freed
    watcher.close(timeout=0.01)
    fake.inject_xid(0, 79)
    watcher._leaving.join(BOUND)
    assert fake.event_sets[1].freed and fake._init_count == 0


def test_catch_up_takes_in_what_waits_without_blocking():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=0)
    watcher = XidWatcher(fake, clock=Clock(), wait_ms=60_000)  # a blocking wait would hang the test
    watcher.catch_up()
    fake.inject_xid(0, 94)
    fake.inject_xid(0, 94)
    watcher.catch_up()
    assert _by_gpu(watcher.read()) == {0: {"94": (2, 1_800_000_000.0)}}
    assert fake.calls["nvmlEventSetCreate"] == 1  # registered once
    watcher.close(timeout=BOUND)
    assert fake.event_sets[0].freed and fake._init_count == 0


def test_a_failed_wait_registers_again():
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=0)
    watcher = XidWatcher(fake, clock=Clock(), wait_ms=50, retry_seconds=0.01)
    fake.errors["nvmlEventSetWait_v2"] = fp.NVML_ERROR_GPU_IS_LOST
    watcher.start()
    try:
        _wait_registered(watcher, setups=2)  # torn down and registered again
        assert fake.event_sets[0].freed
        del fake.errors["nvmlEventSetWait_v2"]
        _wait_registered(watcher, setups=watcher.setups + 1)  # a set whose waits succeed
        assert fake.inject_xid(0, 79) == 1
        assert watcher.wait_for_events(1, BOUND)
        assert watcher.read().gpus[0].xids["79"].count == 1
    finally:
        watcher.close(timeout=BOUND)
    assert all(s.freed for s in fake.event_sets) and fake._init_count == 0


# ------------------------------------------------------------ bounds
def test_a_flood_of_codes_stays_bounded(started):
    fake, watcher, _clock = started
    n = 5000
    for i in range(n):
        fake.inject_xid(0, 1000 + i)  # every one a new code
    fake.inject_xid(0, 1000)  # a code counted before the cap keeps its own series
    assert watcher.wait_for_events(n + 1, BOUND)
    xids = watcher.read().gpus[0].xids
    assert len(xids) == MAX_XID_CODES + 1
    assert xids[OTHER].count == n - MAX_XID_CODES
    assert xids["1000"].count == 2
    assert sum(c.count for c in xids.values()) == n + 1


# ------------------------------------------------------------ the source
def test_the_source_is_registered_and_its_reader_runs_the_watcher():
    from mps_exporter.sources.registry import SOURCES

    assert SOURCES["xid"] is xid_source.SOURCE
    fake = FakeNvml.synthetic(gpus=1, clients_per_gpu=0)
    clock = Clock()
    reader = xid_source.SOURCE.build(Config(), Backends(nvml_module=fake, clock=clock))
    reader.start()
    try:
        _wait_registered(reader.source)
        fake.inject_xid(0, 119)
        assert reader.source.wait_for_events(1, BOUND)
        reading = reader.read(None)
        assert reader.quick(None) == reading
        snap = Snapshot(now=clock.now)
        xid_source.SOURCE.store(snap, reading)
        out = FamilyBuilder()
        xid_source.SOURCE.render(out, snap)
        names = {s.name for f in out.families() for s in f.samples}
        assert names == {"mps_gpu_xid_errors_total", "mps_gpu_xid_last_seen_timestamp_seconds",
                         "mps_gpu_xid_events_registered"}
        _wait_waiting(fake, 2)  # in the wait after the event's
    finally:
        reader.close()  # the thread is in a wait of WAIT_MS: close leaves it to end it
    assert reader.source.wait_ms == xid_source.WAIT_MS
    fake.inject_xid(0, 119)  # ends that wait
    reader.source._leaving.join(BOUND)
    assert fake._init_count == 0


def test_reading_round_trips_through_the_codec_and_shifts_its_times():
    reading = XidReading([xid_source.XidGpu(0, "GPU-a", True, "", {"79": xid_source.XidCount(2, 100.5),
                                                                    OTHER: xid_source.XidCount(7, 90.0)}),
                          xid_source.XidGpu(1, "GPU-b", False, "cannot register its Xid events: Not Supported")])
    again = decode(XidReading, encode(reading))
    assert again == reading
    loaded = xid_source.SOURCE.load(xid_source.SOURCE.record(reading))
    assert xid_source.SOURCE.replay(loaded) == reading
    shifted = xid_source.SOURCE.shift(reading, 1000.0)
    assert shifted.gpus[0].xids["79"].last_seen == 1100.5 and reading.gpus[0].xids["79"].last_seen == 100.5
    assert shifted.gpus[0].xids["79"].count == 2 and shifted.gpus[1] == reading.gpus[1]


# ------------------------------------------------------------ status: Xids beside MPS's fatal errors
def test_status_lists_a_gpus_xid_beside_the_fatal_error_mps_logged_then(tmp_path):
    import dataclasses

    from mps_exporter.status import text, view
    from mps_exporter.wiring import build_collector, build_readers
    from tests.support import scenarios

    scen = scenarios.busy(tmp_path)
    if scen.log_directory is None:
        pytest.skip("the capture's logs are not here")
    # The busy capture's server.log: a fatal GPU error of server 2736 at 04:23:08.506 UTC,
    # client 2755 left with a sticky error. NVML delivers the Xid 1.5 s later.
    fatal_at = 1795234988.506
    clock = Clock(fatal_at + 1.5)
    readers = build_readers(scen.cfg, dataclasses.replace(scen.backends(), clock=clock))
    readers["logs"].catch_up()
    readers["xid"].catch_up()
    try:
        scen.nvml.inject_xid(0, 13)
        readers["xid"].catch_up()  # taken in (and stamped) now
        clock.now = fatal_at + 600  # an Xid far from any fatal error: listed alone
        scen.nvml.inject_xid(0, 79)
        readers["xid"].catch_up()
        st = view.build(build_collector(scen.cfg, readers).snapshot(), "test")
    finally:
        readers["xid"].close()
    gpu = st.gpus[0]
    assert gpu.xid_events_registered is True
    assert [(x.xid, x.count, x.last_seen) for x in gpu.xids] == [("79", 1, fatal_at + 600), ("13", 1, fatal_at + 1.5)]
    report = text.plain(text.report(st))
    lines = report.splitlines()
    at = lines.index("XID ERRORS of GPU 0 (since the exporter started, from NVML's events)")
    assert lines[at + 1].startswith("  Xid 79     1 time(s), last 2026-11-21 04:33:08.506 (")
    assert lines[at + 2].startswith("  Xid 13     1 time(s), last 2026-11-21 04:23:10.006 (")
    assert lines[at + 3] == ("    2026-11-21 04:23:08.506  fatal GPU error in the MPS logs (-1.5 s): daemon default, "
                             "server 2736, clients with a sticky error: 2755")
    assert not lines[at + 4].startswith("    ")  # nothing near the Xid 79


def test_status_says_when_a_gpus_xid_events_are_not_registered(tmp_path):
    from mps_exporter.status import text, view
    from tests.support import scenarios

    scen = scenarios.busy(tmp_path, logs=False)
    scen.nvml.gpus[0].errors["nvmlDeviceRegisterEvents"] = fp.NVML_ERROR_NOT_SUPPORTED
    st = view.build(scen.collector().snapshot(), "test")
    assert st.gpus[0].xid_events_registered is False and st.gpus[0].xids == []
    assert "GPU 0: ! NVML refused to register its Xid events: its Xid errors are not counted" in text.plain(
        text.report(st))
