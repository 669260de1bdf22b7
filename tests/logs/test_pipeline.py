"""LogPipeline: the follower thread, the state file across restarts, and the render."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator, List, Tuple

import pytest

from mps_exporter.catalog import METRICS
from mps_exporter.contract import QUEUE_WAIT_BUCKETS
from mps_exporter.families import FamilyBuilder
from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.logs.render import render_log_metrics
from mps_exporter.logs.statefile import StateStore

from .helpers import at, replay


def append(path: Path, rows: List[str]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(r + "\n" for r in rows))


def wait_until(check: Callable[[], bool], limit: float = 10.0) -> bool:
    """Poll a condition; bounded, so a broken thread fails the test instead of hanging it."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()


def split_at(rows: List[str], text: str) -> int:
    return next(i for i, r in enumerate(rows) if text in r)


def test_thread_follows_appends_off_the_scrape_path(tmp_path, capture_lines):
    control = capture_lines["control"]
    push = split_at(control, "NEW CLIENT 2483 from user 1500: Server is not ready")
    admit = split_at(control, "NEW CLIENT 2483 from user 1500: Server already exists")
    append(tmp_path / "control.log", control[:push])
    pipe = LogPipeline("default", str(tmp_path), timezone="UTC")
    pipe.start()
    try:
        assert wait_until(lambda: pipe.snapshot().lines["control"] == push)  # existing lines read at start
        before = pipe.snapshot()
        assert before.queued["user_switch"] == 0 and before.servers.keys() == {1589}
        append(tmp_path / "control.log", control[push:push + 1])
        assert wait_until(lambda: pipe.snapshot().queued["user_switch"] == 1)
        assert pipe.snapshot().oldest_queued_since == pytest.approx(at("04:22:16.630"))
        append(tmp_path / "control.log", control[push + 1:admit + 1])
        waited = before.queue_wait["user_switch"]  # run 1's two user switches
        assert wait_until(lambda: pipe.snapshot().queue_wait["user_switch"].count == waited.count + 1)
        assert pipe.snapshot().queue_wait["user_switch"].total - waited.total == pytest.approx(12.982, abs=1e-6)
        assert pipe.snapshot().queued["user_switch"] == 0
        assert before.queued["user_switch"] == 0  # published snapshots never change afterwards
    finally:
        pipe.stop()
    assert pipe.errors == 0


def test_copytruncate_counts_every_line_once_and_stop_closes_what_start_opened(tmp_path, capture_lines):
    control, log = capture_lines["control"], tmp_path / "control.log"
    descriptors = len(os.listdir("/proc/self/fd"))
    append(log, control[:10])
    pipe = LogPipeline("default", str(tmp_path), timezone="UTC")
    pipe.start()
    try:
        assert wait_until(lambda: pipe.snapshot().lines["control"] == 10)
        append(log, control[10:12])
        shutil.copy(log, tmp_path / "control.log.1")  # logrotate's copy ...
        append(log, control[12:14])  # ... MPS writes on ...
        assert wait_until(lambda: pipe.snapshot().lines["control"] == 14)  # ... read before the truncate
        with open(log, "r+") as f:
            f.truncate(0)
        append(log, control[14:16])
        assert wait_until(lambda: pipe.snapshot().lines["control"] == 16)
        append(log, control[16:17])
        assert wait_until(lambda: pipe.snapshot().lines["control"] == 17)  # nothing read twice on the way
        assert pipe.snapshot().rotation_gaps == {}
    finally:
        pipe.stop()
    assert pipe.errors == 0
    assert len(os.listdir("/proc/self/fd")) == descriptors  # the inotify instance and the wake-up pipe


@contextlib.contextmanager
def following(tmp_path: Path, first: List[str]) -> Iterator[Tuple[LogPipeline, Path]]:
    """A started pipeline whose control.log holds `first`, read to its end; stopped after."""
    log = tmp_path / "control.log"
    append(log, first)
    pipe = LogPipeline("default", str(tmp_path), timezone="UTC")
    pipe.start()
    try:
        assert wait_until(lambda: pipe.snapshot().lines["control"] == len(first))
        yield pipe, log
    finally:
        pipe.stop()


