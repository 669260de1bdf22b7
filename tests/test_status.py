"""`mps-exporter status` (exporter/status/): the report on the shipped recorded session,
its JSON against the /metrics values of the same instant, a failing source, and the
flags. The watch screen in a real terminal is tests/test_status_watch.py."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from mps_exporter.bundle import load
from mps_exporter.cli import parse_args
from mps_exporter.collector import build_registry
from mps_exporter.replay import shipped_bundle
from mps_exporter.status import command
from mps_exporter.sources.registry import SOURCES
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import scenarios
from tests.support.data import CAPTURE
from tests.support.shipped import Moments, moments, replayed

Sample = Tuple[str, Dict[str, str], float]


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mps_exporter.cli", "status", *args],
                          capture_output=True, text=True, timeout=120)


def status_json(at: float) -> dict:
    res = status("--bundle", shipped_bundle(), "--at", str(at), "--output", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def metrics_at(at: float, tmp: Path) -> List[Sample]:
    """What /metrics publishes at `at` seconds into the shipped session: the exposition of
    the exporter's registry over the replayed sources at that moment."""
    with replayed(str(tmp)) as (_, collector_at):
        text = generate_latest(build_registry(collector_at(at))).decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


class Metrics:
    def __init__(self, samples: List[Sample]) -> None:
        self.samples = samples

    def rows(self, name: str, **labels: str) -> List[Tuple[Dict[str, str], float]]:
        return [(lab, v) for n, lab, v in self.samples if n == name and all(lab.get(k) == w for k, w in labels.items())]

    def one(self, name: str, **labels: str):
        rows = self.rows(name, **labels)
        assert len(rows) <= 1, (name, labels, rows)
        return rows[0][1] if rows else None

    def labels(self, name: str, **labels: str) -> Dict[str, str]:
        rows = self.rows(name, **labels)
        assert len(rows) == 1, (name, labels, rows)
        return rows[0][0]

    def by_gpu(self, name: str, **labels: str) -> Dict[str, float]:
        return {lab["gpu"]: v for lab, v in self.rows(name, **labels)}


def report_at(at: float) -> Tuple[str, dict]:
    res = status("--bundle", shipped_bundle(), "--at", str(at))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    return res.stdout, status_json(at)


# ---------------------------------------------------------------- the report
def test_report_at_a_moment_with_a_queued_client():
    at = moments().queued
    out, st = report_at(at)
    duration = load(shipped_bundle()).duration
    assert out.startswith(f"mps-exporter status: bundle {os.path.basename(shipped_bundle())} at {at:.1f} s of {duration:.1f} s\n")
    assert "sources: control ok, logs ok, nvml ok, proc ok" in out
    for g in st["gpus"]:
        assert re.search(rf"^GPU {g['index']}  {re.escape(g['name'])}  {g['uuid']}$", out, re.M)
        assert re.search(rf"^  sharing {g['sharing_mode']} \| memory [\d.]+ [GM]iB of [\d.]+ GiB ", out, re.M)
    (d,) = st["daemons"]
    for s in d["servers"]:  # the server the queued client waits behind, with its clients
        assert re.search(rf"^  {s['pid']} +{re.escape(s['user'])} \({s['uid']}\) +{s['status']} +{s['clients']} ", out, re.M), out
    for c in d["clients"]:
        assert re.search(rf"^  {c['pid']} +{c['server_pid']} +{re.escape(c['user'])} \({c['uid']}\) .* {re.escape(c['command'])}$",
                         out, re.M), out
    (q,) = d["queued"]
    assert q["reason"] == "user_switch" and q["uid"] not in {s["uid"] for s in d["servers"]}
    row = re.search(rf"^  QUEUED +UID +REASON +WAITING +SINCE\n  {q['pid']} +{q['uid']} +user_switch +([\d.]+) s +", out, re.M)
    assert row and float(row.group(1)) == round(q["waiting_seconds"], 1) > 0, out
    assert not any(e["kind"] == "fatal_gpu_error" for e in d["events"]) and "fatal GPU error  server" not in out


