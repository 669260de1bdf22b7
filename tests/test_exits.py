"""Exits at the edge of memory and peaks (exporter/exits.py), from hand-built snapshots: the
collection times are the snapshots' own, no clock is read."""

from __future__ import annotations

import copy
from typing import AbstractSet, Dict, List, Optional, Sequence, Set, Tuple

from mps_exporter.exitstatus import ExitStatus
from mps_exporter.exits import ExitTracker, Margins, proc_alive
from mps_exporter.model import (DaemonReading, EdgeExit, GpuReading, NvmlReading, Outcome, ProcessFacts,
                                ProcessMemory, PsEntry, ServerFacts, Snapshot)
from mps_exporter.render import render
from mps_exporter.status import text, view

GiB = 1 << 30
TOTAL = 80 * GiB
UUID = "GPU-a20825ef-ef8f-4f37-0000-000000000000"


class Statuses:
    """The kernel's exit statuses as the test says them."""

    def __init__(self, available: bool = True) -> None:
        self.available = available
        self.known: Dict[int, ExitStatus] = {}

        self.watched: List[Set[int]] = []  # what the tracker asked the kernel to keep, call by call

    def status(self, pid: int) -> Optional[ExitStatus]:
        return self.known.get(pid)

    def watch(self, pids: AbstractSet[int]) -> None:
        self.watched.append(set(pids))


