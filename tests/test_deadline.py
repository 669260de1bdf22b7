"""Scrape deadlines (issue 12): a late source costs only its own series, its last complete
reading is served with its time, at most one read per source is outstanding, and
Prometheus' X-Prometheus-Scrape-Timeout-Seconds sets the deadline through the web server.

The slow source blocks on an event the test holds, so nothing depends on how fast
this machine is: a deadline passes, the test releases the source afterwards."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, List

import pytest
from prometheus_client.exposition import generate_latest

from mps_exporter.collector import MpsCollector, build_registry
from mps_exporter.scrape_timeout import scrape_timeout
from mps_exporter.config import Config
from mps_exporter.sources.base import ReadContext, Reader
from mps_exporter.wiring import build_collector, dump
from tests.support import scenarios
from tests.test_web import request, running


class Gate:
    """Wraps a reader: reads after `close()` block until `open()`."""

    def __init__(self, reader: Reader[Any]) -> None:
        self.reader, self.calls = reader, 0
        self._open = threading.Event()
        self._open.set()

    def read(self, ctx: ReadContext) -> Any:
        self.calls += 1
        self._open.wait(30)
        return self.reader.read(ctx)

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()


def read_ended(collector: Any, name: str, timeout: float = 10.0) -> bool:
    """Whether the source's read in flight ended within `timeout` seconds."""
    end = time.monotonic() + timeout
    while (inflight := collector._runs[name]._inflight) is not None and not inflight.done():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple]:
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=2)
    readers = scen.readers()
    gate = Gate(readers["nvml"])
    readers["nvml"] = Reader(gate.read)
    clock = Clock()
    collector = MpsCollector(readers, clock=clock, max_seconds=0.3)
    yield collector, gate, clock
    gate.open()


def text_of(collector: MpsCollector) -> str:
    return generate_latest(build_registry(collector, process=False)).decode()


def value(text: str, series: str) -> float:
    line = next(l for l in text.splitlines() if l.startswith(series + " "))
    return float(line.rsplit(" ", 1)[1])


def lines(text: str, name: str) -> List[str]:
    return [l for l in text.splitlines() if l.startswith(name + "{")]


def test_a_late_source_fails_its_collector_and_serves_its_last_reading_marked(gated):
    collector, gate, clock = gated
    first = text_of(collector)
    assert value(first, 'mps_exporter_collector_success{collector="nvml"}') == 1.0
    gate.close()
    clock.now = 1015.0
    late = text_of(collector)
    assert value(late, 'mps_exporter_collector_success{collector="nvml"}') == 0.0
    assert value(late, 'mps_exporter_collector_last_success_timestamp_seconds{collector="nvml"}') == 1000.0
    assert value(late, 'mps_exporter_collector_last_success_timestamp_seconds{collector="control"}') == 1015.0
    # The other collectors answered, and the GPU series are the reading of 1000.0.
    assert value(late, 'mps_exporter_collector_success{collector="control"}') == 1.0
    assert lines(late, "mps_gpu_memory_used_bytes") == lines(first, "mps_gpu_memory_used_bytes")
    assert len(lines(late, "mps_client_memory_used_bytes")) == 4
    gate.open()


def test_a_late_source_without_a_reading_yet_costs_only_its_own_series(gated):
    collector, gate, _ = gated
    gate.close()
    text = text_of(collector)
    assert value(text, 'mps_exporter_collector_success{collector="nvml"}') == 0.0
    assert not lines(text, "mps_gpu_up") and 'collector="nvml"' not in "".join(
        lines(text, "mps_exporter_collector_last_success_timestamp_seconds"))
    assert value(text, 'mps_control_daemon_up{daemon="default"}') == 1.0
    assert len(lines(text, "mps_client_info")) == 4  # from the daemon's ps
    gate.open()


def test_at_most_one_read_per_source_is_outstanding(gated):
    collector, gate, _ = gated
    text_of(collector)
    gate.close()
    for _ in range(4):  # each scrape finds the late read still running and joins it
        text_of(collector)
    assert gate.calls == 2  # the late read and no other
    gate.open()
    assert read_ended(collector, "nvml")
    text = text_of(collector)  # the late read finished: the next scrape starts a new one
    assert gate.calls == 3 and value(text, 'mps_exporter_collector_success{collector="nvml"}') == 1.0
    count = value(text, 'mps_exporter_collector_read_duration_seconds_count{collector="nvml"}')
    assert count == 3  # the late read is in the histogram too