def test_report_at_the_fatal_gpu_error():
    fault_at, fatal_at = moments().fault, moments().fatal
    out, st = report_at(fault_at)  # the daemon says FAULT
    (faulty,) = [s for s in st["daemons"][0]["servers"] if s["status"] == "FAULT"]
    assert re.search(rf"^  {faulty['pid']} +\S+ \(\d+\) +FAULT ", out, re.M), out
    out, st = report_at(fatal_at)  # the server's log has reported the error
    (d,) = st["daemons"]
    fatal = [e for e in d["events"] if e["kind"] == "fatal_gpu_error"]
    assert len(fatal) == 1 and fatal[0]["server_pid"] == faulty["pid"] and fatal[0]["clients"]
    line = (rf"^  \S+ \S+  fatal GPU error  server {faulty['pid']}, clients with a sticky error: "
            rf"{' '.join(map(str, fatal[0]['clients']))}  \([\d.]+ s ago\)$")
    assert re.search(line, out, re.M), out
    totals = re.sub(r"\s+", " ", out[out.index("totals from the logs:"):])  # wrapped at 100 columns
    assert "fatal GPU errors 1," in totals


def test_report_at_the_end_lists_refusals_and_a_server_that_died_under_its_clients():
    out, st = report_at(moments().end)
    (d,) = st["daemons"]
    refused = [e for e in d["events"] if e["kind"] == "client_rejected"]
    died = [e for e in d["events"] if e["kind"] == "exit_with_clients"]
    assert refused and died
    for e in refused:
        assert re.search(rf"^  \S+ \S+  client refused   server {e['server_pid']} refused client {e['clients'][0]}: "
                         rf"{re.escape(e['detail'])}  \(", out, re.M), out
    for e in died:
        assert re.search(rf"^  \S+ \S+  server died      server {e['server_pid']} exited with clients still connected: "
                         rf"{' '.join(map(str, e['clients']))}  \(", out, re.M), out
    assert f"  clients per device: at most {d['client_limit']} (as the last refusal said)\n" in out
    totals = re.sub(r"\s+", " ", out[out.index("totals from the logs:"):])
    assert f"refused clients {len(refused)} (reason client_limit: {len(refused)})," in totals
    assert f"servers exited with clients {len(died)}," in totals


def test_default_moment_is_the_end_of_the_recording():
    res = status("--bundle", shipped_bundle())
    duration = load(shipped_bundle()).duration
    assert res.returncode == 0, res.stderr
    assert f"at {duration:.1f} s of {duration:.1f} s" in res.stdout and "MPS daemon default: DOWN" in res.stdout
    assert "fatal GPU error  server " in res.stdout  # the events stay after the daemon quit


def test_readme_samples_are_what_status_prints():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## On the node: `mps-exporter status`\n", 1)[1].split("\n## ", 1)[0]
    bundle, queued_at = re.search(r"`mps-exporter status --bundle exporter/data/(\S+) --at ([\d.]+)`", section).groups()
    fault_at = re.search(r"\(`--at ([\d.]+)`, from the server table on\)", section).group(1)
    queued, fault, end = re.findall(r"^```\n(.*?)^```$", section, re.S | re.M)
    regenerate = (f"README's status samples are stale: paste the output of `mps-exporter status --bundle "
                  f"exporter/data/{os.path.basename(shipped_bundle())} --at T` at a moment with a queued client "
                  f"and at the fatal error (e.g. T = {moments().queued} and {moments().fatal}), naming those T, "
                  f"and at its end (no --at), each from the part of the report shown")
    assert bundle == os.path.basename(shipped_bundle()), regenerate
    assert queued == status("--bundle", shipped_bundle(), "--at", queued_at).stdout, regenerate
    at_fault = status("--bundle", shipped_bundle(), "--at", fault_at).stdout
    assert fault == at_fault[at_fault.index("  SERVER"):], regenerate
    at_end = status("--bundle", shipped_bundle()).stdout
    assert end == at_end[at_end.index("  EVENTS"):], regenerate
    assert "  QUEUED " in queued and " FAULT " in fault and "fatal GPU error" in fault, regenerate
    assert "client refused" in end and "server died" in end, regenerate