def test_a_watch_that_fails_costs_the_wake_ups_not_the_reader(tmp_path, capture_lines, monkeypatch, caplog):
    from mps_exporter.logs.wake import DirectoryWatch

    def broken(self, timeout, writes=False):
        raise RuntimeError("a bug in the watch")

    monkeypatch.setattr(DirectoryWatch, "wait", broken)
    control = capture_lines["control"]
    with following(tmp_path, control[:5]) as (pipe, log):
        append(log, control[5:8])
        assert wait_until(lambda: pipe.snapshot().lines["control"] == 8)  # polled every 250 ms
    assert pipe.errors == 1 and "polling from now on" in caplog.text


def test_an_idle_reader_sleeps_until_a_write_and_reads_it_at_once(tmp_path, capture_lines, monkeypatch):
    from mps_exporter.logs import pipeline as pipeline_module
    from mps_exporter.logs.wake import DirectoryWatch

    waits = []  # (timeout, writes) of each pause between two rounds
    real = DirectoryWatch.wait

    def recorded(self, timeout, writes=False):
        waits.append((timeout, writes))
        return real(self, timeout, writes)

    monkeypatch.setattr(DirectoryWatch, "wait", recorded)
    control = capture_lines["control"]
    with following(tmp_path, control[:5]) as (pipe, log):
        assert wait_until(lambda: waits and waits[-1] == (pipeline_module.QUIET_SECONDS, True))  # nothing to read
        rounds = len(waits)
        time.sleep(1.0)
        assert len(waits) == rounds  # asleep: not 4 looks a second
        started = time.monotonic()
        append(log, control[5:8])
        assert wait_until(lambda: pipe.snapshot().lines["control"] == 8)
        assert time.monotonic() - started < 0.75 * pipeline_module.QUIET_SECONDS  # woken by the write
    assert pipe.errors == 0


def test_quiet_waits_double_while_nothing_is_missed_and_stay_short_after_a_miss():
    from mps_exporter.logs.pipeline import QUIET_MAX_SECONDS, QUIET_SECONDS, QuietWait

    wait = QuietWait()
    seen = [wait.seconds]
    for _ in range(6):
        assert wait.ran_out(found_lines=False) is False
        seen.append(wait.seconds)
    assert seen[0] == QUIET_SECONDS and seen[-1] == QUIET_MAX_SECONDS
    assert all(b == min(2 * a, QUIET_MAX_SECONDS) for a, b in zip(seen, seen[1:]))
    assert wait.ran_out(found_lines=True) is True  # lines the watch never reported
    assert (wait.seconds, wait.misses_writes) == (QUIET_SECONDS, True)
    assert wait.ran_out(found_lines=False) is False and wait.seconds == QUIET_SECONDS  # for good
    assert wait.ran_out(found_lines=True) is False  # said once


def test_a_reader_whose_watch_misses_writes_goes_back_to_short_quiet_waits(tmp_path, capture_lines, monkeypatch,
                                                                          caplog):
    """Every wait runs out at once as if inotify saw nothing: the quiet waits grow while
    nothing is found, and once lines turn up after one of them, stay QUIET_SECONDS."""
    from mps_exporter.logs import pipeline as pipeline_module
    from mps_exporter.logs.wake import DirectoryWatch

    waits = []  # the timeout of each quiet wait

    def ran_out(self, timeout, writes=False):
        if writes:
            waits.append(timeout)
        time.sleep(0.005)  # no write is ever reported
        return False

    monkeypatch.setattr(DirectoryWatch, "wait", ran_out)
    monkeypatch.setattr(DirectoryWatch, "watching", property(lambda self: True))
    control = capture_lines["control"]
    caplog.set_level("INFO", logger=pipeline_module.__name__)
    with following(tmp_path, control[:5]) as (pipe, log):
        assert wait_until(lambda: waits.count(pipeline_module.QUIET_MAX_SECONDS) >= 2)
        growing = list(waits)
        append(log, control[5:8])
        assert wait_until(lambda: pipe.snapshot().lines["control"] == 8)
        missed = len(waits)
        assert wait_until(lambda: len(waits) >= missed + 3)
    doubling = [pipeline_module.QUIET_SECONDS]
    while doubling[-1] < pipeline_module.QUIET_MAX_SECONDS:
        doubling.append(min(2 * doubling[-1], pipeline_module.QUIET_MAX_SECONDS))
    assert growing[:len(doubling) + 1] == doubling + [pipeline_module.QUIET_MAX_SECONDS]
    assert set(waits[missed:]) == {pipeline_module.QUIET_SECONDS}
    assert "came without a write seen by inotify" in caplog.text
    assert pipe.errors == 0


