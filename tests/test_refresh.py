"""Background refresh (--collector.refresh-interval): scrapes serve the latest reading of
the background sources (NVML, DCGM) while it is at most two intervals old, read like any
other source when it is older, and the reads pause without scrapes; control commands are
sent by scrapes only, never by the refresher.

Timing-free where it can be: intervals are long and the collector's clock is the test's,
so a reading's age is what the test sets; the pause tests wait on the refresher's own
round counter, with generous timeouts, never on a measured duration."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Tuple

import pytest

from mps_exporter.cli import parse_args
from mps_exporter import collector as collector_module
from mps_exporter.collector import MpsCollector
from mps_exporter.config import DEFAULT_CONTROL_WAIT, Config
from mps_exporter.sources.base import Reader
from mps_exporter.sources.registry import SOURCES
from mps_exporter.wiring import build_collector
from tests.support import scenarios
from tests.support.virtual_time import REAL_LIMIT, VirtualTime
from tests.test_deadline import Clock, Gate, gated, lines, text_of, value  # noqa: F401 (gated: a fixture)

MPS_LIST = "nvmlDeviceGetMPSComputeRunningProcesses"
NVML_TIME = 'mps_exporter_collector_last_success_timestamp_seconds{collector="nvml"}'


def until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def control_read_ended(collector: MpsCollector, taken_at: float) -> bool:
    """The control read taken at `taken_at` has ended: its reading is the latest and its
    future is done (a read sets `latest` just before it completes its future: a scrape in
    between joins it instead of starting the next read)."""
    run = collector._runs["control"]
    return until(lambda: run.latest is not None and run.latest.taken_at == taken_at
                 and run._inflight is not None and run._inflight.done())


def gated_collector(tmp_path: Path, source: str, gpus: int = 1, clients_per_gpu: int = 2,
                    **collector_args: Any) -> Tuple[scenarios.Scenario, MpsCollector, Gate, Clock]:
    """A collector over the synthetic scenario whose `source` reads wait behind a gate the
    test holds, on the test's clock."""
    scen = scenarios.synthetic(tmp_path, gpus=gpus, clients_per_gpu=clients_per_gpu)
    readers = scen.readers()
    gate = Gate(readers[source])
    readers[source] = Reader(gate.read)
    clock = Clock()
    return scen, MpsCollector(readers, clock=clock, **collector_args), gate, clock


@pytest.fixture
def refreshed(tmp_path: Path) -> Iterator[Tuple[scenarios.Scenario, MpsCollector, Clock]]:
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=2)
    clock = Clock()
    collector = MpsCollector(scen.readers(), clock=clock, max_seconds=5.0, refresh_interval=30.0)
    collector.start()
    assert until(lambda: collector.refreshes >= 1)
    yield scen, collector, clock
    collector.close()


def test_a_stale_reading_is_served_while_its_successor_is_still_being_read(tmp_path):
    scen, collector, gate, clock = gated_collector(tmp_path, "nvml", max_seconds=5.0, refresh_interval=30.0, pause_after=1e9, gpus=1,
                                                   clients_per_gpu=2)
    collector.start()
    try:
        assert until(lambda: collector.refreshes >= 1)
        gate.close()  # the next round's read is slow (a client storm)
        clock.now += 30.0
        threading.Thread(target=collector.refresh, daemon=True).start()  # that round, now
        assert until(lambda: gate.calls == 2)  # in flight
        time.sleep(0.6)  # the read has run 0.6 s
        clock.now += 30.5  # the last reading is 60.5 s old: over two intervals, by less than that
        started = time.monotonic()
        text = text_of(collector)
        assert time.monotonic() - started < 1.0  # not waited for
        assert value(text, NVML_TIME) == 1000.0 and gate.calls == 2
        assert 'mps_client_memory_used_bytes{' in text
        clock.now += 2.0  # older than two intervals and the read's time: waited for
        threading.Timer(0.3, gate.open).start()
        assert value(text_of(collector), NVML_TIME) == 1030.0 and gate.calls == 2
    finally:
        gate.open()
        collector.close()


def test_nvml_and_dcgm_are_the_background_sources():
    assert sorted(name for name, source in SOURCES.items() if source.background) == ["dcgm", "nvml"]