# ---------------------------------------------------------------- status and /metrics agree
@pytest.mark.parametrize("moment", Moments._fields)
def test_json_is_what_metrics_publishes_at_the_same_instant(moment, tmp_path):
    at = getattr(moments(), moment)
    st = status_json(at)
    m = Metrics(metrics_at(at, tmp_path))

    assert {s["name"]: s["ok"] for s in st["sources"]} == {
        lab["collector"]: bool(v) for lab, v in m.rows("mps_exporter_collector_success")}
    assert [g["index"] for g in st["gpus"]] == [int(lab["gpu"]) for lab, _ in m.rows("mps_gpu_up")] == [0]
    for g in st["gpus"]:
        sel = {"gpu": str(g["index"]), "uuid": g["uuid"]}
        info = m.labels("mps_gpu_info", **sel)
        assert (g["name"], g["driver_version"], g["compute_mode"], g["mig_mode"]) == (
            info["name"], info["driver_version"], info["compute_mode"], info["mig_mode"])
        assert g["up"] == bool(m.one("mps_gpu_up", **sel))
        assert g["sharing_mode"] == m.labels("mps_gpu_sharing_mode", **sel)["mode"]
        for key in ("memory_used_bytes", "memory_total_bytes", "utilization_ratio", "memory_utilization_ratio",
                    "sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio", "dram_active_ratio",
                    "power_watts", "temperature_celsius"):
            assert g[key] == m.one(f"mps_gpu_{key}", **sel), key
        assert g["compute_processes"] == m.one("mps_gpu_compute_processes", **sel)

    (d,) = st["daemons"]
    sel = {"daemon": d["name"]}
    info = m.labels("mps_control_daemon_info", **sel)
    assert (d["up"], d["version"], d["pipe_directory"], d["log_directory"]) == (
        bool(m.one("mps_control_daemon_up", **sel)), info["version"], info["pipe_directory"], info["log_directory"])
    assert d["default_active_thread_ratio"] == m.one("mps_default_active_thread_ratio", **sel)
    assert d["default_pinned_memory_limit_bytes"] == m.by_gpu("mps_default_pinned_memory_limit_bytes", **sel)

    assert sorted(s["pid"] for s in d["servers"]) == sorted(int(lab["server_pid"]) for lab, _ in m.rows("mps_server_info"))
    for s in d["servers"]:
        ssel = {**sel, "server_pid": str(s["pid"])}
        info = m.labels("mps_server_info", **ssel)
        assert (str(s["uid"]), s["user"]) == (info["uid"], info["user"])
        assert s["status"] == m.labels("mps_server_status", **ssel)["status"]
        assert s["clients"] == m.one("mps_server_clients", **ssel)
        assert s["active_thread_ratio"] == m.one("mps_server_active_thread_ratio", **ssel)
        assert s["pinned_memory_limit_bytes"] == m.by_gpu("mps_server_pinned_memory_limit_bytes", **ssel)
        assert s["memory_used_bytes"] == m.by_gpu("mps_server_memory_used_bytes", **ssel)
        assert s["start_time"] == m.one("mps_server_start_time_seconds", **ssel)

    assert sorted(c["pid"] for c in d["clients"]) == sorted(int(lab["pid"]) for lab, _ in m.rows("mps_client_info"))
    for c in d["clients"]:
        csel = {**sel, "pid": str(c["pid"])}
        info = m.labels("mps_client_info", **csel)
        assert (str(c["server_pid"]), str(c["uid"]), c["user"], c["command"], c["pid_namespace"], c["container_id"],
                c["pod_uid"]) == (info["server_pid"], info["uid"], info["user"], info["command"], info["pid_namespace"],
                                  info["container_id"], info["pod_uid"])
        assert c["memory_used_bytes"] == m.by_gpu("mps_client_memory_used_bytes", **csel) != {}
        assert c["pinned_memory_limit_bytes"] == m.by_gpu("mps_client_pinned_memory_limit_bytes", **csel)
        assert c["active_thread_ratio"] == m.one("mps_client_active_thread_ratio", **csel)
        assert c["priority"] == m.one("mps_client_priority", **csel)
        assert c["start_time"] == m.one("mps_client_start_time_seconds", **csel)

    # the queue: the counts and the oldest wait are the metrics; the list of who waits adds the PIDs
    assert d["queued_clients"] == {lab["reason"]: v for lab, v in m.rows("mps_queued_clients", **sel)}
    assert len(d["queued"]) == sum(d["queued_clients"].values())
    assert d["oldest_queued_wait_seconds"] == m.one("mps_queued_client_oldest_wait_seconds", **sel)
    assert d["client_limit"] == m.one("mps_server_client_limit", **sel)
    assert max((q["waiting_seconds"] for q in d["queued"]), default=0) == pytest.approx(d["oldest_queued_wait_seconds"])
    for c in d["counters"]:
        assert c["value"] == m.one(c["metric"], **sel, **c["labels"]), c
    counted = {(c["metric"], tuple(sorted(c["labels"].items()))) for c in d["counters"]}
    assert ("mps_fatal_gpu_errors_total", ()) in counted and ("mps_server_handoffs_total", ()) in counted
    # every event the counters saw is listed (the session has fewer than the 64 kept)
    kinds = [e["kind"] for e in d["events"]]
    assert kinds.count("fatal_gpu_error") == m.one("mps_fatal_gpu_errors_total", **sel)
    assert kinds.count("handoff") == m.one("mps_server_handoffs_total", **sel)
    assert kinds.count("client_rejected") == sum(v for _, v in m.rows("mps_client_rejections_total", **sel))
    assert kinds.count("exit_with_clients") == m.one("mps_server_exits_with_clients_total", **sel)

    if moment == "queued":
        assert [q["reason"] for q in d["queued"]] == ["user_switch"] and d["queued_clients"]["user_switch"] == 1
    elif moment == "fault":
        assert "FAULT" in [s["status"] for s in d["servers"]]
    elif moment == "fatal":
        assert d["events"][-1]["kind"] == "fatal_gpu_error" and d["events"][-1]["clients"]
    elif moment == "priority":
        assert any(c["priority"] is not None for c in d["clients"])
    else:  # the end: the session's refusals and its server killed under a client are among the events
        assert {"client_rejected", "exit_with_clients"} <= set(kinds) and d["client_limit"] is not None


