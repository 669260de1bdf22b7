"""When the exporter sends control commands, through the whole collector: MPS echoes
each into control.log (tests/fakes/fake_control.py writes them the way driver 580
does) and never rotates it, so at a steady state a scrape sends `get_server_list`
alone; a client that arrives is still listed by the next scrape. Capture follows the
same rule with NVML alone (bench/control_log_bench.py measures the full-size node)."""

from __future__ import annotations

from pathlib import Path

from mps_exporter.bundle import BundleWriter
from mps_exporter.capture import Recorder, header
from mps_exporter.render import render
from mps_exporter.wiring import build_collector, build_readers
from tests.fakes.fake_control import FakeClient
from tests.fakes.fake_pynvml import FakeProcess
from tests.support import scenarios

NEW = 20000


def listed(snap) -> set:
    return {int(s.labels["pid"]) for f in render(snap).families() if f.name == "mps_client_info" for s in f.samples}


def exported_commands(snap) -> dict:
    return {s.labels["command"]: s.value for f in render(snap).families()
            if f.name == "mps_exporter_control_commands" for s in f.samples}


def arrive(sc: scenarios.Scenario, log_line: bool) -> None:
    if log_line:
        sc.daemon.echo(["Accepting connection...", f"NEW CLIENT {NEW} from user 0: Server already exists"])
    sc.daemon.clients.append(FakeClient(NEW, 4000, sc.nvml.gpus[1].uuid, 99))
    sc.nvml.gpus[1].mps_processes.append(FakeProcess(NEW, 1 << 30))


def with_logs(tmp_path: Path) -> scenarios.Scenario:
    sc = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "server.log").write_text("")
    sc.daemon.control_log = logs / "control.log"
    sc.daemon.echo(["Starting control daemon using socket /tmp/mps/pipe/control", "Starting new server 4000 for user 0",
                    "NEW SERVER 4000: Ready"])
    sc.cfg.daemons[0].log_directory = str(logs)
    sc.cfg.collectors["logs"] = True
    return sc


def test_steady_state_writes_one_command_per_scrape_and_an_arrival_shows_next(tmp_path):
    sc = with_logs(tmp_path)
    readers = build_readers(sc.cfg, sc.backends())
    collector = build_collector(sc.cfg, readers)

    def scrape():
        readers["logs"].catch_up()
        before = len(sc.daemon.received)
        snap = collector.snapshot()
        return [c.strip() for c in sc.daemon.received[before:]], snap

    first, snap = scrape()
    assert "ps" in first and len(listed(snap)) == 6
    assert scrape()[0] == ["get_server_list", "ps"]  # the confirming ps
    for _ in range(5):
        sent, snap = scrape()
        assert sent == ["get_server_list"] and len(listed(snap)) == 6
    lines = sc.daemon.log_lines
    scrape()
    assert sc.daemon.log_lines - lines == 5  # Accepting connection, NEW UI, Cmd:, the PID, UI closed
    assert exported_commands(snap)["get_server_list"] == 7 and exported_commands(snap)["ps"] == 2

    arrive(sc, log_line=True)
    sent, snap = scrape()
    assert "ps" in sent and NEW in listed(snap)
    readers["logs"].close()


def test_a_client_the_log_pipeline_has_not_read_yet_is_listed_too(tmp_path):
    """The pipeline polls every 0.25 s: a `NEW CLIENT` line it has not read yet (and that
    NVML does not show yet) must not leave the scrape with the last `ps`."""
    sc = with_logs(tmp_path)
    readers = build_readers(sc.cfg, sc.backends())
    collector = build_collector(sc.cfg, readers)
    for _ in range(3):
        readers["logs"].catch_up()
        collector.snapshot()
    sc.daemon.echo(["Accepting connection...", f"NEW CLIENT {NEW} from user 0: Server already exists"])
    sc.daemon.clients.append(FakeClient(NEW, 4000, sc.nvml.gpus[1].uuid, 99))  # not in NVML's list yet
    before = len(sc.daemon.received)
    snap = collector.snapshot()  # the pipeline has not read the line
    assert "ps\n" in sc.daemon.received[before:] and NEW in listed(snap)
    readers["logs"].catch_up()
    collector.snapshot()  # the line read: the logs moved, ps once more, then quiet
    readers["logs"].catch_up()
    before = len(sc.daemon.received)
    collector.snapshot()
    assert [c.strip() for c in sc.daemon.received[before:]] == ["get_server_list"]
    readers["logs"].close()


def test_capture_follows_the_same_rule_with_nvml_alone(tmp_path):
    sc = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3)
    readers = build_readers(sc.cfg, sc.backends(), recorded=True)  # what `capture` records: no logs
    writer = BundleWriter(str(tmp_path / "b.jsonl.gz"), header(sc.cfg, readers, 0.0))
    rec = Recorder(sc.cfg, readers, writer, clock=lambda: 0.0, monotonic=lambda: 0.0)

    def scrape():
        before = len(sc.daemon.received)
        snap = rec.scrape()
        return [c.strip() for c in sc.daemon.received[before:]], snap

    scrape(), scrape()
    for _ in range(3):  # without the logs a server's status is asked every time, ps is not
        assert scrape()[0] == ["get_server_list", "get_server_status 4000"]
    arrive(sc, log_line=False)
    sent, snap = scrape()
    assert "ps" in sent and NEW in listed(snap)
    writer.close(rec.end_record())