def test_scrapes_serve_the_background_reading_and_still_ask_the_daemon(refreshed):
    scen, collector, clock = refreshed
    nvml_calls, commands = scen.nvml.calls[MPS_LIST], len(scen.daemon.received)
    clock.now += 59.0  # under two intervals
    texts = [text_of(collector), text_of(collector)]
    assert scen.nvml.calls[MPS_LIST] == nvml_calls  # no NVML call of their own
    assert len(scen.daemon.received) > commands  # the control source is read at scrape time
    for text in texts:
        assert value(text, NVML_TIME) == 1000.0  # the refresher's reading, with its time
        assert value(text, 'mps_exporter_collector_success{collector="nvml"}') == 1
        assert 'mps_client_memory_used_bytes{' in text


def test_a_reading_older_than_two_intervals_is_read_again_by_the_scrape(refreshed):
    scen, collector, clock = refreshed
    nvml_calls = scen.nvml.calls[MPS_LIST]
    clock.now += 61.0
    text = text_of(collector)
    assert scen.nvml.calls[MPS_LIST] == nvml_calls + 2  # both GPUs, read by the scrape
    assert value(text, NVML_TIME) == 1061.0
    clock.now += 1.0
    text_of(collector)  # and that reading is the latest one now
    assert scen.nvml.calls[MPS_LIST] == nvml_calls + 2


def test_without_start_every_source_is_read_at_scrape_time(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1)
    collector = build_collector(scen.cfg, scen.readers())  # refresh interval 1 s, never started
    text_of(collector)
    calls = scen.nvml.calls[MPS_LIST]
    text_of(collector)
    assert scen.nvml.calls[MPS_LIST] == calls + 1


def test_the_refresher_pauses_without_scrapes_and_the_next_scrape_resumes_it(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=2)
    collector = MpsCollector(scen.readers(), max_seconds=5.0, refresh_interval=0.01, pause_after=0.3)
    collector.start()
    try:
        text_of(collector)
        commands = len(scen.daemon.received)
        assert until(lambda: collector.refreshes >= 5)  # reading while scraped
        # Paused: the round count stops moving for longer than many intervals.
        paused = []

        def settled() -> bool:
            paused.append(collector.refreshes)
            time.sleep(0.2)
            return collector.refreshes == paused[-1]

        assert until(settled)
        calls = scen.nvml.calls[MPS_LIST]
        time.sleep(0.3)
        assert scen.nvml.calls[MPS_LIST] == calls
        assert len(scen.daemon.received) == commands  # no scrape, no control command
        rounds = collector.refreshes
        text = text_of(collector)  # its reading is old: read now, and the refresher resumes
        assert value(text, 'mps_exporter_collector_success{collector="nvml"}') == 1
        assert until(lambda: collector.refreshes >= rounds + 3)
    finally:
        collector.close()


def test_close_stops_the_refresher(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1)
    collector = MpsCollector(scen.readers(), refresh_interval=0.01)
    collector.start()
    assert until(lambda: collector.refreshes >= 2)
    collector.close()
    rounds = collector.refreshes
    time.sleep(0.1)
    assert collector.refreshes == rounds


def test_the_flags_reach_the_collector():
    _, cfg = parse_args(["--collector.refresh-interval", "0.5", "--collector.pause-after", "60"])
    collector = build_collector(cfg, {})
    assert (collector.refresh_interval, collector.pause_after) == (0.5, 60.0)
    _, cfg = parse_args(["--collector.refresh-interval", "0"])
    assert cfg.refresh_interval == 0.0
    collector = build_collector(cfg, {})
    collector.start()  # nothing to refresh in the background: no thread
    assert collector.refreshes == 0


def test_scraped_about_as_often_as_the_interval_the_refresher_keeps_the_interval():
    for interval in (None, 0.5, 1.0, 1.02, 1.49):  # 1 s scrapes wander a few ms either side
        assert collector_module.next_refresh(10.0, 10.1, interval, 1.0, 0.25) == 11.0


def test_scraped_less_often_the_refresher_reads_once_per_scrape_just_before_it():
    # Scrapes every 15 s, the last at 100 (the round before it at 99.75): the round for the
    # scrape at 115 starts at 114.75.
    assert collector_module.next_refresh(99.75, 100.0, 15.0, 1.0, 0.25) == 114.75
    # That round started: the next waits for the scrape at 115, then is for the one at 130.
    assert collector_module.next_refresh(114.75, 100.0, 15.0, 1.0, 0.25) == math.inf
    assert collector_module.next_refresh(114.75, 115.01, 15.0, 1.0, 0.25) == 129.76
    # No scrape since the last round started (the expected one did not come, or the round
    # came after it): none until one does.
    assert collector_module.next_refresh(116.0, 100.0, 15.0, 1.0, 0.25) == math.inf
    assert collector_module.next_refresh(116.0, 115.5, 15.0, 1.0, 0.25) == math.inf
    # Scraped by hand a second after that round: never sooner than the interval.
    assert collector_module.next_refresh(116.0, 116.5, 15.0, 1.0, 0.25) == 131.25
    assert collector_module.next_refresh(116.0, 116.5, 1.6, 1.0, 0.25) == 117.85