def snap(now: float, clients: Dict[int, int], gpu_used: Optional[int] = None, ps: Optional[Sequence[int]] = None,
         env: Optional[Dict[int, str]] = None, gpu_up: bool = True, ps_error: Optional[str] = None,
         pods: Optional[Dict[int, Tuple[str, str]]] = None) -> Snapshot:
    """One collection: NVML lists `clients` (pid -> bytes) on GPU 0; the daemon's ps lists
    `ps` (default: the same PIDs); `env`: pid -> its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT."""
    mps = [ProcessMemory(pid, used) for pid, used in clients.items()]
    gpu = GpuReading(0, UUID, gpu_up, name="H100", memory_total_bytes=TOTAL,
                     memory_used_bytes=sum(clients.values()) if gpu_used is None else gpu_used,
                     mps_clients=mps if gpu_up else [])
    rows = [PsEntry(pid, 1, 500, UUID[:24], "4026531836", "python3") for pid in (clients if ps is None else ps)]
    daemon = DaemonReading("default", True, "/tmp/nvidia-mps", "/var/log/nvidia-mps", servers=[ServerFacts(500, "ACTIVE")],
                           clients=[] if ps_error else rows, error=ps_error)
    processes = {}
    for pid in set(clients) | set(ps or ()):
        uid, name = (pods or {}).get(pid, ("", ""))
        processes[pid] = ProcessFacts(pid, environ={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": (env or {})[pid]}
                                      if pid in (env or {}) else {}, pod_uid=uid, namespace="ml" if uid else "",
                                      pod=name, container="train" if uid else "")
    return Snapshot(now=now, nvml=NvmlReading("580.65.06", [gpu]), daemons=[daemon], processes=processes,
                    outcomes={"control": Outcome(ps_error is None, 0.01)})


def counts(tracker_report) -> Dict[Tuple[str, int, str, str], int]:
    return {k: n for k, n in tracker_report.exits if n}


def test_a_client_that_dies_at_95_percent_of_its_2_gib_limit_is_counted_as_failed():
    # The live case: held to 2 GiB, at 95 % of it, asked 1 GiB more and died (exit status 1).
    statuses = Statuses()
    tracker = ExitTracker(Margins(0.05, 0.97), statuses, alive=lambda pid: False)
    at_edge = int(2 * GiB * 0.95)
    tracker.observe(snap(100.0, {4242: GiB}, env={4242: "0=2G"}))
    tracker.observe(snap(101.0, {4242: at_edge}, env={4242: "0=2G"}))
    statuses.known[4242] = ExitStatus(1, 0)
    report = tracker.observe(snap(102.0, {}))
    assert counts(report) == {("default", 0, "client_limit", "failed"): 1}
    assert report.recent == (EdgeExit("default", 4242, 0, "client_limit", "failed", at_edge, 2 * GiB, at_edge, TOTAL,
                                      101.0, 102.0, "exit status 1"),)
    # Zero rows for the other reasons and outcomes: the alert sees the first exit as an increase.
    assert ("default", 0, "device_full", "clean") in dict(report.exits)
    assert ("default", 0, "client_limit", "unknown") not in dict(report.exits)


def test_the_kernel_is_asked_for_the_clean_exits_of_the_followed_clients_only():
    statuses = Statuses()
    tracker = ExitTracker(Margins(0.05, 0.97), statuses, alive=lambda pid: False)
    tracker.observe(snap(100.0, {4242: GiB, 4343: GiB}))
    tracker.observe(snap(101.0, {4343: GiB}))  # 4242 gone, its exit not heard yet: still followed
    statuses.known[4242] = ExitStatus(0, 0)
    tracker.observe(snap(102.0, {4343: GiB}))  # judged: no longer followed
    assert statuses.watched == [{4242, 4343}, {4242, 4343}, {4343}]
    unavailable = Statuses(available=False)
    ExitTracker(Margins(), unavailable).observe(snap(100.0, {4242: GiB}))
    assert unavailable.watched == []


def test_peak_series_are_reused_while_a_peak_stays_and_redone_when_it_moves():
    from mps_exporter.families import FamilyBuilder
    from mps_exporter.render import ClientTableMemo, render_edges

    def peaks(report, memo):
        out = FamilyBuilder()
        render_edges(out, report, {0: UUID}, "client", memo)
        return {s.labels["pid"]: s for name, samples in out.parts() for s in samples
                if name == "mps_client_memory_peak_bytes"}

    tracker = ExitTracker(Margins(), None, alive=lambda pid: True)
    memo = ClientTableMemo()
    first = peaks(tracker.observe(snap(100.0, {1: GiB, 2: GiB})), memo)
    second = peaks(tracker.observe(snap(101.0, {1: GiB, 2: 2 * GiB})), memo)
    assert second["1"] is first["1"]  # its peak stayed: the same sample
    assert (first["2"].value, second["2"].value) == (GiB, 2 * GiB)
    third = peaks(tracker.observe(snap(102.0, {2: GiB})), memo)
    assert set(third) == {"2"} and third["2"] is second["2"] and set(memo.peaks) == {
        (entry, UUID) for entry in tracker.observe(snap(103.0, {2: GiB})).peaks}
    # Without a memo, the same series.
    assert {pid: s.value for pid, s in peaks(tracker.observe(snap(104.0, {2: GiB})), None).items()} == {"2": 2 * GiB}
    # The very same report again: its families at once, but for another granularity its own.
    report = tracker.observe(snap(105.0, {2: GiB}, pods={2: ("uid-2", "trainer-2")}))
    assert peaks(report, memo) == peaks(report, memo) == peaks(report, None)
    pod = FamilyBuilder()
    render_edges(pod, report, {0: UUID}, "pod", memo)
    assert [name for name, _ in pod.parts()] == ["mps_client_exits_at_memory_limit_total",
                                                 "mps_pod_client_memory_peak_bytes"]


def test_a_client_read_below_the_edge_in_its_last_moments_is_judged_by_its_edge_reading():
    # Live (4 x H200): at 1958 of 2048 MiB, then read lower while PyTorch gave back its cache
    # and the process tore down; the exit was not counted when only the last reading counted.
    statuses = Statuses()
    tracker = ExitTracker(Margins(0.05, 0.97, window_seconds=30.0), statuses, alive=lambda pid: False)
    at_edge = int(2 * GiB * 0.956)
    tracker.observe(snap(100.0, {4242: at_edge, 4343: at_edge}, env={4242: "0=2G", 4343: "0=2G"}))
    tracker.observe(snap(101.0, {4242: GiB, 4343: at_edge}, env={4242: "0=2G", 4343: "0=2G"}))  # 4242 below it now
    tracker.observe(snap(140.0, {4343: GiB}, env={4343: "0=2G"}))  # 4343 left its edge 39 s before it leaves
    statuses.known[4242], statuses.known[4343] = ExitStatus(3, 0), ExitStatus(0, 0)
    report = tracker.observe(snap(141.0, {}))
    assert counts(report) == {("default", 0, "client_limit", "failed"): 1}  # 4343: far for the whole window
    assert [(e.pid, e.used_bytes, e.reading_time) for e in report.recent] == [(4242, at_edge, 100.0)]


def _read_again(collection: Snapshot, now: float) -> Snapshot:
    """The same readings in a later collection (nothing read anew: the same objects)."""
    again = copy.copy(collection)
    again.now = now
    return again


def test_the_same_readings_read_again_are_taken_at_their_latest_collection():
    # A collection whose readings are the very last ones (client_memory gives the same list)
    # takes nothing anew: their time moves, and the edge window counts from it.
    statuses = Statuses()
    tracker = ExitTracker(Margins(0.05, 0.97, window_seconds=30.0), statuses, alive=lambda pid: False)
    at_edge = int(2 * GiB * 0.956)
    first = snap(100.0, {4242: at_edge}, env={4242: "0=2G"})
    report = tracker.observe(first)
    assert tracker.observe(_read_again(first, 110.0)) is report  # nothing in the report changed
    tracker.observe(snap(135.0, {4242: GiB}, env={4242: "0=2G"}))  # below it now, 25 s after the edge was read
    statuses.known[4242] = ExitStatus(3, 0)
    report = tracker.observe(snap(136.0, {}))
    assert [(e.pid, e.used_bytes, e.reading_time) for e in report.recent] == [(4242, at_edge, 110.0)]
    # and a client whose edge reading was last read 35 s before: far for the whole window
    tracker.observe(first)
    tracker.observe(_read_again(first, 105.0))
    tracker.observe(snap(140.0, {4242: GiB}, env={4242: "0=2G"}))
    report = tracker.observe(snap(141.0, {}))
    assert len(report.recent) == 1


def test_the_same_clients_again_are_not_watched_anew_and_one_that_leaves_is_still_judged():
    # The kernel is asked again only where the followed clients changed; the same lists read
    # again (join.present_clients gives the same set) leave nobody, and a list without a
    # client still ends it.
    statuses = Statuses()
    asked: List[int] = []
    tracker = ExitTracker(Margins(0.05, 0.97), statuses, alive=lambda pid: bool(asked.append(pid)))
    first = snap(100.0, {4242: int(2 * GiB * 0.96), 4343: GiB}, env={4242: "0=2G"})
    report = tracker.observe(first)
    for now in (101.0, 102.0):
        assert tracker.observe(_read_again(first, now)) is report
    assert statuses.watched == [{4242, 4343}] and asked == []
    statuses.known[4242] = ExitStatus(1, 0)
    gone = snap(103.0, {4343: GiB})
    report = tracker.observe(gone)
    assert counts(report) == {("default", 0, "client_limit", "failed"): 1}
    assert tracker.observe(_read_again(gone, 104.0)) is report
    assert statuses.watched == [{4242, 4343}, {4343}]


def test_a_client_far_from_its_limit_is_never_counted():
    statuses = Statuses()
    tracker = ExitTracker(Margins(0.05, 0.97), statuses, alive=lambda pid: False)
    tracker.observe(snap(100.0, {4242: GiB}, env={4242: "0=2G"}))  # 50 %
    statuses.known[4242] = ExitStatus(0, 9)
    report = tracker.observe(snap(101.0, {}))
    assert counts(report) == {} and report.recent == ()


def test_the_margin_is_where_the_edge_is():
    below = int(2 * GiB * 0.949)
    for margin, counted in ((0.05, False), (0.06, True)):
        tracker = ExitTracker(Margins(margin, 0.97), None, alive=lambda pid: False)
        tracker.observe(snap(100.0, {7: below}, env={7: "0=2G"}))
        assert bool(counts(tracker.observe(snap(101.0, {})))) is counted, margin


def test_a_client_that_leaves_a_nearly_full_gpu_counts_as_device_full():
    # The live case: four clients filled the GPU to 97.5 %, a fifth (no limit) asked 6 GiB and died.
    statuses = Statuses()
    tracker = ExitTracker(Margins(0.05, 0.97), statuses, alive=lambda pid: False)
    full = {1: 19 * GiB, 2: 19 * GiB, 3: 19 * GiB, 4: 19 * GiB, 5: GiB // 2}
    used = int(TOTAL * 0.975)
    tracker.observe(snap(100.0, full, gpu_used=used))
    statuses.known[5] = ExitStatus(1, 0)
    report = tracker.observe(snap(101.0, {pid: n for pid, n in full.items() if pid != 5}, gpu_used=used))
    assert counts(report) == {("default", 0, "device_full", "failed"): 1}
    assert report.recent[0].gpu_used_bytes == used and report.recent[0].limit_bytes is None


def test_without_the_connector_the_outcome_is_unknown():
    tracker = ExitTracker(Margins(), None, alive=lambda pid: False)
    tracker.observe(snap(100.0, {9: 2 * GiB}, env={9: "0=2G"}))
    report = tracker.observe(snap(101.0, {}))
    assert counts(report) == {("default", 0, "client_limit", "unknown"): 1}
    assert {k[3] for k, _ in report.exits} == {"unknown"}  # no failed/clean rows it could never fill


def test_a_client_still_in_ps_has_not_left():
    tracker = ExitTracker(Margins(), None, alive=lambda pid: False)
    tracker.observe(snap(100.0, {9: 2 * GiB}, env={9: "0=2G"}))
    assert counts(tracker.observe(snap(101.0, {}, ps=[9]))) == {}  # NVML dropped it, ps still lists it
    assert counts(tracker.observe(snap(102.0, {}, ps=[]))) == {("default", 0, "client_limit", "unknown"): 1}


def test_no_conclusion_from_a_collection_that_could_not_see_the_client():
    tracker = ExitTracker(Margins(), None, alive=lambda pid: False)
    tracker.observe(snap(100.0, {9: 2 * GiB}, env={9: "0=2G"}))
    assert counts(tracker.observe(snap(101.0, {9: 2 * GiB}, gpu_up=False))) == {}  # its GPU not read
    assert counts(tracker.observe(snap(102.0, {}, ps_error="timeout"))) == {}  # its daemon's ps failed
    no_nvml = snap(103.0, {})
    no_nvml.nvml = None
    assert counts(tracker.observe(no_nvml)) == {}
    assert counts(tracker.observe(snap(104.0, {}))) == {("default", 0, "client_limit", "unknown"): 1}


def test_a_client_that_left_mps_but_still_runs_is_forgotten_not_counted():
    running = {9}
    tracker = ExitTracker(Margins(), None, alive=lambda pid: pid in running)
    tracker.observe(snap(100.0, {9: 2 * GiB}, env={9: "0=2G"}))
    assert counts(tracker.observe(snap(101.0, {}))) == {}
    running.clear()
    assert counts(tracker.observe(snap(102.0, {}))) == {}  # forgotten: nothing left to count


def test_an_exit_event_that_trails_nvml_is_waited_for_one_collection():
    statuses = Statuses()
    tracker = ExitTracker(Margins(), statuses, alive=lambda pid: False)
    tracker.observe(snap(100.0, {9: 2 * GiB, 10: 2 * GiB}, env={9: "0=2G", 10: "0=2G"}))
    report = tracker.observe(snap(101.0, {}))
    assert counts(report) == {} and report.peaks == ()  # not yet: neither exit seen
    statuses.known[9] = ExitStatus(0, 0)
    report = tracker.observe(snap(102.0, {}))
    assert counts(report) == {("default", 0, "client_limit", "clean"): 1,
                              ("default", 0, "client_limit", "unknown"): 1}
    assert [(e.pid, e.seen_gone) for e in report.recent] == [(9, 101.0), (10, 101.0)]


def test_peaks_per_client_and_per_pod_and_their_series():
    pods = {1: ("uid-a", "trainer-0"), 2: ("uid-a", "trainer-0")}
    tracker = ExitTracker(Margins(), None, alive=lambda pid: True)
    for t, (one, two) in enumerate(((GiB, GiB), (3 * GiB, GiB), (2 * GiB, 3 * GiB))):
        report = tracker.observe(snap(100.0 + t, {1: one, 2: two}, env={1: "0=4G", 2: "0=4G"}, pods=pods))
    assert dict(report.peaks) == {("default", 1, 0): ("ml", "trainer-0", "train", 3 * GiB),
                                  ("default", 2, 0): ("ml", "trainer-0", "train", 3 * GiB)}
    # The pod held 5 GiB at once at most (2 + 3), not the 6 GiB of the two peaks.
    assert dict(report.pod_peaks) == {("default", "500", "uid-a", 0): ("ml", "trainer-0", 5 * GiB)}
    last = snap(103.0, {1: 2 * GiB, 2: 3 * GiB}, env={1: "0=4G", 2: "0=4G"}, pods=pods)
    last.edges = report
    series = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in render(last).families() for s in f.samples}
    assert series[("mps_client_memory_peak_bytes", (("container", "train"), ("daemon", "default"), ("gpu", "0"),
                                                    ("namespace", "ml"), ("pid", "1"), ("pod", "trainer-0"),
                                                    ("uuid", UUID)))] == 3 * GiB
    pod_series = {(s.name, s.labels["pod"]): s.value for f in render(last, "pod").families() for s in f.samples
                  if s.name == "mps_pod_client_memory_peak_bytes"}
    assert pod_series == {("mps_pod_client_memory_peak_bytes", "trainer-0"): 5 * GiB}
    # Gone clients take their peaks with them.
    tracker.alive = lambda pid: False
    report = tracker.observe(snap(104.0, {2: GiB}, env={2: "0=4G"}, pods=pods))
    assert [k for k, _ in report.peaks] == [("default", 2, 0)]


def test_the_counter_and_status_show_the_edge_exit():
    statuses = Statuses()
    tracker = ExitTracker(Margins(), statuses, alive=lambda pid: False)
    tracker.observe(snap(100.0, {4242: int(1.95 * GiB)}, env={4242: "0=2G"}))
    statuses.known[4242] = ExitStatus(0, 9)
    last = snap(130.0, {})
    last.edges = tracker.observe(last)
    samples = {(s.labels["reason"], s.labels["outcome"]): s.value for f in render(last).families()
               for s in f.samples if s.name == "mps_client_exits_at_memory_limit_total"}
    assert samples == {("client_limit", "failed"): 1, ("client_limit", "clean"): 0, ("device_full", "failed"): 0,
                       ("device_full", "clean"): 0}
    st = view.build(last, "test")
    exits = st.daemons[0].edge_exits
    assert exits is not None and [(e.pid, e.reason, e.outcome, e.reading_age_seconds) for e in exits] == [
        (4242, "client_limit", "failed", 30.0)]
    report = text.plain(text.report(st))
    assert "EXITS AT THE MEMORY EDGE" in report and "4242" in report and "signal 9" in report


def test_tracked_clients_are_bounded():
    tracker = ExitTracker(Margins(), None, alive=lambda pid: True, max_tracked=3)
    report = tracker.observe(snap(100.0, {pid: GiB for pid in range(1, 10)}))
    assert len(report.peaks) == 3


def test_proc_alive_reads_the_state_after_the_command(tmp_path):
    for pid, stat in ((1, "1 (a) b) S 0"), (2, "2 (python3) Z 1")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat)
    alive = proc_alive(str(tmp_path))
    assert alive(1) is True and alive(2) is False and alive(3) is False


def test_the_collector_counts_a_client_of_the_fakes_that_leaves_at_its_limit(tmp_path):
    """End to end through the collector and the exposition: client 1648 of the busy scenario
    (its own limit 0=4G) grows to 3.9 GiB, then leaves NVML, the daemon's ps and /proc."""
    import shutil

    from mps_exporter.collector import build_registry
    from prometheus_client.exposition import generate_latest
    from tests.support import scenarios

    scen = scenarios.busy(tmp_path, logs=False)
    gpu = scen.nvml.gpus[0]
    for proc in gpu.mps_processes + gpu.compute_processes:
        if proc.pid == 1648:
            proc.usedGpuMemory = int(3.9 * GiB)
    registry = build_registry(scen.collector(), process=False)
    first = generate_latest(registry).decode()
    assert 'mps_client_memory_peak_bytes{container="trainer",daemon="default",gpu="0"' in first
    gpu.mps_processes = [p for p in gpu.mps_processes if p.pid != 1648]
    gpu.compute_processes = [p for p in gpu.compute_processes if p.pid != 1648]
    scen.daemon.clients = [c for c in scen.daemon.clients if c.pid != 1648]
    shutil.rmtree(scen.proc_root / "1648")
    second = generate_latest(registry).decode()
    assert ('mps_client_exits_at_memory_limit_total{daemon="default",gpu="0",outcome="unknown",'
            'reason="client_limit"} 1.0') in second
    assert 'pid="1648"' not in second.split("# HELP mps_client_memory_peak_bytes")[1].split("# HELP")[0]
