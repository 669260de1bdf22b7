"""The exporter's process_* series: OwnProcess's values are ProcessCollector's, and each
scrape's process_* text is client_python's encoding of ProcessCollector's families."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.process_collector import ProcessCollector

import mps_exporter.collector as collector_module
from mps_exporter.own_process import FD_SERIES, STAT_SERIES, OwnProcess

PID = "4242"
OPENMETRICS = "application/openmetrics-text;version=1.0.0"


def fake_proc(root: Path, utime: int = 1234, rss_pages: int = 4321, fds: int = 5, soft_limit: int = 1024) -> Path:
    """A /proc of one process: its stat (a comm with `)` in it), limits and fd directory."""
    (root / PID / "fd").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n")
    fields = ["0"] * 50
    fields[0], fields[11], fields[12], fields[19], fields[20], fields[21] = \
        "S", str(utime), "567", "98765", "123456789", str(rss_pages)
    (root / PID / "stat").write_text(f"{PID} (odd) name) " + " ".join(fields) + "\n")
    (root / PID / "limits").write_text("Limit                     Soft Limit           Hard Limit           Units\n"
                                       f"Max open files            {soft_limit}                 4096                 files\n")
    for entry in (root / PID / "fd").iterdir():
        entry.unlink()
    for i in range(fds):
        (root / PID / "fd" / str(i)).write_text("")
    return root


def client_python(root: Path) -> ProcessCollector:
    return ProcessCollector(proc=str(root), pid=lambda: PID, registry=None)


def samples(collector: Any) -> List[Any]:
    return [(s.name, s.value) for family in collector.collect() for s in family.samples]


def test_the_values_are_process_collectors_to_the_last_bit(tmp_path):
    root = fake_proc(tmp_path, utime=1237, rss_pages=77777, fds=9, soft_limit=2048)
    names, values = OwnProcess(str(root), PID, file_limit=lambda: 2048.0).figures()
    assert list(zip(names, values)) == samples(client_python(root))
    assert names == STAT_SERIES + FD_SERIES


def test_the_open_file_limit_from_getrlimit_is_what_proc_self_limits_says():
    names, values = OwnProcess().figures()
    theirs = dict(samples(ProcessCollector(registry=None)))
    ours = dict(zip(names, values))
    assert set(ours) == set(theirs)
    assert ours["process_max_fds"] == theirs["process_max_fds"]
    assert ours["process_start_time_seconds"] == theirs["process_start_time_seconds"]


def test_what_cannot_be_read_is_left_out_as_client_python_leaves_it_out(tmp_path):
    root = fake_proc(tmp_path)
    os.unlink(root / PID / "stat")
    own = OwnProcess(str(root), PID, file_limit=lambda: 1024.0)
    assert own.figures()[0] == FD_SERIES == tuple(name for name, _ in samples(client_python(root)))
    assert OwnProcess(str(tmp_path / "nothing"), PID).figures() == ((), ())


def test_values_are_read_again_only_after_a_second(tmp_path):
    root = fake_proc(tmp_path, utime=100)
    now = [50.0]
    own = OwnProcess(str(root), PID, file_limit=lambda: 1024.0, clock=lambda: now[0])
    first = own.figures()
    fake_proc(tmp_path, utime=300)
    now[0] += 0.999
    assert own.figures() == first
    now[0] += 0.001
    assert own.figures()[1][STAT_SERIES.index("process_cpu_seconds_total")] == 300 / os.sysconf("SC_CLK_TCK") + 5.67


def _theirs(encoder: Any, root: Path) -> bytes:
    registry = CollectorRegistry()
    registry.register(client_python(root))
    text = encoder(registry)
    trailer = encoder(CollectorRegistry())
    return text[:len(text) - len(trailer)]


@pytest.mark.parametrize("accept", [OPENMETRICS, "text/plain"])
def test_every_scrapes_process_text_is_client_pythons_encoding(tmp_path, monkeypatch, accept):
    """Values moving at every scrape, series going and coming back: client_python's bytes
    each time, and its families encoded only where the series changed."""
    encoder, _ = choose_encoder(accept)
    fake_proc(tmp_path)
    now = [0.0]
    own = OwnProcess(str(tmp_path), PID, file_limit=lambda: 1024.0, clock=lambda: now[0])
    text = collector_module._ProcessText(collector_module._FamilyEncoder(encoder), own)
    made: List[int] = []
    real = text._made
    monkeypatch.setattr(text, "_made", lambda names: made.append(1) or real(names))
    for step, (utime, rss, fds) in enumerate([(1, 2, 3), (2, 7, 3), (3, 7, 0), (1 << 40, 1 << 45, 6)]):
        fake_proc(tmp_path, utime=utime, rss_pages=rss, fds=fds)
        now[0] += 1.0
        assert text.encode() == _theirs(encoder, tmp_path), step
    assert len(made) == 1
    os.unlink(tmp_path / PID / "stat")  # the stat series go
    now[0] += 1.0
    assert text.encode() == _theirs(encoder, tmp_path)
    fake_proc(tmp_path, utime=9)  # and come back
    now[0] += 1.0
    assert text.encode() == _theirs(encoder, tmp_path)
    assert len(made) == 3


def test_series_client_python_gives_otherwise_are_encoded_from_its_families(tmp_path):
    """No limits file: ProcessCollector gives no fd series where OwnProcess reads them (its
    limit from getrlimit). The families are then encoded whole, as client_python does."""
    encoder, _ = choose_encoder("text/plain")
    fake_proc(tmp_path)
    os.unlink(tmp_path / PID / "limits")
    text = collector_module._ProcessText(collector_module._FamilyEncoder(encoder),
                                         OwnProcess(str(tmp_path), PID, file_limit=lambda: 1024.0))
    for _ in range(2):
        assert text.encode() == _theirs(encoder, tmp_path)
        assert b"process_open_fds" not in text.encode()
    assert text._kept is not None and text._kept.parts is None


def test_a_client_python_without_the_collectors_constants_costs_its_speed_not_the_scrape(tmp_path, monkeypatch):
    """Were ProcessCollector's tick, page size or boot time renamed, OwnProcess reads
    nothing, and the scrape encodes client_python's families as they are."""
    import mps_exporter.own_process as own_process

    encoder, _ = choose_encoder("text/plain")
    fake_proc(tmp_path)
    own = OwnProcess(str(tmp_path), PID, file_limit=lambda: 1024.0)
    monkeypatch.setattr(own_process, "COLLECTOR_CONSTANTS", ("_ticks", "_page_size", "_btime"))
    text = collector_module._ProcessText(collector_module._FamilyEncoder(encoder), own)
    assert own.figures() == ((), ())
    assert text.encode() == _theirs(encoder, tmp_path) and b"process_open_fds" in text.encode()
