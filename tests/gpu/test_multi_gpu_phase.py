"""The pieces of issue 30's two-GPU truth-check phases that need no GPU (they run in CI)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import multi_gpu_phase  # noqa: E402
from report import Report  # noqa: E402

GiB = 2**30


def test_every_phase_refuses_one_gpu_with_a_failed_check_that_says_why():
    for name, phase in multi_gpu_phase.PHASES.items():
        report = Report("one GPU")
        ran = []
        tc = SimpleNamespace(s=SimpleNamespace(gpus=1), r=report, phase=ran.append)
        phase(tc)  # returns at the guard: on one GPU it never starts a client
        assert ran == [name] and not report.passed
        (check,) = report.checks
        assert "two or more GPUs" in check.note and "has 1" in check.note, check


def test_the_guard_lets_two_gpus_through():
    multi_gpu_phase.require_two_gpus(2, "remapped")
    with pytest.raises(multi_gpu_phase.NotEnoughGpus, match="needs two or more GPUs; this machine has 0"):
        multi_gpu_phase.require_two_gpus(0, "storm2")


def test_the_remapped_plan_is_the_issues():
    plan = multi_gpu_phase.remapped_clients("GPU-11111111-2222")
    assert plan["cvd1"]["env"] == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"}
    assert plan["cvd_uuid"]["env"]["CUDA_VISIBLE_DEVICES"] == "GPU-11111111-2222"
    assert plan["both_on1"]["expect"] == {0: 2 * GiB, 1: 4 * GiB}
    assert plan["only1_key1"]["expect"] == {}


def test_the_enforced_limit_from_the_grow_answers():
    assert multi_gpu_phase.enforced_limit(["OK"], [2.5]) is None
    assert multi_gpu_phase.enforced_limit(["FAIL out of memory"], [2.5]) == "between 0.5 and 2.5 GiB"
    assert multi_gpu_phase.enforced_limit(["OK", "FAIL x"], [2.5, 4.5]) == "between 2.5 and 4.5 GiB"


def _remapped_run(limit_lines: str, answers: dict) -> Report:
    """phase remapped against a fake machine: clients get pids 101.. in the plan's order,
    MPS answers each grow step with `answers[tag]`, the exporter serves `limit_lines`."""
    from scrape import Exposition

    report = Report("two GPUs")
    made = []

    def client(tag, mem, device=0, idle=False, grow=(), env=None):
        made.append(SimpleNamespace(tag=tag, pid=101 + len(made)))
        return made[-1]

    s = SimpleNamespace(gpus=2, smi_gpus=lambda: [SimpleNamespace(uuid="GPU-0000"), SimpleNamespace(uuid="GPU-1111")],
                        client=client, wait_ready=lambda cs, t: [], grow=lambda c, i: answers[c.tag][i],
                        stop=lambda cs: None, shutdown_servers=lambda: None)
    tc = SimpleNamespace(s=s, r=report, phase=lambda name: None, scrape=lambda: Exposition(limit_lines))
    multi_gpu_phase.PHASES["remapped"](tc)
    return report


MPS_ENFORCED = {"rm_cvd1": ["FAIL out of memory"], "rm_cvd_uuid": ["FAIL out of memory"],
                "rm_both_on1": ["OK", "FAIL out of memory"], "rm_only1_key1": ["OK", "OK"]}
LIMITS_ON_GPU1 = ('mps_client_pinned_memory_limit_bytes{pid="101",gpu="1"} 2147483648\n'
                  'mps_client_pinned_memory_limit_bytes{pid="102",gpu="1"} 2147483648\n'
                  'mps_client_pinned_memory_limit_bytes{pid="103",gpu="1"} 4294967296\n')


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    monkeypatch.setattr(multi_gpu_phase, "SETTLE", 0.0)


def test_remapped_passes_when_the_exporter_names_the_physical_gpu_mps_enforced_on():
    report = _remapped_run(LIMITS_ON_GPU1, MPS_ENFORCED)
    assert report.passed and len(report.checks) == 8, [c for c in report.checks if not c.passed]


def test_remapped_fails_when_the_limit_lands_on_the_clients_device_index_not_the_physical_gpu():
    wrong = LIMITS_ON_GPU1.replace('pid="101",gpu="1"', 'pid="101",gpu="0"')
    failed = [c.name for c in _remapped_run(wrong, MPS_ENFORCED).checks if not c.passed]
    assert len(failed) == 1 and "cvd1" in failed[0]
    # MPS enforcing no limit where the plan expects one fails on MPS's side.
    failed = [c.name for c in _remapped_run(LIMITS_ON_GPU1, {**MPS_ENFORCED, "rm_cvd1": ["OK"]}).checks
              if not c.passed]
    assert len(failed) == 1 and "MPS refused" in failed[0]