# ---------------------------------------------------------------- a live node
def sources_line(failed: tuple = (), off: tuple = ()) -> str:
    """The report's sources line: every source on by default (the registry's; dcgm is
    "auto", and absent here) but those switched `off`, `failed` ones FAILED."""
    names = [name for name, source in SOURCES.items() if source.default is True and name not in off]
    return "sources: " + ", ".join(f"{n} {'FAILED' if n in failed else 'ok'}" for n in names)


def test_live_node_shows_each_client_with_its_pod_and_its_limit(tmp_path):
    # The busy capture over the library-boundary fakes: client 1648 runs in a pod and sets
    # its own limits (4 GiB, 25 % of the threads) in its environment.
    scen = scenarios.busy(tmp_path)
    out = io.StringIO()
    assert command.status(scen.cfg, out, scen.backends()) == 0
    text = out.getvalue()
    assert text.startswith("mps-exporter status: host ") and sources_line() in text
    assert re.search(r"^  1589 +root \(0\) +ACTIVE +3 +100% ", text, re.M), text
    # (and CUDA_MPS_CLIENT_PRIORITY=1: the PRIORITY column)
    # (named by containerd's spec: namespace/pod container)
    assert re.search(r"^  1648 +1589 +root \(0\) +ml-team/trainer-7d9c6b5f4-x2k8p trainer +2\.79 GiB / 4\.00 GiB "
                     r"\(70%\) +25% +1 +python3$", text, re.M), text
    # 1647 sets no priority: it runs at the daemon's default, 0
    assert re.search(r"^  1647 +1589 +root \(0\) +- +8\.79 GiB / no limit +100% +0 +python3$", text, re.M), text

    scen.cfg.status.output = "json"
    out = io.StringIO()
    assert command.status(scen.cfg, out, scen.backends()) == 0
    (client,) = [c for c in json.loads(out.getvalue())["daemons"][0]["clients"] if c["pid"] == 1648]
    assert (client["pod_uid"], client["container_id"]) == (scenarios.POD_UID, scenarios.CONTAINER_ID)
    assert (client["namespace"], client["pod"], client["container"]) == scenarios.POD_NAMES
    assert client["pinned_memory_limit_bytes"] == {"0": 4 << 30} and client["active_thread_ratio"] == 0.25
    assert client["memory_used_bytes"] == {"0": 2856 << 20}


