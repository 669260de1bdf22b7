"""Capture and replay (exporter/capture.py, replay.py, bundle.py).

The golden comparison records a scripted session on the recorded scenario
fakes (tests/support/scenarios.py), keeps the exposition live collection
produced at each reading, replays the bundle and compares, masking only the
collectors' durations. Time is stepped by hand (no sleeps) except in the tests
that run the real commands, which are bounded by a deadline.
"""

from __future__ import annotations

import dataclasses
import gzip
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import List, Tuple

import pytest
from prometheus_client.exposition import generate_latest

from mps_exporter import replay as replay_mod
from mps_exporter.bundle import VERSION, BundleError, BundleWriter, load
from mps_exporter.capture import LOG_FILES, LogTap, Recorder, capture, concrete_timezone, header
from mps_exporter.cli import parse_args
from mps_exporter.codec import encode
from mps_exporter.config import Config
from mps_exporter.model import GpuReading, NvmlReading
from mps_exporter.render import render
from mps_exporter.wiring import build_collector, build_readers
from mps_exporter.replay import Player, replay, replay_config
from mps_exporter.sources.registry import SOURCES
from tests.fakes.fake_pynvml import NVML_ERROR_GPU_IS_LOST, NVML_ERROR_UNKNOWN
from tests.support import scenarios
from tests.support.prometheus import free_port

REPO = Path(__file__).resolve().parents[1]
START = 1795234886.0  # 2026-11-21 04:21:26 UTC: the captured daemon's start, as the fake clock's zero
STEP = 5.0


class ManualClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def exposition(snap) -> str:
    families = render(snap).families()
    return generate_latest(SimpleNamespace(collect=lambda: families)).decode()


def masked(text: str) -> str:
    """Timings, and what depends on the history of collections rather than on the moment."""
    text = re.sub(r"^(mps_exporter_collector_duration_seconds\{[^}]*\}) \S+$", r"\1 <duration>", text, flags=re.M)
    return re.sub(r"^mps_exporter_collector_(read_duration_seconds|last_success_timestamp_seconds)\S* \S+\n", "",
                  text, flags=re.M)