def test_the_scrape_interval_is_the_lower_median_gap_between_scrapes_that_are_no_pause():
    assert collector_module.scrape_interval([], 300.0) is None
    assert collector_module.scrape_interval([5.0], 300.0) is None
    assert collector_module.scrape_interval([0.0, 15.0, 30.0, 45.01], 300.0) == 15.0
    # A scrape by hand at 31 between Prometheus' every 15 s does not count.
    assert collector_module.scrape_interval([0.0, 15.0, 30.0, 31.0, 45.0, 60.0], 300.0) == 15.0
    # Two Prometheus servers, 5 s apart, each every 15 s: both are served.
    assert collector_module.scrape_interval([0.0, 5.0, 15.0, 20.0, 30.0], 300.0) == 5.0
    assert collector_module.scrape_interval([0.0, 400.0], 300.0) is None  # a pause


def test_the_refresh_interval_series_shows_the_pace_of_the_background_reads(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1)
    time_ = VirtualTime()
    collector = MpsCollector(scen.readers(), clock=Clock(), max_seconds=5.0, refresh_interval=1.0,
                             pause_after=1e9, timing=time_.timing())
    collector.start()
    series = 'mps_exporter_collector_refresh_interval_seconds{collector="nvml"}'
    try:
        assert value(text_of(collector), series) == 1.0  # one scrape: its spacing not known yet
        time_.advance(15.0)
        assert value(text_of(collector), series) == 15.0
        time_.advance(0.5)  # gaps of 15 and 0.5 s: the lower one
        assert value(text_of(collector), series) == 1.0
    finally:
        collector.close()


def test_status_shows_the_age_of_each_reading(gated):  # noqa: F811 (the fixture)
    from mps_exporter.status import text, view

    collector, gate, clock = gated
    collector.snapshot(0.3)  # NVML's reading at 1000
    gate.close()  # and no other: its next read hangs past the deadline
    clock.now += 7.0
    st = view.build(collector.snapshot(0.3), "test")
    ages = {s.name: s.age_seconds for s in st.sources}
    assert ages["nvml"] == 7.0 and ages["control"] == 0.0
    assert "reading ages: control 0.0 s, nvml 7.0 s, proc 0.0 s, xid 0.0 s" in [line for line, _ in text.report(st)]
    gate.open()


CONTROL_TIME = 'mps_exporter_collector_last_success_timestamp_seconds{collector="control"}'
CONTROL_OK = 'mps_exporter_collector_success{collector="control"}'


@pytest.fixture
def control_gated(tmp_path: Path) -> Iterator[Tuple[MpsCollector, Gate, Clock]]:
    """The control source behind a gate the test holds; a scrape may wait 2 s for its
    sources and 0.05 s for the control daemon."""
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=2, clients_per_pod=2)
    readers = scen.readers()
    gate = Gate(readers["control"])
    readers["control"] = Reader(gate.read)
    clock = Clock()
    collector = MpsCollector(readers, clock=clock, max_seconds=2.0, control_wait=0.05)
    yield collector, gate, clock
    gate.open()


def test_a_slow_control_read_is_not_waited_for_and_its_last_reading_is_served(control_gated, monkeypatch):
    monkeypatch.setattr(collector_module, "CONTROL_CALM_SECONDS", 0.3)
    collector, gate, clock = control_gated
    first = text_of(collector)
    assert value(first, CONTROL_TIME) == 1000.0
    gate.close()  # the daemon stalls, as while MPS admits a storm of clients
    clock.now += 1.0
    started = time.monotonic()
    second = text_of(collector)
    assert time.monotonic() - started < 1.0  # not the 2 s a source may take
    assert value(second, CONTROL_OK) == 1
    assert value(second, CONTROL_TIME) == 1000.0  # the earlier reading, with its time
    for name in ("mps_server_info", "mps_client_memory_used_bytes", "mps_client_info"):
        assert lines(second, name) == lines(first, name)  # proc used the same PIDs: same series
    clock.now += 1.0
    text_of(collector)
    assert gate.calls == 2  # the stalled read is joined, not sent again
    gate.open()
    assert control_read_ended(collector, 1001.0)  # ended for the next scrape
    clock.now += 1.0
    fourth = text_of(collector)
    assert value(fourth, CONTROL_TIME) == 1001.0  # the stalled answer; the slow daemon was not waited for
    assert control_read_ended(collector, 1003.0)  # the read this scrape started, once it had its readings
    assert gate.calls == 3
    time.sleep(0.3)  # CONTROL_CALM_SECONDS after the slow answer
    clock.now += 1.0
    assert value(text_of(collector), CONTROL_TIME) == 1004.0  # answering fast again: this scrape's own


