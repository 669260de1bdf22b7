"""Background refresh (--collector.refresh-interval): scrapes serve the latest reading of
the background sources (NVML, DCGM) while it is at most two intervals old, read like any
other source when it is older, and the reads pause without scrapes; control commands are
sent by scrapes only, never by the refresher.

Timing-free where it can be: intervals are long and the collector's clock is the test's,
so a reading's age is what the test sets; the pause tests wait on the refresher's own
round counter, with generous timeouts, never on a measured duration."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator, Tuple

import pytest

from mps_exporter.cli import parse_args
from mps_exporter.collector import MpsCollector
from mps_exporter.sources.registry import SOURCES
from mps_exporter.wiring import build_collector
from tests.support import scenarios
from tests.test_deadline import Clock, gated, text_of, value  # noqa: F401 (gated: a fixture)

MPS_LIST = "nvmlDeviceGetMPSComputeRunningProcesses"
NVML_TIME = 'mps_exporter_collector_last_success_timestamp_seconds{collector="nvml"}'


def until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture
def refreshed(tmp_path: Path) -> Iterator[Tuple[scenarios.Scenario, MpsCollector, Clock]]:
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=2)
    clock = Clock()
    collector = MpsCollector(scen.readers(), clock=clock, max_seconds=5.0, refresh_interval=30.0)
    collector.start()
    assert until(lambda: collector.refreshes >= 1)
    yield scen, collector, clock
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


def test_status_shows_the_age_of_each_reading(gated):  # noqa: F811 (the fixture)
    from mps_exporter.status import text, view

    collector, gate, clock = gated
    collector.snapshot(0.3)  # NVML's reading at 1000
    gate.close()  # and no other: its next read hangs past the deadline
    clock.now += 7.0
    st = view.build(collector.snapshot(0.3), "test")
    ages = {s.name: s.age_seconds for s in st.sources}
    assert ages["nvml"] == 7.0 and ages["control"] == 0.0
    assert "reading ages: control 0.0 s, nvml 7.0 s, proc 0.0 s" in [line for line, _ in text.report(st)]
    gate.open()