def pieces(data: bytes, n: int) -> List[bytes]:
    """n consecutive pieces cut at arbitrary byte offsets (mid-line on purpose)."""
    cuts = [len(data) * k // n for k in range(n + 1)]
    return [data[a:b] for a, b in zip(cuts, cuts[1:])]


# ---------------------------------------------------------------- the session
def record_session(tmp: Path) -> Tuple[Path, List[str], dict]:
    """Capture six readings of the busy scenario while it changes; returns the bundle,
    the live expositions and the full log bytes."""
    scen = scenarios.busy(tmp)
    log_dir = tmp / "mps-logs"
    log_dir.mkdir()
    scen.cfg.daemons[0].log_directory = str(log_dir)
    scen.cfg.collectors["logs"] = True
    full = {f: (scenarios.CAPTURE / f).read_bytes() for f in ("control.log", "server.log")}
    parts = {f: pieces(data, 4) for f, data in full.items()}
    gpu, daemon = scen.nvml.gpus[0], scen.daemon

    def append(file: str, i: int) -> None:
        with open(log_dir / file, "ab") as f:
            f.write(parts[file][i])

    def leave(pid: int) -> None:
        daemon.clients = [c for c in daemon.clients if c.pid != pid]
        gpu.mps_processes = [p for p in gpu.mps_processes if p.pid != pid]
        gpu.compute_processes = [p for p in gpu.compute_processes if p.pid != pid]

    def rotate_control() -> None:
        os.rename(log_dir / "control.log", log_dir / "control.log.1")
        append("control.log", 2)

    steps = [
        lambda: (setattr(daemon, "running", False), append("control.log", 0), append("server.log", 0)),
        lambda: (setattr(daemon, "running", True), append("control.log", 1), append("server.log", 1)),
        lambda: (rotate_control(), append("server.log", 2), leave(1649)),
        lambda: (gpu.errors.__setitem__("*", NVML_ERROR_GPU_IS_LOST), append("server.log", 3)),
        lambda: (gpu.errors.clear(), scen.nvml.errors.__setitem__("nvmlSystemGetDriverVersion", NVML_ERROR_UNKNOWN),
                 append("control.log", 3)),
        lambda: (scen.nvml.errors.clear(), setattr(daemon, "running", False)),
    ]
    clock = ManualClock()
    readers = build_readers(scen.cfg, scen.backends())
    path = tmp / "session.jsonl.gz"
    writer = BundleWriter(str(path), header(scen.cfg, readers, START))
    rec = Recorder(scen.cfg, readers, writer, clock=lambda: START + clock.now, monotonic=clock)
    live = []
    for i, step in enumerate(steps):
        clock.now = i * STEP
        step()
        rec.poll_logs()
        readers["logs"].catch_up()
        live.append(exposition(rec.scrape()))
        scen.nvml.advance(STEP)
    writer.close(rec.end_record())
    return path, live, full


def play(bundle_path: Path, log_root: Path, speed: float = 1.0, loop: bool = False, present=None):
    """A Player with a manual clock, and the real collector and log pipelines over it."""
    bundle = load(str(bundle_path))
    mono = ManualClock()
    player = Player(bundle, str(log_root), speed=speed, loop=loop, monotonic=mono, present=present)
    cfg = replay_config(Config(), bundle, player.log_dirs)
    readers = player.readers_with(build_readers(cfg, player.backends(), recorded=False))
    collector = build_collector(cfg, readers, clock=player.clock)

    def at(monotonic: float) -> str:
        mono.now = monotonic
        player.feed()
        readers["logs"].catch_up()
        return exposition(collector.snapshot())

    return bundle, player, at


def test_replay_reproduces_live_exposition_at_every_recorded_moment(tmp_path):
    path, live, full = record_session(tmp_path)
    bundle, _, at = play(path, tmp_path / "replay")
    assert [s.t for s in bundle.scrapes] == [i * STEP for i in range(6)]
    replayed = [at(s.t) for s in bundle.scrapes]
    for i, (want, got) in enumerate(zip(live, replayed)):
        assert masked(got) == masked(want), f"reading {i} differs"

    # The comparison covers what changed during the session, failures included.
    assert len({masked(t) for t in live}) == 6
    assert 'mps_control_daemon_up{daemon="default"} 0.0' in live[0]
    assert 'pid="1649"' in live[1] and 'pid="1649"' not in live[2]
    assert re.search(r'^mps_gpu_up\{[^}]*\} 0\.0$', live[3], re.M)
    assert 'mps_exporter_collector_success{collector="nvml"} 0.0' in live[4]
    assert 'mps_exporter_collector_success{collector="nvml"} 1.0' in live[5]
    # Every byte of both logs went through the bundle, across the rotation, and every line
    # counts once: the rotation came after piece 2 of 4 of control.log, and a line that
    # straddles it waits in the rotated file for its rest (it counted twice before issue 42).
    for file, data in full.items():
        name = file.split(".")[0]
        lines = float(data.count(b"\n"))
        assert f'mps_log_lines_total{{daemon="default",file="{name}"}} {lines}' in replayed[-1]
    rotated = tmp_path / "replay" / "0"
    assert (rotated / "control.log.1").read_bytes() + (rotated / "control.log").read_bytes() == full["control.log"]
    assert (rotated / "server.log").read_bytes() == full["server.log"]


def test_bundle_records_metadata_and_source_errors(tmp_path):
    path, _, full = record_session(tmp_path)
    bundle = load(str(path))
    # Every enabled source but the logs, whose bytes the bundle carries instead of readings.
    cfg = scenarios.busy(tmp_path / "cfg").cfg
    recorded = [name for name, source in SOURCES.items() if source.recorded and source.enabled(cfg)]
    assert bundle.header["version"] == VERSION and bundle.header["sources"] == recorded
    assert "logs" not in recorded and {"control", "nvml", "proc"} <= set(recorded)
    assert bundle.header["log_timezone"] == "UTC"
    assert bundle.end["driver_version"] == "580.159.04"
    assert [g["uuid"] for g in bundle.end["gpus"]] == ["GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"]
    assert bundle.end["log_bytes"] == sum(len(d) for d in full.values())
    assert [c.new_file for c in bundle.logs].count(True) == 1  # the rotation
    nvml_error = bundle.scrapes[4].results["nvml"]
    assert "NvmlUnavailable" in str(nvml_error) and "Unknown Error" in str(nvml_error) or "999" in str(nvml_error)
    # Environment values are reduced to the MPS variables before they reach the bundle.
    facts = bundle.scrapes[1].results["proc"][1648]
    assert facts.environ == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4G",
                             "CUDA_MPS_CLIENT_PRIORITY": "1"}
    raw = gzip.decompress(path.read_bytes()).decode()
    assert "do-not-export" not in raw and '"PATH"' not in raw