# ---------------------------------------------------------------- failing sources
def test_failing_sources_show_as_such_and_the_rest_prints(tmp_path):
    # No NVML and no control binary on this machine's path; the logs are the recorded session's.
    res = status("--mps.control-binary", str(tmp_path / "no-such-binary"), "--mps.log-directory", str(CAPTURE),
                 "--mps.log-timezone", "UTC", "--no-collector.dcgm", "--path.procfs", str(tmp_path))
    assert res.returncode == 1, res.stderr  # a source failed: scripts must not read this as all well
    out = res.stdout
    assert re.search(rf"^{sources_line(failed=('control', 'nvml', 'xid'))}$", out, re.M), out
    assert re.search(r"^! control failed: default: .*no-such-binary", out, re.M), out
    assert re.search(r"^! nvml failed: ", out, re.M) and "GPUs: unknown: NVML failed" in out
    # Nobody could ask the daemon: not "DOWN", "no server", "no client" or "no limit".
    assert "MPS daemon default: unknown (its control source failed)" in out and "  defaults: unknown\n" in out
    assert "  servers and clients: unknown (the control source failed)\n" in out
    assert "no MPS server running" not in out and "no client connected" not in out
    # the logs still tell what happened, when
    totals = re.sub(r"\s+", " ", out[out.index("totals from the logs:"):])  # wrapped at 100 columns
    assert "refused clients 0, servers exited with clients 0, handoffs 4, shutdown deferrals 12, fatal GPU errors 1," \
        in totals, out
    assert re.search(r"^  2026-11-21 04:23:08\.506  fatal GPU error  server 2736, clients with a sticky error: 2755  ", out, re.M)
    assert res.stderr == ""  # the failures are in the report, not repeated as log lines

    res = status("--mps.control-binary", str(tmp_path / "no-such-binary"), "--no-collector.logs",
                 "--no-collector.dcgm", "--output", "json")
    st = json.loads(res.stdout)
    failed = {s["name"]: s["error"] for s in st["sources"] if not s["ok"]}
    assert set(failed) == {"control", "nvml", "xid"} and "no-such-binary" in failed["control"]
    assert st["gpus"] == [] and st["daemons"][0]["up"] is None
    assert st["daemons"][0]["servers"] is None and st["daemons"][0]["clients"] is None
    assert res.returncode == 1


def test_failed_logs_are_unknown_not_zero(tmp_path):
    # A log directory that is not there: no totals of 0, no "nobody queued".
    missing = tmp_path / "no-logs"
    res = status("--mps.control-binary", str(tmp_path / "no-such-binary"), "--mps.log-directory", str(missing),
                 "--no-collector.dcgm", "--no-collector.nvml", "--path.procfs", str(tmp_path))
    assert res.returncode == 1
    assert re.search(rf"^{sources_line(failed=('control', 'logs'), off=('nvml', 'xid'))}$", res.stdout, re.M), res.stdout
    assert f"  queue, events and totals from the logs: unknown (log directory {missing} does not exist)\n" \
        in res.stdout
    assert "  totals from the logs:" not in res.stdout and "refused clients 0" not in res.stdout
    st = json.loads(status("--mps.control-binary", str(tmp_path / "no-such-binary"), "--mps.log-directory",
                           str(missing), "--no-collector.dcgm", "--no-collector.nvml", "--output", "json").stdout)
    daemon = st["daemons"][0]
    assert (daemon["counters"], daemon["queued"], daemon["events"]) == (None, None, None)
    assert "does not exist" in daemon["log_error"]