def test_restart_with_state_file_neither_loses_nor_double_counts(tmp_path, capture_lines):
    logs, store_path = tmp_path / "logs", tmp_path / "state.json"
    logs.mkdir()
    control, server = capture_lines["control"], capture_lines["server"]
    cut_c, cut_s = split_at(control, "04:22:18.034"), split_at(server, "04:22:17.232")
    append(logs / "control.log", control[:cut_c])
    append(logs / "server.log", server[:cut_s])
    with open(logs / "control.log", "a") as f:
        f.write(control[cut_c][:30])  # a partial line at the moment of the save
    first = LogPipeline("default", str(logs), "UTC", StateStore(str(store_path))).read_once()
    assert first.queued["user_switch"] == 1  # uid 1500's client is waiting at the restart
    with open(logs / "control.log", "a") as f:
        f.write(control[cut_c][30:] + "\n")
    append(logs / "control.log", control[cut_c + 1:])
    append(logs / "server.log", server[cut_s:])
    second = LogPipeline("default", str(logs), "UTC", StateStore(str(store_path))).read_once()
    whole = replay(capture_lines).snapshot()
    assert second.lines == whole.lines == {"control": 1071, "server": 935}
    assert second == whole  # every counter, the histogram (the 12.98 s wait spans the restart) and the state
    assert first.counts and all(second.count(name) >= n for name, n in first.counts.items())  # never backwards
    third = LogPipeline("default", str(logs), "UTC", StateStore(str(store_path))).read_once()
    assert third == whole  # nothing new: nothing counted again


def test_state_file_is_shared_by_daemons_and_written_atomically(tmp_path, capture_dir):
    store = StateStore(str(tmp_path / "state.json"))
    LogPipeline("a", str(capture_dir), "UTC", store).read_once()
    LogPipeline("b", str(tmp_path / "nowhere"), "UTC", store).read_once()
    doc = json.loads((tmp_path / "state.json").read_text())
    assert set(doc) == {"a", "b"} and doc["a"]["state"]["counts"]["mps_server_starts_total"] == 10
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary file left behind


@pytest.mark.parametrize("content", ["{not json", "[]", '{"default": {"version": 1, "state": {"x": 1}}}',
                                     '{"default": "text"}',
                                     '{"default": {"version": 1, "files": [], "state": {"counters": [], "maps": []}}}',
                                     '{"default": {"version": 2, "files": {}, "state": {"counts": [], "maps": []}}}',
                                     '{"default": {"version": 3, "files": {}, "state": {}}}'])
def test_broken_state_file_means_starting_fresh(tmp_path, capture_dir, content):
    (tmp_path / "state.json").write_text(content)
    snap = LogPipeline("default", str(capture_dir), "UTC", StateStore(str(tmp_path / "state.json"))).read_once()
    assert snap.count("mps_server_starts_total") == 10
    assert json.loads((tmp_path / "state.json").read_text())["default"]["state"]["counts"]["mps_server_starts_total"] == 10


def test_unwritable_state_file_is_not_fatal(tmp_path, capture_dir):
    store = StateStore(str(tmp_path / "missing-dir" / "state.json"))
    assert LogPipeline("default", str(capture_dir), "UTC", store).read_once().count("mps_server_starts_total") == 10


def test_missing_directory_gives_zeros_not_errors(tmp_path):
    pipe = LogPipeline("default", str(tmp_path / "absent"), "UTC")
    snap = pipe.read_once()
    assert snap.lines == {"control": 0, "server": 0}
    pipe.start()
    pipe.stop()