# ---------------------------------------------------------------- speed, loop
LINES_A = (b"[2026-11-21 04:19:21.161 Control   546] Starting control daemon using socket /tmp/mps/pipe/control\n"
           b"[2026-11-21 04:19:21.161 Control   546] CUDA MPS Control binary version: 13000\n")
LINES_B = b"[2026-11-21 04:19:22.177 Control   546] Accepting connection...\n"


def small_bundle(path: Path) -> Path:
    """Readings at t=0, 10, 20 (driver "d0".."d2"), log chunks at t=0 and 15, end at 30."""
    cfg = Config()
    cfg.collectors.update(dcgm=False, control=False, proc=False)
    from mps_exporter.config import DaemonConfig

    cfg.daemons = [DaemonConfig("default", "/p", "/l")]
    cfg.log_timezone = "UTC"
    writer = BundleWriter(str(path), header(cfg, {"nvml": None}, START))
    writer.write({"kind": "log", "t": 0.0, "daemon": "default", "file": "control.log", "text": LINES_A.decode()})
    for i in range(3):
        writer.write({"kind": "scrape", "t": 10.0 * i, "now": START + 10.0 * i + 0.25,
                      "sources": {"nvml": {"value": encode(NvmlReading(f"d{i}", [GpuReading(0, "GPU-x", True)]))}}})
        if i == 1:
            writer.write({"kind": "log", "t": 15.0, "daemon": "default", "file": "control.log",
                          "text": LINES_B.decode()})
    writer.close({"t": 30.0})
    return path


def driver(text: str) -> str:
    return re.search(r'driver_version="([^"]*)"', text).group(1)