def test_the_budget_follows_prometheus_timeout_with_the_offset_and_the_ceiling():
    collector = MpsCollector({}, max_seconds=5.0, timeout_offset=0.5)
    assert collector.budget(None) == 5.0
    assert collector.budget(10.0) == 5.0
    assert collector.budget(2.0) == 1.5
    assert collector.budget(0.6) == 0.3  # the offset would leave less than half
    assert MpsCollector({}, max_seconds=None).budget(3.0) == 2.5


def test_scrape_timeout_reads_the_header_value():
    seen = []
    collector = MpsCollector({})
    collector.snapshot = lambda budget=None: seen.append(budget) or MpsCollector({}).snapshot()  # type: ignore
    for header in ("4", "junk", "", "-1", None):
        with scrape_timeout(header):
            collector.collect()
    assert seen == [3.5, None, None, None, None]


def test_the_web_server_passes_prometheus_timeout_to_the_collector(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1)
    readers = scen.readers()
    gate = Gate(readers["nvml"])
    readers["nvml"] = Reader(gate.read)
    gate.close()
    registry = build_registry(MpsCollector(readers, max_seconds=None, timeout_offset=0.5), process=False)
    try:
        with running(registry) as server:
            status, _, body = request(server, "/metrics", headers={"X-Prometheus-Scrape-Timeout-Seconds": "1.5"})
    finally:
        gate.open()
    text = body.decode()
    assert status == 200
    assert value(text, 'mps_exporter_collector_success{collector="nvml"}') == 0.0
    assert value(text, 'mps_exporter_collector_success{collector="control"}') == 1.0


def test_dump_textfile_is_written_whole_with_no_temporary_left(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=2)
    out = tmp_path / "textfile" / "mps.prom"
    out.parent.mkdir()
    out.write_text("old\n")
    cfg: Config = scen.cfg
    cfg.textfile = str(out)
    import mps_exporter.wiring as wiring

    real = wiring.build_readers
    wiring.build_readers = lambda c, backends=None, recorded=None: real(c, scen.backends(), recorded)  # type: ignore
    try:
        assert dump(cfg) == 0
    finally:
        wiring.build_readers = real
    text = out.read_text()
    assert 'mps_gpu_up{gpu="0"' in text and text.endswith("\n") and "process_cpu_seconds_total" not in text
    assert os.listdir(out.parent) == ["mps.prom"]


def test_build_collector_bounds_serve_but_not_dump(tmp_path):
    cfg = Config(scrape_max_seconds=2.0)
    assert build_collector(cfg, {}).max_seconds == 2.0
    assert build_collector(cfg, {}, bounded=False).max_seconds is None
    assert build_collector(Config(scrape_max_seconds=0), {}).max_seconds is None


def test_a_late_read_that_ends_after_its_scrape_logs_no_recovery(gated, caplog):
    collector, gate, _ = gated
    text_of(collector)
    gate.close()
    with caplog.at_level("INFO", logger="mps_exporter.collector"):
        text_of(collector)
        gate.open()
        assert read_ended(collector, "nvml")
        gate.close()
        text_of(collector)  # late again: the same failure, not logged again
        gate.open()
        assert read_ended(collector, "nvml")
        text_of(collector)  # in time: recovered
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["collector nvml failed: no answer within 0.3 s", "collector nvml recovered"], messages


def test_a_sources_reads_share_one_thread_that_ends_when_idle_or_closed(tmp_path, monkeypatch):
    import mps_exporter.collector as collector_module

    monkeypatch.setattr(collector_module, "READ_THREAD_IDLE_SECONDS", 0.3)
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1)
    readers = scen.readers()
    real = readers["nvml"]
    threads: List[int] = []
    readers["nvml"] = Reader(lambda ctx: (threads.append(threading.get_ident()), real.read(ctx))[1])
    collector = MpsCollector(readers, clock=Clock(), max_seconds=5.0)
    for _ in range(3):
        assert value(text_of(collector), 'mps_exporter_collector_success{collector="nvml"}') == 1.0
    assert len(threads) == 3 and len(set(threads)) == 1  # no thread started per read
    worker = collector._runs["nvml"]._worker
    worker.join(5)
    assert not worker.is_alive() and collector._runs["nvml"]._worker is None  # idle: ended
    assert value(text_of(collector), 'mps_exporter_collector_success{collector="nvml"}') == 1.0  # a new one
    worker = collector._runs["nvml"]._worker
    collector.close()
    worker.join(5)
    assert not worker.is_alive()