def test_a_control_reading_older_than_two_refresh_intervals_is_not_served_in_place(tmp_path):
    scen, collector, gate, clock = gated_collector(tmp_path, "control", max_seconds=5.0, control_wait=0.05, refresh_interval=1.0, gpus=1,
                                                   clients_per_gpu=2)
    try:
        text_of(collector)
        gate.close()
        clock.now += 1.5  # scraped often (a 1 s interval, say): the last reading stands in
        assert value(text_of(collector), CONTROL_TIME) == 1000.0
        gate.open()
        assert control_read_ended(collector, 1001.5)
        gate.close()
        clock.now += 15.0  # Prometheus' default interval: that reading is 15 s old
        threading.Timer(0.3, gate.open).start()  # the daemon answers well within the budget
        assert value(text_of(collector), CONTROL_TIME) == 1016.5  # waited for, not 15 s old
    finally:
        gate.open()


class TimedControl:
    """A collector on the test's VirtualTime whose control read takes `delay` seconds of
    it. A read longer than `wait` holds its answer until `release()`, which the test calls
    once the scrape that gave up on it has answered: what the scrape waited for is decided
    by the collector's clock alone, never by how loaded the machine is."""

    def __init__(self, tmp_path: Path, wait: float, gpus: int = 1, clients_per_gpu: int = 2) -> None:
        self.scen = scenarios.synthetic(tmp_path, gpus=gpus, clients_per_gpu=clients_per_gpu)
        self.scen.cfg.control_wait = wait
        self.time, self.wait, self.delay = VirtualTime(), wait, 0.0
        self._released = threading.Event()
        readers = self.scen.readers()
        real = readers["control"]

        def read(ctx: Any) -> Any:
            delay = self.delay
            self.time.advance(delay)
            if delay > self.wait:
                assert self._released.wait(REAL_LIMIT), "release() never came"
            return real.read(ctx)

        readers["control"] = Reader(read)
        self.clock = Clock()
        self.collector = build_collector(self.scen.cfg, readers, clock=self.clock, timing=self.time.timing())

    def release(self) -> None:
        self._released.set()

    def scrape(self) -> str:
        self.clock.now += 1.0
        self._released.clear()
        return text_of(self.collector)


def test_a_daemon_slower_than_the_wait_last_time_is_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(collector_module, "CONTROL_CALM_SECONDS", 1.0)
    t = TimedControl(tmp_path, wait=0.5)
    assert value(t.scrape(), CONTROL_TIME) == 1001.0
    t.delay = 0.8  # slower than the wait: served the first reading, ends for the next scrape
    assert value(t.scrape(), CONTROL_TIME) == 1001.0
    t.release()
    assert control_read_ended(t.collector, 1002.0)
    t.delay = 0.05  # well within the wait now, but the last answer took 0.8 s: not waited for
    assert value(t.scrape(), CONTROL_TIME) == 1002.0  # the last reading (waited for: its own, 1003)
    assert control_read_ended(t.collector, 1003.0)
    # Fast again, but within CONTROL_CALM_SECONDS of the slow answer: still not waited for.
    assert value(t.scrape(), CONTROL_TIME) == 1003.0
    assert control_read_ended(t.collector, 1004.0)
    t.time.advance(1.0)  # calm since
    assert value(t.scrape(), CONTROL_TIME) == 1005.0  # waited for, this scrape's own


