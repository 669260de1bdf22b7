"""The pieces of issue 40's truth-check phases (oom_phase.py) that need no GPU (they run in CI)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import oom_phase  # noqa: E402
import oracles  # noqa: E402
from report import Report  # noqa: E402
from scrape import Exposition  # noqa: E402

GiB, MIB = 2**30, 2**20
H100_SMI = "0, GPU-0a1b2c3d-0000-0000-0000-000000000000, 81559, 0\n"
H200_SMI = "0, GPU-9f8e7d6c-0000-0000-0000-000000000000, 143771, 4\n"


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    for name, value in (("SETTLE", 0.0), ("LOG_SETTLE", 0.0), ("COUNT_WAIT", 0.3)):
        monkeypatch.setattr(oom_phase, name, value)


def test_the_phases_are_registered_with_the_truth_check_and_listed_with_their_command():
    import truth_check
    assert set(oom_phase.PHASES) == {"oomlimit", "oomfull", "nearclean", "xid"}
    known = {*oom_phase.PHASES, *(n[len("phase_"):] for n in dir(truth_check.TruthCheck) if n.startswith("phase_"))}
    readme = (HERE / "README.md").read_text()
    (phases,) = re.findall(r'run_device\.sh h100-oom "[^"]+" "" ([a-z,]+)', readme)
    assert phases == "oomlimit,oomfull,nearclean,xid,quit" and set(phases.split(",")) <= known
    assert "oom_phase.py" in readme


def test_gpu_client_knows_the_new_options_and_compiles():
    text = (HERE / "workloads" / "gpu_client.py").read_text()
    for flag in ("--exit-on-fail", "--grow-relative", "--fill-self-mib", "--fill-gpu-ratio"):
        assert f'"{flag}"' in text
    assert subprocess.run([sys.executable, "-m", "py_compile", str(HERE / "workloads" / "gpu_client.py")]).returncode == 0
    for tag, flags in (("oomlimit", ["--grow-relative", "--exit-on-fail", "--fill-self-mib"]),
                       ("oomfull", ["--fill-gpu-ratio"])):
        assert all(f in (HERE / "oom_phase.py").read_text() for f in flags), tag


# ------------------------------------------------------------------ sizing oomfull
@pytest.mark.parametrize("smi", [H100_SMI, H200_SMI])
def test_fillers_leave_room_for_contexts_and_the_top_up(smi):
    (g,) = oracles.parse_smi_gpus(smi)
    sizes = oom_phase.filler_sizes(g.memory_total_mib, g.memory_used_mib)
    assert len(sizes) == oom_phase.FILLERS and len(set(sizes)) == 1 and sizes[0] > 20
    planned = sum(sizes) * 1024 + g.memory_used_mib + (oom_phase.FILLERS + 2) * oom_phase.CONTEXT_MIB
    assert planned + oom_phase.TOPUP_MIB <= oom_phase.FULL_TARGET * g.memory_total_mib
    assert planned + oom_phase.TOPUP_MIB + 16 * oom_phase.FILLERS >= oom_phase.FULL_TARGET * g.memory_total_mib
    assert all((x * 64).is_integer() for x in sizes)  # whole 16 MiB


def test_no_fillers_where_there_is_no_room():
    assert oom_phase.filler_sizes(8192, 7000) == []
    assert oom_phase.filler_sizes(81559, 0, fillers=0) == []


@pytest.mark.parametrize("total", [81559, 143771, 24576])
def test_the_victim_asks_for_more_than_a_full_gpu_has_left(total):
    ask = oom_phase.victim_ask_gib(total)
    assert ask * 1024 > total * (1 - oom_phase.FULL_MIN)
    assert ask <= 6


# ------------------------------------------------------------------ counting
def _exits(rows):
    return Exposition("".join(f'mps_client_exits_at_memory_limit_total{{daemon="default",gpu="{g}",reason="{r}",'
                              f'outcome="{o}"}} {n}\n' for (g, r, o), n in rows.items()))


def test_count_deltas_names_only_the_rows_that_moved_and_counts_new_rows_from_zero():
    before = oom_phase.exit_counts(_exits({("0", "client_limit", "failed"): 2, ("0", "device_full", "clean"): 1}))
    after = oom_phase.exit_counts(_exits({("0", "client_limit", "failed"): 3, ("0", "device_full", "clean"): 1,
                                          ("1", "device_full", "failed"): 1}))
    assert oom_phase.count_deltas(before, after) == {"gpu=0 reason=client_limit outcome=failed": 1,
                                                     "gpu=1 reason=device_full outcome=failed": 1}
    assert oom_phase.count_deltas(after, after) == {}
    assert oom_phase.failed_only({"gpu=0 reason=device_full outcome=clean": 1}) == {}


def test_exit_counts_sum_over_daemons_and_outcomes_are_listed():
    e = Exposition('mps_client_exits_at_memory_limit_total{daemon="a",gpu="0",reason="client_limit",outcome="failed"} 1\n'
                   'mps_client_exits_at_memory_limit_total{daemon="b",gpu="0",reason="client_limit",outcome="failed"} 2\n'
                   'mps_client_exits_at_memory_limit_total{daemon="b",gpu="0",reason="client_limit",outcome="clean"} 0\n')
    assert oom_phase.exit_counts(e)[("0", "client_limit", "failed")] == 3
    assert oom_phase.outcomes(e) == ["clean", "failed"]


def test_near_limit_is_the_exporters_margin_rounded_up_to_a_byte():
    limit = 2 * GiB
    assert oom_phase.near_limit(limit * 0.95, limit)  # 95 % exactly: at the edge
    assert oom_phase.near_limit(limit, limit)
    assert not oom_phase.near_limit(limit * 0.949, limit)
    assert not oom_phase.near_limit(None, limit) and not oom_phase.near_limit(limit, None)


# ------------------------------------------------------------------ xid helpers
def test_clock_offset_is_zero_on_one_clock_and_a_time_zone_apart_otherwise():
    assert oom_phase.clock_offset(0.4) == 0 and oom_phase.clock_offset(-0.8) == 0
    assert oom_phase.clock_offset(3600.3) == 3600 and oom_phase.clock_offset(-19799.6) == -19800
    when = datetime(2026, 11, 30, 10, 0, 0)
    assert oom_phase.log_unix(when, 3600) == when.timestamp() - 3600


def test_xid_deltas_oracle_counts_and_dmesg():
    before = {("0", "31"): 1.0}
    after = oom_phase.xid_counts(Exposition('mps_gpu_xid_errors_total{gpu="0",uuid="GPU-a",xid="31"} 2\n'
                                            'mps_gpu_xid_errors_total{gpu="0",uuid="GPU-a",xid="43"} 1\n'
                                            'mps_gpu_xid_errors_total{gpu="1",uuid="GPU-b",xid="13"} 4\n'))
    assert oom_phase.xid_deltas(before, after) == {"0": {"31": 1, "43": 1}, "1": {"13": 4}}
    assert oom_phase.xid_deltas(after, after) == {}
    events = [{"t": 1.0, "gpu": 0, "xid": 31}, {"t": 1.1, "gpu": 0, "xid": 43}, {"t": 1.2, "gpu": 0, "xid": 31}]
    assert oom_phase.oracle_counts(events) == {"0": {"31": 2, "43": 1}}
    text = ("[ 12.3] NVRM: Xid (PCI:0000:18:00): 31, pid=4242, name=python3, Ch 00000008, intr 00000000. MMU Fault\n"
            "[ 12.4] NVRM: Xid (PCI:0000:18:00): 43, pid=4242, name=python3, Ch 00000008\n")
    assert oom_phase.dmesg_xids(text) == [("0000:18:00", 31), ("0000:18:00", 43)]
    assert {13, 31, 43} <= set(oom_phase.APPLICATION_XIDS) and 79 not in oom_phase.APPLICATION_XIDS


def _xid_run(exporter_text: str, events, log_time: datetime) -> Report:
    report = Report("xid")
    tc = SimpleNamespace(r=report)
    line = oracles.LogLine(log_time, "Server", 9, "Client {PID: 5, Context: 1} encountered a fatal GPU error.")
    oom_phase.xid_checks(tc, "0", Exposition(exporter_text), {}, 0.0, events, [line], 0.0)
    return report


def test_xid_checks_pass_when_the_exporter_agrees_with_the_oracle_and_the_log():
    at = datetime(2026, 11, 30, 10, 0, 0)
    text = (f'mps_gpu_xid_errors_total{{gpu="0",uuid="GPU-a",xid="31"}} 1\n'
            f'mps_gpu_xid_last_seen_timestamp_seconds{{gpu="0",uuid="GPU-a",xid="31"}} {at.timestamp() + 0.4}\n'
            'mps_fatal_gpu_errors_total{daemon="default"} 1\n')
    report = _xid_run(text, [{"t": at.timestamp() + 0.3, "gpu": 0, "xid": 31}], at)
    assert report.passed, [c for c in report.checks if not c.passed]


def test_xid_checks_fail_on_a_late_xid_a_missing_code_or_a_hardware_code():
    at = datetime(2026, 11, 30, 10, 0, 0)
    late = (f'mps_gpu_xid_errors_total{{gpu="0",uuid="GPU-a",xid="31"}} 1\n'
            f'mps_gpu_xid_last_seen_timestamp_seconds{{gpu="0",uuid="GPU-a",xid="31"}} {at.timestamp() + 30}\n'
            'mps_fatal_gpu_errors_total{daemon="default"} 1\n')
    failed = [c.name for c in _xid_run(late, [{"t": 0, "gpu": 0, "xid": 31}], at).checks if not c.passed]
    assert len(failed) == 1 and "within 10 s" in failed[0]
    missing = [c.name for c in _xid_run('mps_fatal_gpu_errors_total{daemon="default"} 1\n',
                                        [{"t": 0, "gpu": 0, "xid": 31}], at).checks if not c.passed]
    assert any("rose on GPU 0" in n for n in missing) and any("oracle" in n for n in missing)
    hw = (f'mps_gpu_xid_errors_total{{gpu="0",uuid="GPU-a",xid="79"}} 1\n'
          f'mps_gpu_xid_last_seen_timestamp_seconds{{gpu="0",uuid="GPU-a",xid="79"}} {at.timestamp()}\n'
          'mps_fatal_gpu_errors_total{daemon="default"} 1\n')
    failed = [c.name for c in _xid_run(hw, [{"t": 0, "gpu": 0, "xid": 79}], at).checks if not c.passed]
    assert failed == ["xid: every code is one of NVIDIA's application Xids"]


# ------------------------------------------------------------------ oomlimit on a fake session
class FakeProc:
    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            raise subprocess.TimeoutExpired("client", timeout)
        return self.returncode

    def kill(self):
        self.returncode = -9


class FakeMps:
    """A GPU, MPS and an exporter in one: clients hold memory, the exporter's exit tracker
    counts a client that leaves at the edge (`count` says how: the real rule, or a bug)."""

    def __init__(self, tmp_path: Path, count: str = "right", fill_reached: float = 1966.0):
        self.tmp, self.count, self.fill_reached = tmp_path, count, fill_reached
        self.clients, self.live, self.counts = [], {}, {}
        self.report = Report("one GPU")

    def client(self, tag, mem, device=0, env=None, uid=0, n=2048, idle=False, grow=None, mps=True, extra=None):
        ready = self.tmp / f"{tag}.ready"
        c = SimpleNamespace(tag=tag, pid=4000 + len(self.clients), proc=FakeProc(), ready=ready,
                            stop=self.tmp / f"{tag}.stop", env=env or {}, grow=grow or [], extra=extra or [],
                            out=[], is_ready=lambda: True)
        c.text = lambda c=c: "\n".join(c.out)
        mib = mem * 1024 + 400
        if "--fill-self-mib" in c.extra:
            mib = self.fill_reached
            target = float(c.extra[c.extra.index("--fill-self-mib") + 1])
            ready.with_name(f"{tag}.ready.fill").write_text(json.dumps(
                {"stopped": "target" if mib >= target else "brim", "reached_mib": mib, "target_mib": target}))
        self.live[c.pid] = (mib, c.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"))
        self.clients.append(c)
        return c

    def wait_ready(self, cs, timeout):
        return []

    def grow(self, c, step, timeout=60):
        err = "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.19 GiB"
        c.out.append(f"{c.tag} ALLOC_FAIL {err}")
        self._leave(c, 3)
        return f"FAIL {err}"

    def stop(self, cs, timeout=60):
        for c in cs:
            if c.proc.returncode is None:
                self._leave(c, 0)

    def _leave(self, c, rc):
        c.proc.returncode = rc
        mib, limit = self.live.pop(c.pid)
        at_edge = limit and 2048 - mib <= 2048 * 0.05
        outcome = "failed" if rc else "clean"
        if self.count == "unknown":
            outcome = "unknown"
        if self.count == "far too" or at_edge:
            for _ in range(2 if self.count == "twice" else 1):
                key = ("0", "client_limit", outcome)
                self.counts[key] = self.counts.get(key, 0) + 1

    def scrape(self):
        rows = {("0", r, o): 0 for r in ("client_limit", "device_full")
                for o in (("unknown",) if self.count == "unknown" else ("failed", "clean"))}
        rows.update(self.counts)
        text = "".join(f'mps_client_exits_at_memory_limit_total{{daemon="default",gpu="{g}",reason="{r}",'
                       f'outcome="{o}"}} {n}\n' for (g, r, o), n in rows.items())
        for pid, (mib, limit) in self.live.items():
            text += f'mps_client_memory_used_bytes{{daemon="default",pid="{pid}",gpu="0",uuid="GPU-a"}} {mib * MIB}\n'
            if limit:
                text += (f'mps_client_pinned_memory_limit_bytes{{daemon="default",pid="{pid}",gpu="0",uuid="GPU-a"}} '
                         f'{2 * GiB}\n')
        return Exposition(text)

    def smi_apps(self):
        return {("GPU-a", pid): int(mib) for pid, (mib, _) in self.live.items()}

    def smi_gpus(self):
        return [oracles.SmiGpu(0, "GPU-a", 81559, 1000)]

    def run(self, phase: str) -> Report:
        s = SimpleNamespace(clients=self.clients, client=self.client, wait_ready=self.wait_ready, grow=self.grow,
                            stop=self.stop, smi_apps=self.smi_apps, smi_gpus=self.smi_gpus,
                            shutdown_servers=lambda: None)
        tc = SimpleNamespace(s=s, r=self.report, phase=lambda name: None, scrape=self.scrape)
        oom_phase.PHASES[phase](tc)
        return self.report


def test_oomlimit_passes_when_the_victim_is_counted_once_as_failed_and_the_far_client_not(tmp_path):
    fake = FakeMps(tmp_path)
    report = fake.run("oomlimit")
    assert report.passed, [c for c in report.checks if not c.passed]
    victim, far = fake.clients
    assert {"--exit-on-fail", "--grow-relative"} <= set(victim.extra) and victim.grow == [1.0]
    assert victim.env == far.env == {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"}
    fill = float(victim.extra[victim.extra.index("--fill-self-mib") + 1])
    assert 0.95 * 2048 < fill < 2048


@pytest.mark.parametrize("count, failing", [
    ("twice", ["oomlimit: exits at the memory limit counted: the victim once, client_limit/failed on its GPU "
               "(nvidia-smi's), nothing else"]),
    ("far too", ["oomlimit: exits at the memory limit counted: the victim once, client_limit/failed on its GPU "
                 "(nvidia-smi's), nothing else", "oomlimit: the far client's normal exit counted nowhere"]),
])
def test_oomlimit_fails_on_a_double_count_or_a_far_client_counted(tmp_path, count, failing):
    report = FakeMps(tmp_path, count).run("oomlimit")
    assert [c.name for c in report.checks if not c.passed] == failing


def test_oomlimit_says_so_when_the_exit_status_is_unknown_or_the_fill_fell_short(tmp_path):
    failed = [c.name for c in FakeMps(tmp_path, "unknown").run("oomlimit").checks if not c.passed]
    assert failed[0].startswith("oomlimit: the exporter asks the kernel how clients end") and len(failed) == 2
    failed = [c.name for c in FakeMps(tmp_path, fill_reached=1800.0).run("oomlimit").checks if not c.passed]
    assert failed[:2] == ["oomlimit: the victim filled itself to 95.5% of 2 GiB as NVML reads it",
                          "oomlimit: the exporter read the victim within 5% of its limit before it grew"]


def test_nearclean_counts_a_normal_exit_near_the_limit_as_clean(tmp_path):
    fake = FakeMps(tmp_path)
    report = fake.run("nearclean")
    assert report.passed, [c for c in report.checks if not c.passed]
    (c,) = fake.clients
    assert c.proc.returncode == 0 and "--exit-on-fail" not in c.extra


def test_a_phase_kills_its_clients_left_running_when_it_breaks(tmp_path):
    fake = FakeMps(tmp_path)

    def broken_grow(c, step, timeout=60):
        raise RuntimeError("the GPU went away")
    fake.grow = broken_grow
    with pytest.raises(RuntimeError):
        fake.run("oomlimit")
    assert all(c.proc.returncode == -9 for c in fake.clients)
    assert fake.report.facts["oomlimit: clients still running at its end (killed)"] == ["ol_victim", "ol_far"]
