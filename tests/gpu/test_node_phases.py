"""The pieces of issue 38's truth-check phases and churn.py that need no GPU (they run in CI)."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import churn  # noqa: E402
import multi_gpu_phase  # noqa: E402
import node_phases  # noqa: E402
from report import Report  # noqa: E402
from scrape import Exposition  # noqa: E402

GiB = 2**30


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    monkeypatch.setattr(node_phases, "SETTLE", 0.0)


def test_every_new_phase_refuses_one_gpu_with_a_failed_check_that_says_why():
    assert set(node_phases.PHASES) == {"starts", "cvdlimits", "killdaemon", "ceiling", "procdisc"}
    for name, phase in node_phases.PHASES.items():
        if name == "procdisc":  # one GPU is enough for it
            continue
        report = Report("one GPU")
        ran = []
        tc = SimpleNamespace(s=SimpleNamespace(gpus=1), r=report, phase=ran.append)
        phase(tc)  # returns at the guard: no daemon, client or exporter started
        assert ran == [name] and not report.passed
        (check,) = report.checks
        assert "two or more GPUs" in check.note and "has 1" in check.note, check


def test_run_x2_names_only_phases_the_truth_check_knows():
    import truth_check
    text = (HERE / "run_x2.sh").read_text()
    lists = re.findall(r"--phases \$\{PHASES:-([a-z0-9,]+)\}", text)
    assert lists == ["starts,cvdlimits,killdaemon,ceiling,quit", "remapped,percap,daemonpergpu,storm2,quit"]
    known = {*node_phases.PHASES, *multi_gpu_phase.PHASES,
             *(n[len("phase_"):] for n in dir(truth_check.TruthCheck) if n.startswith("phase_"))}
    for names in lists:
        assert set(names.split(",")) <= known
    assert subprocess.run(["bash", "-n", str(HERE / "run_x2.sh")]).returncode == 0


def test_run_x4_names_only_phases_the_truth_check_knows():
    import truth_check
    text = (HERE / "run_x4.sh").read_text()
    lists = re.findall(r"--phases \$\{PHASES:-([a-z0-9,]+)\}", text)
    assert lists == ["starts,cvdlimits,storm2,quit"]
    known = {*node_phases.PHASES, *multi_gpu_phase.PHASES,
             *(n[len("phase_"):] for n in dir(truth_check.TruthCheck) if n.startswith("phase_"))}
    assert set(lists[0].split(",")) <= known
    assert subprocess.run(["bash", "-n", str(HERE / "run_x4.sh")]).returncode == 0


def test_cvdlimits_runs_on_gpu_1_of_two_and_on_gpus_2_and_3_of_four():
    assert node_phases.cvd_targets(2) == [("index", 1), ("uuid", 1)]
    assert node_phases.cvd_targets(4) == [("index", 2), ("uuid", 3)]
    assert node_phases.cvd_targets(8) == [("index", 2), ("uuid", 7)]


# ------------------------------------------------------------------ starts
def test_a_death_is_an_exit_before_the_stop_with_its_signal_and_stderr():
    runs = [{"start": 0, "rc": None, "stop_rc": 0, "ok": 48, "failed": 2, "first_ok": 0.9},
            {"start": 1, "rc": -11, "ok": 3, "failed": 0, "first_ok": 1.1,
             "stderr_tail": ["Fatal Python error: Segmentation fault", 'File "nvml.py", line 3']},
            {"start": 2, "rc": None, "stop_rc": -15, "ok": 0, "failed": 50, "first_ok": None}]
    summary = node_phases.start_summary(runs)
    assert summary["deaths"] == [{"start": 1, "rc": -11, "signal": "SIGSEGV",
                                  "stderr_tail": runs[1]["stderr_tail"]}]
    assert summary["scrapes_200"] == 51 and summary["scrapes_other"] == 52
    assert summary["never_answered"] == [2] and summary["first_200_seconds"] == [0.9, 1.1]
    assert node_phases.start_summary([{"start": 0, "rc": 1, "ok": 0}])["deaths"][0]["signal"] is None


def test_tail_lines_keeps_the_last_forty():
    assert node_phases.tail_lines("\n".join(str(i) for i in range(100))) == [str(i) for i in range(60, 100)]


# ------------------------------------------------------------------ killdaemon
def test_gone_after_is_the_first_scrape_from_which_on_the_daemon_stayed_gone():
    samples = [{"t": 0.05, "status": 200, "servers": ["9"], "clients": ["10"]},
               {"t": 0.3, "status": 200, "servers": [], "clients": []},
               {"t": 0.5, "status": 200, "servers": [], "clients": ["10"]},  # back: not gone yet
               {"t": 0.7, "status": "URLError", "servers": [], "clients": []},  # unanswered: no evidence
               {"t": 0.9, "status": 200, "servers": [], "clients": []},
               {"t": 1.1, "status": 200, "servers": [], "clients": []}]
    assert node_phases.gone_after(samples) == 0.9
    assert node_phases.gone_after(samples[:1]) is None


# ------------------------------------------------------------------ ceiling and the client limit
def test_refusal_lines_of_both_kinds_after_an_offset():
    log = ("[2026-11-28 10:00:00.000 Other 7] Failed to accept new client. Maximum number of clients (48) reached.\n"
           "[2026-11-28 10:00:01.000 Other 7] Client 5 connected\n"
           "[2026-11-28 10:00:02.000 Other 7] Failed to accept new client. Reached maximum number of device "
           "connections.\n")
    assert len(node_phases.refusal_lines(log)) == 2
    assert node_phases.refusal_lines(log, log.index("[2026-11-28 10:00:01"))[0].endswith("device connections.")


def test_client_limit_whatever_its_labels():
    per_daemon = Exposition('mps_server_client_limit{daemon="default"} 48\n')
    assert multi_gpu_phase.client_limit(per_daemon) == 48 and multi_gpu_phase.client_limit(per_daemon, 7) == 48
    per_server = Exposition('mps_server_client_limit{daemon="default",server_pid="7"} 15\n'
                            'mps_server_client_limit{daemon="default",server_pid="8"} 48\n')
    assert multi_gpu_phase.client_limit(per_server, 7) == 15 and multi_gpu_phase.client_limit(per_server, 8) == 48
    assert multi_gpu_phase.client_limit(per_server) is None  # two servers disagree, none named
    assert multi_gpu_phase.client_limit(Exposition("")) is None


def _ceiling_run(tmp_path, admitted: int, limit_text: str) -> Report:
    report = Report("two GPUs")
    made = []

    def client(tag, mem, device=0, n=2048, idle=False, env=None):
        c = SimpleNamespace(tag=tag, pid=1000 + len(made), env=env, text=lambda: "busy or unavailable",
                            is_ready=lambda i=len(made): i < admitted)
        made.append(c)
        return c

    log = tmp_path / "server.log"
    log.write_text("[2026-11-28 09:00:00.000 Other 3] Failed to accept new client. Maximum number of clients (48) "
                   "reached.\n")  # an earlier phase's: before the offset

    def wait_ready(cs, timeout):  # MPS admits `admitted` (ACTIVE) and refuses the clients past them
        with open(log, "a") as f:
            f.writelines(f"[2026-11-28 10:00:01.000 Server 7] Status of client {{PID: {c.pid}, Context ID: 1}} "
                         "is ACTIVE\n" for c in cs if c.is_ready())
            f.write("[2026-11-28 10:00:02.000 Server 7] Failed to accept new client. Reached maximum number of "
                    "device connections.\n" * (len(cs) - admitted))
        return [c for c in cs if not c.is_ready()]

    s = SimpleNamespace(
        gpus=2, logdir=tmp_path, client=client, stop=lambda cs: None, shutdown_servers=lambda: None,
        wait_ready=wait_ready,
        client_lists=lambda: {7: [c.pid for c in made if c.is_ready()]},
        smi_apps=lambda: {("GPU-0", c.pid): 300 for c in made if c.is_ready()},
        smi_gpus=lambda: [SimpleNamespace(uuid="GPU-0"), SimpleNamespace(uuid="GPU-1")])
    tc = SimpleNamespace(s=s, r=report, phase=lambda name: None, scrape=lambda: Exposition(limit_text))
    node_phases.PHASES["ceiling"](tc)
    assert all(c.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" for c in made) and len(made) == 20
    return report


def test_ceiling_passes_when_the_limit_is_the_number_admitted(tmp_path):
    report = _ceiling_run(tmp_path, 15, 'mps_server_client_limit{daemon="default",server_pid="7"} 15\n')
    assert report.passed, [c for c in report.checks if not c.passed]


def test_ceiling_fails_on_a_stale_limit_or_when_mps_admitted_all(tmp_path):
    failed = [c.name for c in _ceiling_run(tmp_path, 15, 'mps_server_client_limit{daemon="default"} 48\n').checks
              if not c.passed]
    assert len(failed) == 1 and "mps_server_client_limit" in failed[0]
    failed = [c.name for c in _ceiling_run(tmp_path, 20, 'mps_server_client_limit{daemon="default"} 20\n').checks
              if not c.passed]
    assert failed == ["ceiling: MPS refused some of 20 (device connections)",
                      "ceiling: server.log says 'Reached maximum number of device connections'"]


# ------------------------------------------------------------------ cvdlimits
def test_limits_seen_and_by_gpu_read_the_physical_gpu_label():
    e = Exposition('mps_default_pinned_memory_limit_bytes{daemon="nvidia.com/mps-gpu1",gpu="1"} 3221225472\n'
                   'mps_client_pinned_memory_limit_bytes{daemon="nvidia.com/mps-gpu1",pid="5",gpu="1"} 2147483648\n')
    want = {"mps_default_pinned_memory_limit_bytes": {"1": 3 * GiB},
            "mps_client_pinned_memory_limit_bytes:5": {"1": 2 * GiB}}
    assert node_phases._limits_seen(e, "nvidia.com/mps-gpu1", want)
    assert not node_phases._limits_seen(e, "nvidia.com/mps-gpu0", want)
    assert not node_phases._limits_seen(e, "nvidia.com/mps-gpu1", {**want, "mps_client_pinned_memory_limit_bytes:5":
                                                                    {"0": 2 * GiB}})
    assert node_phases.by_gpu(e, "mps_client_pinned_memory_limit_bytes", pid="5") == {"1": 2 * GiB}


def test_control_daemon_pids_finds_none_for_a_pipe_nobody_uses(tmp_path):
    assert node_phases.control_daemon_pids(tmp_path / "pipe") == []


# ------------------------------------------------------------------ storm2
def test_storm_verdict_ours_at_or_below_theirs():
    ours = {"p99_seconds": 0.04, "cpu_seconds_per_scrape": 0.03}
    assert multi_gpu_phase.storm_verdict(ours, {"p99_seconds": 0.04, "cpu_seconds_per_scrape": 0.05}) == \
        {"p99_seconds": True, "cpu_seconds_per_scrape": True}
    assert multi_gpu_phase.storm_verdict(ours, {"p99_seconds": 0.03}) == \
        {"p99_seconds": False, "cpu_seconds_per_scrape": False}


# ------------------------------------------------------------------ churn.py
def test_churn_scrape_summary_and_verdict():
    scrapes = [{"t": i, "ms": float(i + 1), "status": 200} for i in range(100)] + \
              [{"t": 100, "ms": 10000.0, "status": "URLError(refused)"}]
    summary = churn.scrape_summary(scrapes)
    assert summary == {"scrapes_ok": 100, "scrapes_failed": 1, "p50_ms": 51.0, "p99_ms": 99.0, "max_ms": 100.0}
    result = {"exporter_deaths": [], "scrapes": summary, "clients_started": 500}
    assert churn.verdict(result)["passed"] is False  # one failed scrape
    result["scrapes"] = {**summary, "scrapes_failed": 0}
    assert churn.verdict(result) == {"exporter_deaths": 0, "scrapes_ok": 100, "scrapes_failed": 0,
                                     "clients_started": 500, "passed": True}
    assert churn.scrape_summary([])["p99_ms"] is None


def test_churn_death_record():
    d = churn.death(-6, "\n".join(f"line {i}" for i in range(50)), 12.34)
    assert d["rc"] == -6 and d["signal"] == "SIGABRT" and d["at_seconds"] == 12.3
    assert d["stderr_tail"][0] == "line 10" and len(d["stderr_tail"]) == 40
    assert churn.death(1, "", 0)["signal"] is None


def test_churn_picks_a_gpu_with_room_and_plans_within_bounds():
    rng = random.Random(1)
    assert churn.pick_gpu(rng, {0: 20, 1: 20}, 20) is None
    assert {churn.pick_gpu(rng, {0: 20, 1: 3}, 20) for _ in range(20)} == {1}
    assert {churn.pick_gpu(rng, {0: 0, 1: 0}, 20) for _ in range(50)} == {0, 1}
    plans = [churn.client_plan(rng) for _ in range(200)]
    assert all(0.25 <= p["mem_gib"] <= 1.0 and 5 <= p["hold_seconds"] <= 30 for p in plans)
    assert 20 < sum(p["busy"] for p in plans) < 90