def test_at_past_the_end_shows_the_end_with_its_clock():
    # --at 200 on a 114 s bundle: the last moment, and "ago" counted from it, not 86 s later.
    end = status("--bundle", shipped_bundle())
    past = status("--bundle", shipped_bundle(), "--at", "200")
    assert past.returncode == end.returncode == 0, past.stderr
    assert past.stdout == end.stdout


def test_status_exits_0_when_every_source_answered(tmp_path):
    # The recorded session 26 s in: every source ok.
    res = status("--bundle", shipped_bundle(), "--at", "26")
    assert res.returncode == 0 and "sources: control ok, logs ok, nvml ok, proc ok" in res.stdout, res.stderr


@pytest.mark.slow
def test_a_hung_source_shows_as_failed_after_a_scrape_s_wait(tmp_path):
    # A control program that never answers (as a wedged daemon): status waits as long as a
    # scrape would (--scrape.max-duration's default, 5 s), then prints what it has.
    hung = tmp_path / "nvidia-cuda-mps-control"
    hung.write_text("#!/bin/sh\nexec sleep 8\n")
    hung.chmod(0o755)
    res = status("--mps.control-binary", str(hung), "--mps.command-timeout", "10", "--no-collector.logs",
                 "--path.procfs", str(tmp_path))
    assert res.returncode == 1, res.stderr
    assert re.search(r"^! control failed: no answer within 5 s$", res.stdout, re.M), res.stdout
    assert sources_line(failed=("control", "nvml", "xid"), off=("logs",)) in res.stdout
    assert "MPS daemon default: unknown (its control source failed)" in res.stdout


# ---------------------------------------------------------------- flags
@pytest.mark.parametrize("args, message", [
    (["--at", "3"], "--at needs --bundle"),
    (["--bundle", "x.jsonl.gz", "--at", "-1"], "--at needs --bundle and is seconds into it"),
    (["--watch", "0"], "--watch must be positive"),
    (["--watch", "--output", "json"], "--watch shows the text report"),
])
def test_flag_errors_are_one_line(args, message):
    res = status(*args)
    assert res.returncode == 2 and res.stdout == "" and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr


def test_unreadable_bundle_is_one_line(tmp_path):
    res = status("--bundle", str(tmp_path / "missing.jsonl.gz"))
    assert res.returncode == 2 and res.stderr == f"mps-exporter: error: cannot read bundle {tmp_path}/missing.jsonl.gz: no such file\n"


def test_watch_takes_an_optional_interval():
    assert parse_args(["status", "--watch"])[1].status.watch == 2.0
    assert parse_args(["status", "--watch", "0.5", "--bundle", "b", "--at", "3"])[1].status.watch == 0.5
    assert parse_args(["status"])[1].status.watch is None


def test_a_process_outside_mps_is_an_alert_line_under_its_gpu(tmp_path):
    scen = scenarios.outside_mps(tmp_path)
    out = io.StringIO()
    assert command.status(scen.cfg, out, scen.backends()) == 0
    text = out.getvalue()
    assert "sharing mixed" in text, text
    assert re.search(r"^  ! process 6000 \(train\.py, user 1500\) runs outside MPS: 1\.37 GiB, no MPS limit binds it$",
                     text, re.M), text


def test_every_counter_status_lists_is_a_declared_log_counter():
    from mps_exporter.catalog import METRICS
    from mps_exporter.logs.render import LOG_METRICS, QUEUE_METRICS
    from mps_exporter.status.view import EVENT_COUNTERS

    log_counters = {spec.name for spec in (*LOG_METRICS, *QUEUE_METRICS) if spec.name.endswith("_total")}
    assert set(EVENT_COUNTERS) <= log_counters <= set(METRICS)
    assert "mps_control_accept_failures_total" in EVENT_COUNTERS  # found live on 4 x H200 (issue 45)