def control_lines(text: str) -> float:
    found = re.search(r'^mps_log_lines_total\{daemon="default",file="control"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else -1.0


def test_speed_scales_the_timeline(tmp_path):
    _, player, at = play(small_bundle(tmp_path / "b.jsonl.gz"), tmp_path / "r", speed=4.0)
    assert driver(at(2.4)) == "d0"  # 2.4 s x 4 = 9.6 s into the bundle
    assert driver(at(2.5)) == "d1"
    assert control_lines(at(3.7)) == 2  # 14.8 s: the second chunk (t=15) is not due yet
    assert control_lines(at(3.75)) == 3
    assert player.clock() == START + 10.25 + 5.0  # recorded time of t=10, plus 5 bundle seconds


def test_without_loop_the_last_moment_stays(tmp_path):
    _, player, at = play(small_bundle(tmp_path / "b.jsonl.gz"), tmp_path / "r")
    text = at(95.0)
    assert driver(text) == "d2" and control_lines(text) == 3
    assert player.clock() == START + 20.25 + 75.0  # time goes on; nothing else happens
    assert sorted(os.listdir(tmp_path / "r" / "0")) == ["control.log"]


def test_loop_starts_over_and_logs_are_rotated(tmp_path):
    _, player, at = play(small_bundle(tmp_path / "b.jsonl.gz"), tmp_path / "r", loop=True)
    assert control_lines(at(29.0)) == 3
    text = at(35.0)  # lap 2, 5 s in
    assert driver(text) == "d0" and player.lap == 1
    assert player.clock() == START + 0.25 + 5.0  # the recorded times repeat
    assert control_lines(text) == 3 + 2  # the follower read the old file to its end, then the new one
    log_dir = tmp_path / "r" / "0"
    assert (log_dir / "control.log.1").read_bytes() == LINES_A + LINES_B
    assert (log_dir / "control.log").read_bytes() == LINES_A
    assert control_lines(at(76.0)) == 3 + 3 + 3  # lap 3, past t=15


# ---------------------------------------------------------------- the present clock
TEN_DAYS = 10 * 86400.0
TIMES = ("mps_exporter_collector_last_success_timestamp_seconds", "mps_server_start_time_seconds",
         "mps_client_start_time_seconds", "mps_log_last_line_timestamp_seconds")


def samples(text: str) -> dict:
    """name{labels} -> value, the collectors' timings left out."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "duration_seconds" not in line:
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_replay_serves_each_scrape_the_control_answer_of_its_own_moment(tmp_path):
    """The flags' 10 ms control wait is for a live daemon: a replay waits for the recorded
    answer, or a loaded machine serves a scrape the previous moment's servers and clients."""
    path, _, _ = record_session(tmp_path)
    bundle = load(str(path))
    cfg = replay_config(parse_args(["replay", str(path)])[1], bundle, Player(bundle, str(tmp_path / "l")).log_dirs)
    assert Config().control_wait > 0 and cfg.control_wait == 0.0
    assert build_collector(cfg, {}).control_wait == 0.0


def test_replay_on_the_present_clock_moves_every_recorded_time(tmp_path):
    """Issue 43: replay served the recording's own clock, so the readings looked days stale."""
    path, _, _ = record_session(tmp_path)
    bundle, _, plain = play(path, tmp_path / "plain")
    present = START + TEN_DAYS + 0.5  # the recording started at START (t=0)
    _, player, moved = play(path, tmp_path / "moved", present=present)
    shifted_names = set()
    for s in bundle.scrapes:
        want, got = samples(plain(s.t + 1.0)), samples(moved(s.t + 1.0))
        assert got.keys() == want.keys()
        for key, value in want.items():
            name = key.split("{")[0]
            if name in TIMES and value:
                shifted_names.add(name)
                assert got[key] == pytest.approx(value + TEN_DAYS + 0.5, abs=1e-3), key
            else:  # ages, counts and queue waits: as recorded (the log lines were rewritten whole)
                assert got[key] == value, key
    assert shifted_names == set(TIMES)
    assert player.clock() == pytest.approx(present + bundle.scrapes[-1].t + 1.0, abs=1e-3)


def test_replayed_process_start_times_move_and_the_bundle_keeps_its_own(tmp_path):
    path, _, _ = record_session(tmp_path)
    bundle = load(str(path))
    player = Player(bundle, str(tmp_path / "r"), monotonic=lambda: 5.0, present=START + TEN_DAYS)
    player.clock()
    recorded = {pid: f.start_time_seconds for pid, f in SOURCES["proc"].replay(bundle.scrapes[1].results["proc"]).items()}
    assert any(recorded.values())
    for _ in range(2):  # played again: moved once, never twice
        moved = {pid: f.start_time_seconds for pid, f in player.result("proc").items()}
        assert moved == {pid: t + TEN_DAYS if t is not None else None for pid, t in recorded.items()}


def test_a_new_lap_moves_the_times_on_by_the_bundle_duration(tmp_path):
    present = START + 0.25 + TEN_DAYS  # t=0 was recorded at START + 0.25: times move by ten days
    _, player, at = play(small_bundle(tmp_path / "b.jsonl.gz"), tmp_path / "r", loop=True, present=present)
    at(5.0)
    assert player.clock() == pytest.approx(present + 5.0)
    text = at(35.0)  # lap 2, 5 s in: time goes on
    assert player.clock() == pytest.approx(present + 30.0 + 5.0)
    log_dir = tmp_path / "r" / "0"
    first_lap = (log_dir / "control.log.1").read_bytes()
    second_lap = (log_dir / "control.log").read_bytes()
    assert first_lap == (LINES_A + LINES_B).replace(b"2026-11-21 04:19:2", b"2026-12-01 04:19:2")
    assert second_lap == LINES_A.replace(b"2026-11-21 04:19:21", b"2026-12-01 04:19:51")
    assert samples(text)['mps_log_last_line_timestamp_seconds{daemon="default",file="control"}'] == \
        pytest.approx(1795235961.161 + TEN_DAYS + 30.0)  # 2026-11-21 04:19:21.161 UTC, moved


def test_a_line_a_chunk_cuts_is_moved_whole(tmp_path):
    """Chunks end mid-line (the capture reads as the daemon writes): the cut line's time is
    rewritten once the rest has come, never left as recorded."""
    path = small_bundle(tmp_path / "b.jsonl.gz")
    bundle = load(str(path))
    cut = LINES_A.index(b":19:") + 2  # inside the first line's time
    head, tail = bundle.logs[0], bundle.logs[1]
    bundle.logs[:2] = [dataclasses.replace(head, data=LINES_A[:cut]),
                       dataclasses.replace(head, t=5.0, data=LINES_A[cut:]), tail]
    mono = ManualClock()
    player = Player(bundle, str(tmp_path / "r"), monotonic=mono, present=START + 0.25 + TEN_DAYS)
    control = tmp_path / "r" / "0" / "control.log"
    player.feed()
    assert control.read_bytes() == b""  # not yet: the line's time is not whole
    mono.now = 31.0
    player.feed()
    assert control.read_bytes() == (LINES_A + LINES_B).replace(b"2026-11-21", b"2026-12-01")


def test_replay_landing_page_names_the_session_and_says_it_is_a_replay(tmp_path):
    path = small_bundle(tmp_path / "recorded-h100.jsonl.gz")
    port = free_port()
    cfg = parse_args(["replay", str(path), "--web.listen-address", f"127.0.0.1:{port}"])[1]
    stop, ready = threading.Event(), threading.Event()
    present = START + 0.25 + TEN_DAYS
    server = threading.Thread(target=replay, args=(cfg, stop, ready), kwargs={"wall_clock": lambda: present},
                              daemon=True)
    server.start()
    try:
        assert ready.wait(20)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/")
        landing = conn.getresponse().read().decode()
        conn.close()
        text = scrape(port)
    finally:
        stop.set()
        server.join(20)
    assert "Replay, not a live node" in landing and "recorded-h100.jsonl.gz" in landing
    assert "2026-11-21 04:21 UTC" in landing  # when it was recorded
    last = samples(text)['mps_exporter_collector_last_success_timestamp_seconds{collector="nvml"}']
    assert present <= last < present + 60  # the present, not START: this scrape came within a minute


# ---------------------------------------------------------------- bad bundles
def rewrite(src: Path, dst: Path, edit) -> Path:
    lines = gzip.decompress(src.read_bytes()).decode().splitlines(keepends=True)
    dst.write_bytes(gzip.compress("".join(edit(lines)).encode()))
    return dst


def bad_bundles(tmp: Path) -> dict:
    good = small_bundle(tmp / "good.jsonl.gz")
    data = good.read_bytes()
    (tmp / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    (tmp / "plain.txt").write_text("hello\n")

    def version(lines):
        head = json.loads(lines[0])
        head["version"] = VERSION + 1
        return [json.dumps(head) + "\n"] + lines[1:]

    def escape(lines):
        rec = json.loads(lines[1])
        rec["file"] = "../../outside.log"
        return [lines[0], json.dumps(rec) + "\n"] + lines[2:]

    return {
        "is truncated: the compressed stream ends early": tmp / "cut.jsonl.gz",
        "is truncated: it stops after line": rewrite(good, tmp / "noend.jsonl.gz", lambda l: l[:-1]),
        f"is capture format version {VERSION + 1}; this mps-exporter reads version {VERSION}":
            rewrite(good, tmp / "v2.jsonl.gz", version),
        "is not a capture bundle (not gzip-compressed)": tmp / "plain.txt",
        "is not an mps-exporter capture bundle": rewrite(good, tmp / "nohead.jsonl.gz", lambda l: l[1:]),
        "damaged: line 3 is not JSON": rewrite(good, tmp / "json.jsonl.gz", lambda l: l[:2] + ["{oops\n"] + l[2:]),
        "is not a plain file name": rewrite(good, tmp / "escape.jsonl.gz", escape),
        "no such file": tmp / "missing.jsonl.gz",
    }


def test_bad_bundles_give_one_clear_line_and_exit_2(tmp_path, capsys):
    for message, path in bad_bundles(tmp_path).items():
        with pytest.raises(BundleError, match=re.escape(message)):
            load(str(path))
        cfg = parse_args(["replay", str(path), "--web.listen-address", f"127.0.0.1:{free_port()}"])[1]
        assert replay(cfg) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mps-exporter: error: ") and message in err, err
    assert not (tmp_path / "outside.log").exists()


def test_no_shipped_bundle_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(replay_mod, "DATA_DIR", tmp_path / "empty")
    assert replay(parse_args(["replay"])[1]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no recorded session is shipped" in err


def test_no_argument_plays_the_shipped_bundle_in_a_loop(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    small_bundle(data / "session.jsonl.gz")
    monkeypatch.setattr(replay_mod, "DATA_DIR", data)
    port = free_port()
    cfg = parse_args(["replay", "--speed", "20", "--web.listen-address", f"127.0.0.1:{port}"])[1]
    stop, ready = threading.Event(), threading.Event()
    server = threading.Thread(target=replay, args=(cfg, stop, ready), daemon=True)
    server.start()
    seen = []  # drivers d0, d1, d2 in turn, every 0.5 s; then d0 again
    try:
        assert ready.wait(20)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and seen[-2:] != ["d2", "d0"]:
            d = driver(scrape(port))
            if not seen or seen[-1] != d:
                seen.append(d)
            time.sleep(0.05)
    finally:
        stop.set()
        server.join(20)
    assert seen[-2:] == ["d2", "d0"], seen


def test_shipped_bundle_is_a_real_gpu_session_with_servers_and_clients(tmp_path):
    path = Path(replay_mod.shipped_bundle())
    assert path.stat().st_size <= 2 << 20
    bundle, _, at = play(path, tmp_path)
    assert bundle.end["driver_version"] and bundle.end["gpus"]  # NVML answered: recorded on a GPU
    seen = set()
    for s in bundle.scrapes:
        text = at(s.t)
        seen |= {name for name in ("mps_server_info", "mps_client_info", "mps_client_memory_used_bytes")
                 if re.search(rf"^{name}\{{", text, re.M)}
        if re.search(r'^mps_queued_clients\{[^}]*\} [1-9]', text, re.M):
            seen.add("queued")
        if re.search(r'^mps_server_status\{[^}]*status="FAULT"[^}]*\} 1', text, re.M):
            seen.add("fault")
        # issue 16 point 5: what the earlier session never showed
        seen |= {name for name in ("mps_default_pinned_memory_limit_bytes", "mps_server_pinned_memory_limit_bytes",
                                   "mps_process_sm_utilization_ratio", "mps_client_priority", "mps_server_client_limit")
                 if re.search(rf"^{name}\{{", text, re.M)}
        if re.search(r'^mps_gpu_sharing_mode\{[^}]*mode="time_slicing"[^}]*\} 1', text, re.M):
            seen.add("time_slicing")
        for counter in ("mps_client_rejections_total", "mps_server_exits_with_clients_total"):
            if re.search(rf'^{counter}\{{[^}}]*\}} [1-9]', text, re.M):
                seen.add(counter)
    assert seen == {"mps_server_info", "mps_client_info", "mps_client_memory_used_bytes", "queued", "fault",
                    "mps_default_pinned_memory_limit_bytes", "mps_server_pinned_memory_limit_bytes",
                    "mps_process_sm_utilization_ratio", "mps_client_priority", "mps_server_client_limit",
                    "time_slicing", "mps_client_rejections_total", "mps_server_exits_with_clients_total"}


def test_replay_flags_are_checked():
    cmd = [sys.executable, "-m", "mps_exporter.cli", "replay", "x.jsonl.gz", "--speed", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.strip() == "mps-exporter: error: --speed must be positive, not 0.0"


# ---------------------------------------------------------------- log tap
def test_log_tap_reads_appends_rotation_and_truncation(tmp_path):
    path = tmp_path / "control.log"
    tap = LogTap(str(path))
    assert tap.poll() == []  # not there yet
    path.write_bytes(b"one\ntw")
    assert tap.poll() == [(False, b"one\ntw")]
    with open(path, "ab") as f:
        f.write(b"o\n")
    assert tap.poll() == [(False, b"o\n")]
    with open(path, "ab") as f:  # written just before the rename: still read from the old file
        f.write(b"three\n")
    os.rename(path, tmp_path / "control.log.1")
    path.write_bytes(b"four\n")
    assert tap.poll() == [(False, b"three\n"), (True, b"four\n")]
    path.write_bytes(b"")  # copytruncate
    assert tap.poll() == [(True, b"")]
    with open(path, "ab") as f:
        f.write(b"five\n")
    assert tap.poll() == [(False, b"five\n")]
    tap.close()


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_log_tap_never_opens_a_fifo_or_a_device(tmp_path, target):
    path = tmp_path / "control.log"
    if target == "fifo":
        os.mkfifo(path)  # open() would block: the capture would hang
    else:
        os.symlink(target, path)  # read() would never end
    tap = LogTap(str(path))
    assert tap.poll() == [] and tap._file is None
    path.unlink()
    path.write_bytes(b"back\n")
    assert tap.poll() == [(False, b"back\n")]
    tap.close()


@pytest.mark.parametrize("keep, expected", [(7, b"cccc\n"), (10, b"bbbb\ncccc\n"), (0, b""), (99, b"aaaa\nbbbb\ncccc\n")])
def test_log_tap_keeps_the_end_of_old_history_from_a_line_start(tmp_path, keep, expected):
    path = tmp_path / "control.log"
    path.write_bytes(b"aaaa\nbbbb\ncccc\n")
    tap = LogTap(str(path), history_bytes=keep)
    assert tap.poll() == ([(False, expected)] if expected else [])
    assert tap.skipped == 15 - len(expected)
    with open(path, "ab") as f:  # growth is always taken in full
        f.write(b"dddd\n" * 4)
    assert tap.poll() == [(False, b"dddd\n" * 4)]
    tap.close()


def test_log_history_flag():
    assert parse_args(["capture", "--out", "x", "--log-history", "512K"])[1].capture.log_history_bytes == 512 << 10
    res = subprocess.run([sys.executable, "-m", "mps_exporter.cli", "capture", "--out", "x", "--log-history", "lots"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--log-history: not a size" in res.stderr


def test_log_time_zone_is_recorded_by_name_and_used_by_replay(tmp_path, monkeypatch):
    assert concrete_timezone("Asia/Tokyo") == "Asia/Tokyo"  # given by flag: kept
    monkeypatch.setenv("TZ", "Europe/Berlin")
    assert concrete_timezone("local") == "Europe/Berlin"
    monkeypatch.setenv("TZ", ":Etc/UTC")
    assert concrete_timezone("local") == "UTC"  # replays without a time zone database

    def zone(lines):
        head = json.loads(lines[0])
        head["log_timezone"] = "Europe/Berlin"
        return [json.dumps(head) + "\n"] + lines[1:]

    bundle = load(str(rewrite(small_bundle(tmp_path / "b.jsonl.gz"), tmp_path / "berlin.jsonl.gz", zone)))
    assert replay_config(Config(), bundle, {"default": str(tmp_path)}).log_timezone == "Europe/Berlin"


# ---------------------------------------------------------------- commands
def scrape(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_capture_command_on_recorded_sources_makes_a_bundle_that_replays(tmp_path):
    scen = scenarios.busy(tmp_path, logs=False)
    scen.cfg.capture.out = str(tmp_path)  # a directory: the bundle gets a dated name in it
    scen.cfg.capture.duration_seconds, scen.cfg.capture.interval_seconds = 0.6, 0.2
    assert capture(scen.cfg, readers=build_readers(scen.cfg, scen.backends(), recorded=True)) == 0
    (path,) = tmp_path.glob("mps-capture-*.jsonl.gz")
    bundle = load(str(path))
    assert len(bundle.scrapes) >= 2 and not list(tmp_path.glob("*.partial"))

    port = free_port()
    cfg = parse_args(["replay", str(path), "--web.listen-address", f"127.0.0.1:{port}", "--loop"])[1]
    stop, ready = threading.Event(), threading.Event()
    result = []
    server = threading.Thread(target=lambda: result.append(replay(cfg, stop, ready)), daemon=True)
    server.start()
    try:
        assert ready.wait(20), "replay did not start serving"
        text = scrape(port)
    finally:
        stop.set()
        server.join(20)
    assert result == [0]
    assert 'mps_server_info{' in text and 'server_pid="1589"' in text
    assert len(re.findall(r"^mps_client_info\{", text, re.M)) == 3
    assert 'mps_exporter_collector_success{collector="control"} 1.0' in text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_capture_cli_runs_without_yaml_and_bcrypt(tmp_path):
    """What the GPU machine has: no PyYAML, no bcrypt; here also no driver and no MPS."""
    out = tmp_path / "b.jsonl.gz"
    # The node's sources alone: one a contributor adds (tests/test_example_source.py) may answer.
    others = [f"--no-collector.{name}" for name, spec in SOURCES.items()
              if spec.default is True and name not in ("control", "nvml", "logs", "proc")]
    code = ("import sys; sys.modules['yaml'] = sys.modules['bcrypt'] = None\n"
            "from mps_exporter.cli import main\n"
            f"sys.exit(main(['capture', '--out', {str(out)!r}, '--duration', '0.3', '--interval', '0.1',"
            f" '--mps.control-binary', {str(tmp_path / 'no-such-control')!r},"
            f" '--mps.log-directory', {str(tmp_path / 'logs')!r}, *{others!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # Nothing answered (no control binary, no NVML, no log directory): the bundle is written
    # with their errors, the summary names them, and the exit code says so.
    assert res.returncode == 1, res.stderr
    assert res.stdout.strip() == str(out)
    assert re.search(r"capture summary: never answered: control, nvml, logs", res.stderr), res.stderr
    assert f"logs of daemon default, control.log: log directory {tmp_path / 'logs'} does not exist" in res.stderr
    bundle = load(str(out))
    assert bundle.header["sources"][:1] == ["control"] and len(bundle.scrapes) >= 2
    assert bundle.scrapes[0].results["control"][0].error  # the missing binary, recorded as the daemon's error
    assert {(e.file, e.reason, e.error) for e in bundle.log_errors} == {
        (f, "missing_directory", f"log directory {tmp_path / 'logs'} does not exist") for f in LOG_FILES}
    # The bundle replays the failure: the logs are not "ok" with totals of 0.
    res = subprocess.run([sys.executable, "-m", "mps_exporter.cli", "status", "--bundle", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert re.search(r"^sources: control FAILED, logs FAILED, nvml FAILED, proc ok$", res.stdout, re.M), res.stdout
    assert f"! logs failed: default: log directory {tmp_path / 'logs'} does not exist" in res.stdout
    assert "  totals from the logs:" not in res.stdout


def test_capture_summary_names_the_silent_sources_and_exits_0_when_one_answered(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "control.log").write_bytes(LINES_A)
    out = tmp_path / "b.jsonl.gz"
    res = subprocess.run([sys.executable, "-m", "mps_exporter.cli", "capture", "--out", str(out), "--duration", "0.3",
                          "--interval", "0.1", "--mps.control-binary", str(tmp_path / "no-such-control"),
                          "--mps.log-directory", str(logs), "--no-collector.dcgm"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert re.search(r"capture summary: nvml: 0 of \d+ readings answered \(last error: NvmlUnavailable", res.stderr)
    assert "capture summary: never answered: control, nvml, xid\"" in res.stderr and "logs of daemon" not in res.stderr
    assert load(str(out)).log_errors == []


def test_replay_command_serves_until_terminated(tmp_path):
    path = small_bundle(tmp_path / "b.jsonl.gz")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mps_exporter.cli", "replay", str(path), "--speed", "20",
                             "--web.listen-address", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The log follower polls apart from the readings: wait for both to reach t=20.
        deadline, text = time.monotonic() + 30, ""
        while time.monotonic() < deadline and not ('driver_version="d2"' in text and control_lines(text) == 3):
            try:
                text = scrape(port)
            except OSError:
                pass
            time.sleep(0.1)
        assert 'driver_version="d2"' in text  # 20 bundle seconds went by
        assert control_lines(text) == 3
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err


def test_capture_keeps_a_failing_sources_error_in_every_reading(tmp_path):
    """Issue 43: control, not read again while its last reading is fresh, had its error in
    the bundle's first reading only; the others said nothing of it, and a replay of them
    failed with "not read at this moment" instead of the recorded error."""
    logs = tmp_path / "logs"
    logs.mkdir()
    out = tmp_path / "b.jsonl.gz"
    res = subprocess.run([sys.executable, "-m", "mps_exporter.cli", "capture", "--out", str(out), "--duration", "1",
                          "--interval", "0.1", "--mps.control-binary", str(tmp_path / "no-such-control"),
                          "--mps.log-directory", str(logs), "--no-collector.dcgm"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    with gzip.open(out, "rt") as f:
        scrapes = [r for r in map(json.loads, f) if r["kind"] == "scrape"]
    assert len(scrapes) >= 5
    for r in scrapes:
        (daemon,) = r["sources"]["control"]
        assert "no-such-control not found" in daemon["value"]["error"], r["sources"]["control"]
        assert "NvmlUnavailable" in r["sources"]["nvml"]["error"]