def test_after_a_long_answer_its_reading_stands_in_however_old(tmp_path):
    # A storm: one answer took 3 s, so its reading is older than two refresh intervals
    # when it comes; the next read, just started, is as slow. Waiting for it would be in
    # vain: before, the scrape waited out its whole budget (0.56 s of a 1 s timeout, 4 x H200).
    t = TimedControl(tmp_path, wait=0.5)
    assert value(t.scrape(), CONTROL_TIME) == 1001.0
    t.delay = 3.0
    assert value(t.scrape(), CONTROL_TIME) == 1001.0  # the slow read starts (at 1002)
    t.release()
    assert control_read_ended(t.collector, 1002.0)
    t.clock.now += 3.0  # scrapes went on meanwhile: that reading is now 4 s old
    t.delay = 0.8  # the next read is slow too
    text = t.scrape()
    assert value(text, CONTROL_TIME) == 1002.0 and value(text, CONTROL_OK) == 1  # stood in, not waited for
    t.release()


def test_a_control_read_running_past_the_scrape_budget_is_late(tmp_path):
    scen, collector, gate, clock = gated_collector(tmp_path, "control", max_seconds=0.2, control_wait=0.05, gpus=1,
                                                   clients_per_gpu=2)
    try:
        text_of(collector)
        gate.close()
        clock.now += 1.0
        assert value(text_of(collector), CONTROL_OK) == 1  # in flight under the budget: served
        time.sleep(0.3)  # the read has now run longer than a scrape may wait
        clock.now += 1.0
        late = text_of(collector)
        assert value(late, CONTROL_OK) == 0  # a hung daemon still shows as failing
        assert value(late, CONTROL_TIME) == 1000.0
        assert lines(late, "mps_client_memory_used_bytes")  # its last reading still served
    finally:
        gate.open()


def test_a_control_read_already_past_the_budget_is_not_waited_for_again(tmp_path):
    # As while the last clients of a storm connect: the read a scrape starts is still
    # running at the next scrape, longer than that scrape may wait.
    scen, collector, gate, clock = gated_collector(tmp_path, "control", max_seconds=1.0, control_wait=0.05, gpus=1,
                                                   clients_per_gpu=2)
    try:
        first = text_of(collector)
        gate.close()
        clock.now += 1.0
        assert value(text_of(collector), CONTROL_OK) == 1  # started; under the budget: its last reading
        time.sleep(1.1)
        clock.now += 1.0
        started = time.monotonic()
        late = text_of(collector)
        assert time.monotonic() - started < 0.5  # not another 1 s budget
        assert value(late, CONTROL_OK) == 0 and value(late, CONTROL_TIME) == 1000.0
        for name in ("mps_client_info", "mps_client_memory_used_bytes"):
            assert lines(late, name) == lines(first, name)  # proc used the same PIDs: same series
        assert gate.calls == 2  # joined, not sent again
        gate.open()
        assert control_read_ended(collector, 1001.0)
        clock.now += 1.0
        assert value(text_of(collector), CONTROL_OK) == 1  # answering again
    finally:
        gate.open()


def test_control_wait_0_waits_for_the_daemon_as_before(tmp_path):
    scen, collector, gate, clock = gated_collector(tmp_path, "control", max_seconds=5.0, control_wait=0.0, gpus=1,
                                                   clients_per_gpu=1)
    text_of(collector)
    gate.close()
    clock.now += 1.0
    threading.Timer(0.2, gate.open).start()  # answers after the scrape began, well within 5 s
    assert value(text_of(collector), CONTROL_TIME) == 1001.0  # this scrape's reading, waited for


def test_at_steady_state_every_scrape_serves_its_own_control_reading(tmp_path):
    # The default wait (scenarios turn it off), on the test's clock: a daemon that answers
    # within it, however long the read takes on a loaded machine (issue 42 point 8).
    t = TimedControl(tmp_path, wait=Config.control_wait, gpus=2, clients_per_gpu=4)
    assert t.collector.control_wait == DEFAULT_CONTROL_WAIT
    t.delay = DEFAULT_CONTROL_WAIT / 2
    for _ in range(5):
        assert value(t.scrape(), CONTROL_TIME) == t.clock.now
    assert t.time.timeouts == 0  # no wait ended before its read


def test_with_the_default_wait_a_daemon_slower_than_it_is_not_waited_for(tmp_path):
    # The other side of the steady state: an answer later than the default wait, on the
    # collector's clock, is not this scrape's.
    t = TimedControl(tmp_path, wait=Config.control_wait)
    assert value(t.scrape(), CONTROL_TIME) == 1001.0
    t.delay = 2 * DEFAULT_CONTROL_WAIT
    text = t.scrape()
    assert value(text, CONTROL_TIME) == 1001.0 and value(text, CONTROL_OK) == 1
    t.release()
    assert control_read_ended(t.collector, 1002.0)


