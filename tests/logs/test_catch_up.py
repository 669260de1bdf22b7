"""A log read through its history is not served until it has been read to its end
(no counter climbing from 0 in front of Prometheus), and `--mps.log-start end`
skips the history of a log the state file does not know."""

from __future__ import annotations

import time
from pathlib import Path

from mps_exporter.config import Config, DaemonConfig
from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.logs.statefile import StateStore
from mps_exporter.logs import pipeline as pipeline_mod
from mps_exporter.logs.follower import end_position
from mps_exporter.render import render
from mps_exporter.sources.registry import own_renders
from mps_exporter.sources.logs import SOURCE as LOGS
from mps_exporter.sources.base import Backends, PartialFailure

from .test_pipeline import append


def write_history(directory: Path, capture_lines: dict, rounds: int) -> int:
    """The capture's logs `rounds` times over: lines written."""
    for f in ("control", "server"):
        append(directory / f"{f}.log", capture_lines[f] * rounds)
    return rounds * (len(capture_lines["control"]) + len(capture_lines["server"]))


def served(reading) -> dict:
    """Family name -> samples of what a scrape would serve of this logs reading."""
    from mps_exporter.model import Snapshot

    snap = Snapshot(now=0.0)
    LOGS.store(snap, reading)
    always = {f.name for f in render(Snapshot(now=0.0), own_renders=own_renders()).families()}  # the exporter's own
    return {f.name: f.samples for f in render(snap, own_renders=own_renders()).families() if f.name not in always}


def test_the_logs_are_served_only_once_read_to_their_end(tmp_path, capture_lines, monkeypatch):
    monkeypatch.setattr(pipeline_mod, "PUBLISH_LINES", 500)  # many snapshots on the way
    write_history(tmp_path, capture_lines, rounds=20)
    cfg = Config(daemons=[DaemonConfig("default", "/p", str(tmp_path))], log_timezone="UTC")
    reader = LOGS.build(cfg, Backends())
    seen = []
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reader_ready = reader.ready()  # asked first: once ready, a read is caught up too
            try:
                reading, ready = reader.read(None), True
            except PartialFailure as e:
                reading, ready = e.result, False
                assert "catching up" in str(e)
            seen.append((ready, reader_ready, reading["default"], served(reading)))
            if ready:
                break
            time.sleep(0.002)
    finally:
        reader.close()
    catching_up = [s for s in seen if not s[0]]
    assert catching_up and seen[-1][0], "the catch-up was never seen, or never ended"
    final = seen[-1][3]
    for _, reader_ready, snap, families in catching_up:
        assert not reader_ready and not snap.caught_up
        # Only the backlog, which shrinks to 0: no log family, so no counter below its final value
        # (and the state file's errors, which are the exporter's, not the logs').
        assert set(families) - {"mps_exporter_state_file_errors"} == {"mps_log_backlog_bytes"}
        assert families["mps_log_backlog_bytes"][0].value == snap.backlog_bytes
    # Before the reader thread's first round the backlog is not known yet (0); from then on
    # it is, before the first line is read, and only shrinks.
    backlog = [s[2].backlog_bytes for s in catching_up]
    backlog = backlog[next(i for i, b in enumerate(backlog) if b):]
    assert backlog == sorted(backlog, reverse=True)
    total = sum((tmp_path / f"{f}.log").stat().st_size for f in ("control", "server"))
    assert 0 < backlog[0] <= total
    assert final["mps_log_backlog_bytes"][0].value == 0 and "mps_log_lines" in final
    lines = {s.labels["file"]: s.value for s in final["mps_log_lines"]}
    assert lines == {"control": 20 * len(capture_lines["control"]), "server": 20 * len(capture_lines["server"])}


def test_log_start_end_skips_the_history_of_an_unknown_log(tmp_path, capture_lines):
    write_history(tmp_path, capture_lines, rounds=3)
    with open(tmp_path / "control.log", "a") as f:
        f.write(capture_lines["control"][0][:20])  # a line being written at the start
    pipe = LogPipeline("default", str(tmp_path), "UTC", log_start="end")
    first = pipe.read_once()
    assert first.lines == {"control": 0, "server": 0} and first.caught_up and first.backlog_bytes == 0
    with open(tmp_path / "control.log", "a") as f:
        f.write(capture_lines["control"][0][20:] + "\n")
    append(tmp_path / "server.log", capture_lines["server"][:10])
    second = pipe.read_once()
    # The line being written counts once whole; the history never.
    assert second.lines == {"control": 1, "server": 10} and second.unrecognized == {"control": 0, "server": 0}


def test_log_start_end_still_resumes_from_the_state_file(tmp_path, capture_lines):
    logs, store = tmp_path / "logs", StateStore(str(tmp_path / "state.json"))
    logs.mkdir()
    write_history(logs, capture_lines, rounds=1)
    LogPipeline("default", str(logs), "UTC", store).read_once()
    append(logs / "control.log", capture_lines["control"][:5])  # written while the exporter was down
    again = LogPipeline("default", str(logs), "UTC", store, log_start="end").read_once()
    assert again.lines["control"] == len(capture_lines["control"]) + 5
    # A daemon the state file does not know starts at the end, beside one it knows.
    other = LogPipeline("other", str(logs), "UTC", store, log_start="end").read_once()
    assert other.lines == {"control": 0, "server": 0}


def test_end_position_of_missing_and_odd_files(tmp_path):
    assert end_position(str(tmp_path / "absent.log")) == {}
    assert end_position(str(tmp_path)) == {}  # a directory under the name
    (tmp_path / "partial.log").write_text("no newline yet")
    assert end_position(str(tmp_path / "partial.log"))["offset"] == 0
    (tmp_path / "long.log").write_text("a\n" + "x" * 70000)  # a last line past the line cap
    assert end_position(str(tmp_path / "long.log"))["offset"] == 70002
