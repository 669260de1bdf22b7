"""The truth check's own parts, on the recorded capture (no GPU needed).

Numbers are derived from the capture's files by hand (comments say how), so a
wrong oracle fails here before it can pass or fail a comparison on the GPU.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import oracles  # noqa: E402
from report import Report  # noqa: E402
from scrape import Exposition  # noqa: E402

from tests.fakes.fake_control import CAPTURE, FakeControlDaemon  # noqa: E402
from tests.fakes.fake_pynvml import FakeNvml  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "busy.prom"


def control_log():
    return oracles.parse_log((CAPTURE / "control.log").read_text())


def server_log():
    return oracles.parse_log((CAPTURE / "server.log").read_text())


def test_smi_apps_from_the_busy_capture():
    # nvidia-smi-busy.txt's csv block, re-shaped to the gpu_uuid,pid,used_memory nounits query
    text = ("GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70, 1589, 66\n"
            "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70, 1647, 9000\n"
            "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70, 1649, [N/A]\n")
    apps = oracles.parse_smi_apps(text)
    assert apps == {("GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70", 1589): 66,
                    ("GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70", 1647): 9000}
    assert oracles.parse_smi_apps("No running processes found\n") == {}


def test_smi_gpus():
    [g] = oracles.parse_smi_gpus("0, GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70, 143771, 13621\n")
    assert (g.index, g.memory_total_mib, g.memory_used_mib) == (0, 143771, 13621)


def test_queue_waits_of_the_capture():
    waits = oracles.queue_waits(control_log())
    by_pid = {w.client_pid: w for w in waits}
    # control.log:180 push 04:19:56.944, :216 "Server already exists" 04:20:09.929
    w = by_pid[897]
    assert w.user == 1500 and w.user_switch
    assert w.seconds == pytest.approx(12.985, abs=1e-6)
    # control.log:30 push 04:19:24.390 with no server at all, admitted at :47 04:19:24.709
    first = by_pid[586]
    assert not first.user_switch and first.seconds == pytest.approx(0.319, abs=1e-6)
    # README: the run-2 uid-1500 client arrived 04:22:16.630, server 2521 ready 04:22:29.578
    run2 = [w for w in waits if w.user == 1500 and w.pushed >= datetime(2026, 11, 21, 4, 22)]
    assert run2 and run2[0].pushed == datetime(2026, 11, 21, 4, 22, 16, 630000)
    assert run2[0].user_switch and 12.9 < run2[0].seconds < 13.1


def test_fatal_errors_connections_and_exits_of_the_capture():
    srv = server_log()
    # one "encountered a fatal GPU error" line (server.log:906); "Worker is in reset" is not one
    assert oracles.fatal_error_reports(srv) == 1
    pids = oracles.connected_client_pids(srv)
    assert {2755, 2777, 1647, 1648, 1649} <= pids
    exits = oracles.server_exit_statuses(control_log())
    assert set(exits) == {"0"} and exits["0"] >= 8  # every server of the two runs exited cleanly


def test_command_counts_match_cmd_lines():
    counts = oracles.command_counts(control_log())
    text = (CAPTURE / "control.log").read_text()
    assert sum(counts.values()) == text.count("] Cmd:")
    assert counts["set_default_device_pinned_mem_limit"] == 4  # 2G and 0, in each run
    assert counts["quit"] == 2


@pytest.mark.parametrize("text,expected", [("2G", 2 * 2**30), ("512M", 512 * 2**20), ("0x80000000", 2**31),
                                           ("", None), ("1.5G", 3 * 2**29), ("junk", None)])
def test_size_text(text, expected):
    assert oracles.parse_size_text(text) == expected


def test_env_pinned_limit():
    assert oracles.env_pinned_limit("0=3G,1=1G", 1) == 2**30
    assert oracles.env_pinned_limit("0=3G", 1) is None


def test_percentile_nearest_rank():
    values = list(range(1, 101))
    assert oracles.percentile(values, 50) == 50 and oracles.percentile(values, 99) == 99
    assert oracles.percentile([7.0], 99) == 7.0


def test_exposition_lookup_on_the_golden_file():
    e = Exposition(GOLDEN.read_text().replace("<duration>", "0.001").replace("<time>", "1.0"))  # placeholders of the golden file
    clients = e.label_set("mps_client_info", "pid")
    assert len(clients) == len(e.series("mps_client_memory_used_bytes"))
    assert e.value("mps_control_daemon_up", daemon="default") == 1
    assert e.value("mps_no_such_metric") is None


def test_report_records_failures_and_tolerance(tmp_path):
    r = Report("t")
    r.phase = "p"
    assert r.check("within", 100.0, 100.9, tolerance=1.0)
    assert not r.check("outside", 100.0, 101.5, tolerance=1.0)
    assert not r.check("missing", 1, None)
    assert r.check_true("bound", 5, 3, 3 <= 5)
    assert not r.passed
    md = r.to_markdown()
    assert "2 of 4 comparisons passed" in md and "| p | outside |" in md


def test_raw_cost_runs_the_exporters_calls_against_fakes():
    import rawcost

    daemon = FakeControlDaemon.busy_capture()
    raw = rawcost.RawScrape("/tmp/pipe", "/tmp/log", 60.0, nvml_module=FakeNvml.from_capture("busy"), runner=daemon)
    first = raw.once()
    second = raw.once()
    assert first["nvml_calls"] > 5 and first["control_calls"] >= 3
    # per-server limits and defaults are cached: the second scrape sends fewer commands
    assert second["control_calls"] < first["control_calls"]
    assert second["total"] == pytest.approx(second["nvml"] + second["control"])