def test_bad_timezone_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="unknown time zone"):
        LogPipeline("default", str(tmp_path), timezone="Nowhere/Land")


def test_render_follows_the_contract(capture_lines):
    snap = replay(capture_lines, until="04:22:20.000").snapshot()
    out = FamilyBuilder()
    render_log_metrics(out, "gpu0", snap, now=at("04:22:21.630"))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in out.families() for s in fam.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"daemon": "gpu0", **labels}.items())))]

    assert value("mps_queued_clients", reason="user_switch") == 1
    assert value("mps_queued_clients", reason="server_starting") == 0
    assert value("mps_queued_client_oldest_wait_seconds") == pytest.approx(5.0)  # pushed 04:22:16.630
    assert value("mps_server_handoffs_total") == 2  # run 1's two; run 2's are still ahead
    assert value("mps_log_lines_total", file="control") == split_at(capture_lines["control"], "04:22:22.838")
    assert value("mps_control_commands_total", command="get_server_list") > 0
    # Histogram: one bucket per QUEUE_WAIT_BUCKETS bound plus +Inf, cumulative, _count == +Inf.
    buckets = [(k, v) for k, v in samples.items()
               if k[0] == "mps_client_queue_wait_seconds_bucket" and ("reason", "user_switch") in k[1]]
    assert len(buckets) == len(QUEUE_WAIT_BUCKETS) + 1
    assert value("mps_client_queue_wait_seconds_count", reason="user_switch") == 2  # run 1's two
    assert value("mps_client_queue_wait_seconds_bucket", reason="user_switch", le="+Inf") == 2
    names = {fam.name for fam in out.families()}
    for name in names:
        spec = METRICS.get(name) or METRICS.get(name + "_total")
        assert spec is not None and spec.table in ("Queueing and contention", "From the MPS logs")
    assert not any(math.isnan(v) for v in samples.values())


def test_restart_while_the_log_directory_is_gone_keeps_the_counters(tmp_path, capture_lines):
    logs, store = tmp_path / "logs", StateStore(str(tmp_path / "state.json"))
    logs.mkdir()
    append(logs / "control.log", capture_lines["control"])
    first = LogPipeline("default", str(logs), "UTC", store).read_once()
    for p in logs.iterdir():
        p.unlink()
    logs.rmdir()  # the device plugin deleted the directory with the daemon
    second = LogPipeline("default", str(logs), "UTC", store).read_once()
    assert second.count("mps_server_starts_total") == first.count("mps_server_starts_total") == 10 and second.lines == first.lines
    logs.mkdir()  # a new daemon writes a new file (its first bytes are not the old one's): counted on top
    append(logs / "control.log", ["[2026-11-22 00:00:00.000 Control  9999] NEW UI"] + capture_lines["control"][:3])
    third = LogPipeline("default", str(logs), "UTC", store).read_once()
    assert third.lines["control"] == 1071 + 4
    assert store.errors == {}


# ------------------------------------------------------------ the state file is checked (issue 26)

def saved_run(tmp_path, capture_lines):
    logs, store_path = tmp_path / "logs", tmp_path / "state.json"
    logs.mkdir()
    append(logs / "control.log", capture_lines["control"])
    append(logs / "server.log", capture_lines["server"])
    first = LogPipeline("default", str(logs), "UTC", StateStore(str(store_path))).read_once()
    return logs, store_path, first


def edit_state(store_path, change) -> None:
    doc = json.loads(store_path.read_text())
    change(doc["default"])
    store_path.write_text(json.dumps(doc))