def test_the_control_wait_flag_reaches_the_collector():
    _, cfg = parse_args(["--collector.control-wait", "0.2"])
    assert build_collector(cfg, {}).control_wait == 0.2
    _, cfg = parse_args(["--collector.control-wait", "0"])
    assert build_collector(cfg, {}).control_wait == 0.0


def test_proc_checks_the_known_pids_while_the_control_read_runs_then_reads_those_it_adds(tmp_path):
    from tests.fakes.fake_control import FakeClient
    from tests.fakes.fake_procfs import FakeProcess, write_proc

    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=2)
    readers = scen.readers()
    gate = Gate(readers["control"])
    readers["control"] = Reader(gate.read)
    proc_client = readers["proc"].source
    asked = []  # ("read" or "cached", PIDs asked, whether the control read was still held then)
    real_read, real_cached = proc_client.read, proc_client.cached

    def spy(pids, keep=frozenset()):
        asked.append(("read", set(pids), not gate._open.is_set()))
        return real_read(pids, keep)

    def spy_cached(pids, keep=frozenset()):
        asked.append(("cached", set(pids), not gate._open.is_set()))
        return real_cached(pids, keep)

    proc_client.read, proc_client.cached = spy, spy_cached
    collector = MpsCollector(readers, clock=Clock(), max_seconds=5.0, control_wait=0.0)  # waits for control
    text_of(collector)
    assert asked[-1][0] == "read"  # new processes: read in the source's thread
    known = asked[-1][1]
    newcomer = 7777  # connected since: only the daemon's `ps` names it, NVML not yet
    write_proc(scen.proc_root, [FakeProcess(newcomer, uid=1500, comm="late.py")])
    scen.daemon.clients.append(FakeClient(newcomer, 4000, scen.nvml.gpus[0].uuid, 9))
    gate.close()
    asked.clear()
    threading.Timer(0.3, gate.open).start()
    text = text_of(collector)
    assert asked[0] == ("cached", known, True)  # the known ones: a stat() each, before the daemon answered
    assert asked[1] == ("cached", {newcomer}, False)  # its answer adds one
    assert asked[2:] == [("read", known | {newcomer}, False)]  # so the source's thread reads
    info = next(l for l in text.splitlines() if l.startswith("mps_client_info{") and 'pid="7777"' in l)
    assert 'uid="1500"' in info  # its /proc facts, in this scrape
    assert all(pid in proc_client._known for pid in known | {newcomer})  # nobody forgotten


def test_quick_reads_run_in_the_scrape_and_a_control_read_not_waited_for_starts_after_them(tmp_path):
    import dataclasses

    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=2)
    readers = scen.readers()
    events = []  # (what, thread)
    proc, control = readers["proc"], readers["control"]
    assert proc.quick is not None and control.quick is None

    def proc_quick(ctx):
        answer = proc.quick(ctx)
        events.append(("proc here" if answer is not None else "proc declined", threading.get_ident()))
        return answer

    answering = threading.Event()  # cleared: the daemon does not answer until it is set
    answering.set()

    def control_read(ctx):
        events.append(("control", threading.get_ident()))
        assert answering.wait(10)
        return control.read(ctx)

    readers["proc"] = dataclasses.replace(proc, quick=proc_quick)
    readers["control"] = Reader(control_read)
    clock = Clock()
    collector = MpsCollector(readers, clock=clock, max_seconds=2.0, control_wait=0.05, refresh_interval=1.0)
    me = threading.get_ident()
    text_of(collector)
    assert ("proc declined", me) in events  # new processes: read in proc's own thread
    events.clear()
    clock.now += 1.0
    text_of(collector)
    assert ("proc here", me) in events and all(who != me for what, who in events if what == "control")
    # That read starts once the scrape has its readings: ended before the next scrape, or
    # on a busy machine the next one joined it and served the one before (CI, f39f25d).
    assert control_read_ended(collector, 1001.0)
    answering.clear()  # the daemon stops answering: this scrape serves the last answer ...
    clock.now += 1.0
    assert value(text_of(collector), CONTROL_TIME) == 1001.0
    answering.set()  # answered after the scrape's wait: slower than the wait
    assert control_read_ended(collector, 1002.0)
    events.clear()
    clock.now += 1.0
    text_of(collector)  # ... and the next does not wait for it at all: its read starts after the others
    assert until(lambda: [what for what, _ in events] == ["proc here", "control"])
