"""bench/cost_bench.py leaves the simulated node's CPU out of the exporter's: each outermost
call into the fake NVML library and control daemon counted once, by a clock injected here."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import List

import pytest

from bench.cost_bench import SimulatedCpu, count_fake_nvml
from tests.fakes.fake_pynvml import NVML_ERROR_INSUFFICIENT_SIZE
from tests.support import scenarios


def _ticking(step: float) -> tuple:
    """A CPU clock that moves `step` at each read, and its reads."""
    reads: List[float] = []

    def clock() -> float:
        reads.append(len(reads) * step)
        return reads[-1]
    return clock, reads


def test_a_call_is_counted_once_with_the_calls_it_makes_inside():
    now = [0.0]
    simulated = SimulatedCpu(clock=lambda: now[0])

    def inner() -> str:
        now[0] += 2.0
        return "answer"
    counted_inner = simulated.wrap("nvml", inner)

    def outer() -> str:
        now[0] += 1.0
        return counted_inner()
    counted_outer = simulated.wrap("nvml", outer)

    assert counted_outer() == "answer"
    assert simulated.seconds == {"nvml": 3.0}  # not 5: the inner call is inside the outer
    assert counted_inner() == "answer"
    assert simulated.seconds == {"nvml": 5.0}


def test_a_call_that_raises_is_counted_and_the_next_call_counted_again():
    now = [0.0]
    simulated = SimulatedCpu(clock=lambda: now[0])

    def fails() -> None:
        now[0] += 1.0
        raise ValueError("injected")

    def answers() -> int:
        now[0] += 4.0
        return 7
    with pytest.raises(ValueError, match="injected"):
        simulated.wrap("control daemon", fails)()
    assert simulated.wrap("control daemon", answers)() == 7
    assert simulated.seconds == {"control daemon": 5.0}
    assert simulated.total() == 5.0


def test_each_threads_calls_are_summed_with_a_part_wrapped_after_its_first_call():
    spent = threading.local()  # each thread's own CPU clock
    simulated = SimulatedCpu(clock=lambda: getattr(spent, "now", 0.0))

    def work(seconds: float) -> None:
        spent.now = getattr(spent, "now", 0.0) + seconds
    nvml = simulated.wrap("nvml", work)
    threads = [threading.Thread(target=nvml, args=(seconds,)) for seconds in (1.0, 2.0, 4.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    nvml(8.0)
    assert simulated.parts() == {"nvml": 15.0}
    simulated.wrap("control daemon", work)(16.0)  # this thread's totals were made before the part
    assert simulated.parts() == {"nvml": 15.0, "control daemon": 16.0}
    assert simulated.total() == 31.0


def test_the_fake_nvml_functions_and_entry_points_are_counted(tmp_path: Path):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=3)
    clock, reads = _ticking(1.0)
    simulated = SimulatedCpu(clock=clock)
    count_fake_nvml(scen.nvml, simulated)

    scen.nvml.nvmlInit()
    handle = scen.nvml.nvmlDeviceGetHandleByIndex(0)
    assert scen.nvml.calls["nvmlDeviceGetHandleByIndex"] == 1  # the fake itself answered
    assert simulated.seconds["nvml"] == 2.0 and len(reads) == 4
    entry = scen.nvml._nvmlGetFunctionPointer("nvmlDeviceGetMPSComputeRunningProcesses_v3")
    count = ctypes.c_uint(0)
    assert entry(handle, ctypes.byref(count), None) == NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 3  # the fake's answer: three clients
    assert simulated.seconds["nvml"] == 4.0  # the lookup and the call, once each


def test_the_cpu_of_a_thread_that_ended_is_still_counted():
    """The process CPU clock keeps what a thread spent after it ended, as a sum over the
    live threads' schedstat would not."""
    import subprocess
    import sys

    from bench.cost_bench import process_cpu_seconds, threads_cpu

    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, threading, time\n"
        "spent = []\n"
        "def work():\n"
        "    n = 0\n"
        "    while time.thread_time() < 0.3:\n"
        "        n += 1\n"
        "    spent.append(time.thread_time())\n"
        "t = threading.Thread(target=work); t.start(); t.join()\n"
        # join() returns before the kernel drops the thread's task: wait until it has
        "while os.path.exists(f'/proc/self/task/{t.native_id}'):\n"
        "    time.sleep(0.01)\n"
        "print(spent[0], flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ended_thread = float(child.stdout.readline())  # it ended; the child waits on stdin
        whole = process_cpu_seconds(child.pid)
        live = threads_cpu(child.pid)
        assert whole is not None and whole >= ended_thread >= 0.3
        assert live is not None and sum(ns for _, ns in live.values()) / 1e9 < ended_thread
    finally:
        child.communicate("")