@pytest.mark.parametrize("reason, change", [
    ("negative_counter", lambda e: e["state"]["counts"].update(mps_server_starts_total=-1e308)),
    ("negative_counter", lambda e: e["state"]["maps"]["lines"].update(control=-5)),
    ("shape", lambda e: e.update(files=["not", "a", "mapping"])),
    ("shape", lambda e: e["files"]["control"].update(offset="far")),
    ("shape", lambda e: e.update(state=[1, 2, 3])),
    ("position", lambda e: e["files"]["control"].update(offset=e["files"]["control"]["offset"] + 10_000)),
    ("position", lambda e: e["files"]["server"].update(tail="00" * 64)),
])
def test_a_state_file_in_doubt_starts_from_the_logs_counted_never_doubled(tmp_path, capture_lines, reason, change):
    logs, store_path, first = saved_run(tmp_path, capture_lines)
    edit_state(store_path, change)
    store = StateStore(str(store_path))
    second = LogPipeline("default", str(logs), "UTC", store).read_once()
    assert second.lines == first.lines == {"control": 1071, "server": 935}  # read once from the logs, not doubled
    assert second.count("mps_server_starts_total") == first.count("mps_server_starts_total") == 10
    assert store.errors == {reason: 1}
    text = render(registry_snapshot(second, store))
    assert f'mps_exporter_state_file_errors_total{{reason="{reason}"}} 1.0' in text


def test_json_of_the_wrong_shape_and_a_directory_at_the_path_are_counted(tmp_path, capture_lines):
    logs, store_path, first = saved_run(tmp_path, capture_lines)
    store_path.write_text('["a", "list"]')
    store = StateStore(str(store_path))
    assert LogPipeline("default", str(logs), "UTC", store).read_once().lines == first.lines
    assert store.errors["shape"] == 1
    store_path.unlink()
    store_path.mkdir()  # what a hostPath mount of a missing file makes
    store = StateStore(str(store_path))
    assert LogPipeline("default", str(logs), "UTC", store).read_once().lines == first.lines
    assert store.errors == {"unreadable": 1, "save_failed": 1}


def test_the_state_file_flag_takes_a_directory_and_counts_instead_of_refusing(tmp_path):
    from mps_exporter.cli import parse_args

    _, cfg = parse_args(["--mps.state-file", str(tmp_path)])
    assert cfg.state_file == str(tmp_path)


def registry_snapshot(snap, store):
    from mps_exporter.families import FamilyBuilder
    from mps_exporter.logs.render import render_state_file_errors

    out = FamilyBuilder()
    render_state_file_errors(out, [snap])
    return out


def render(out) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    class One:
        def collect(self):
            return out.families()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())
    return generate_latest(registry).decode()


def test_a_backlogs_batches_are_applied_with_the_collector_paused(tmp_path, monkeypatch):
    """A batch of PAUSE_GC_CHARACTERS or more is applied with the cyclic GC off, a small one
    with it on; it is on again after each, also where applying raised, and left off where
    it was off before."""
    import gc

    from mps_exporter.logs import pipeline as pipeline_mod

    line = "[2026-11-21 04:19:24.640 Server   654] Server has started"
    many = pipeline_mod.PAUSE_GC_CHARACTERS // len(line) + 5
    (tmp_path / "server.log").write_text((line + "\n") * many)
    seen: List[Tuple[int, bool]] = []
    apply = pipeline_mod.apply_server_text

    def spy(state, text, tz, on_error):  # type: ignore[no-untyped-def]
        seen.append((text.count("\n"), gc.isenabled()))
        return apply(state, text, tz, on_error)

    monkeypatch.setattr(pipeline_mod, "apply_server_text", spy)
    assert gc.isenabled()
    pipe = LogPipeline("default", str(tmp_path), timezone="UTC")
    assert pipe.read_once().lines["server"] == many
    assert seen == [(many, False)] and gc.isenabled()
    append(tmp_path / "server.log", [line])
    assert pipe.read_once().lines["server"] == many + 1
    assert seen[-1] == (1, True) and gc.isenabled()

    def broken(state, text, tz, on_error):  # type: ignore[no-untyped-def]
        seen.append((text.count("\n"), gc.isenabled()))
        raise RuntimeError("a bug")

    monkeypatch.setattr(pipeline_mod, "apply_server_text", broken)
    with pytest.raises(RuntimeError):
        LogPipeline("default", str(tmp_path), timezone="UTC").read_once()
    assert seen[-1] == (many + 1, False) and gc.isenabled()
    gc.disable()
    try:
        monkeypatch.setattr(pipeline_mod, "apply_server_text", spy)
        LogPipeline("default", str(tmp_path), timezone="UTC").read_once()
        assert seen[-1][1] is False and not gc.isenabled()
    finally:
        gc.enable()
