"""join keeps a client's row while what it is derived from stays (join._KeptClients):
its memory is replaced where it moved, and a change to any of its inputs derives it anew.
(tests/conftest.py checks every rows_of of the suite against a join without reuse.)"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from mps_exporter import join
from mps_exporter.model import ProcessMemory, Snapshot
from tests.fakes.fake_control import FakeServer
from tests.support import scenarios


def _snapshot(tmp_path: Path) -> Snapshot:
    return scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3).collector().snapshot()


def _moved(snap: Snapshot, by: int) -> Snapshot:
    """The snapshot with every MPS client's memory `by` bytes higher, read anew."""
    moved = copy.copy(snap)
    moved.nvml = copy.deepcopy(snap.nvml)
    assert moved.nvml is not None
    for gpu in moved.nvml.gpus:
        gpu.mps_clients = [ProcessMemory(p.pid, (p.used_bytes or 0) + by) for p in gpu.mps_clients]
    return moved


def _clients(rows: join.Rows) -> Any:
    return {c.pid: c for d in rows.daemons for c in d.clients}


def test_a_client_whose_memory_alone_moved_keeps_its_row_but_its_memory(tmp_path):
    snap = _snapshot(tmp_path)
    before = _clients(join.join(snap))
    after = _clients(join.join(_moved(snap, 1 << 20)))
    assert set(after) == set(before) and len(after) == 6
    for pid, row in after.items():
        assert row is not before[pid]
        assert row.memory_used_bytes == {gpu: used + (1 << 20) for gpu, used in before[pid].memory_used_bytes.items()}
        # derived once: the limits' mappings are the very objects of the last join
        assert row.limit_sources is before[pid].limit_sources
        assert row.pinned_memory_limit_bytes is before[pid].pinned_memory_limit_bytes
    again = _clients(join.join(_moved(snap, 1 << 20)))
    assert all(again[pid] is row for pid, row in after.items())  # nothing moved: the same rows


def test_a_client_whose_facts_changed_is_derived_anew(tmp_path):
    snap = _snapshot(tmp_path)
    before = _clients(join.join(snap))
    pid = min(before)
    changed = copy.copy(snap)
    changed.processes = dict(snap.processes)
    changed.processes[pid] = dataclasses.replace(snap.processes[pid],
                                                 environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"})
    after = _clients(join.join(changed))
    assert after[pid].active_thread_ratio == 0.25 and before[pid].active_thread_ratio != 0.25
    assert after[pid].limit_sources is not before[pid].limit_sources
    assert all(after[p] is before[p] for p in before if p != pid)
    # and its names gained in place (ProcessFacts are named once the runtime knows them),
    # which the proc source gives in a new mapping (ProcClient.renamed)
    named = _clients(join.join(changed))
    changed.processes[pid].namespace, changed.processes[pid].pod = "ml", "trainer-0"
    changed.processes = dict(changed.processes)
    renamed = _clients(join.join(changed))
    assert (renamed[pid].namespace, renamed[pid].pod) == ("ml", "trainer-0") and named[pid].pod == ""


def test_a_join_without_reuse_neither_reads_nor_changes_the_kept_rows(tmp_path):
    snap = _snapshot(tmp_path)
    kept = _clients(join.join(snap))
    fresh = _clients(join.join(_moved(snap, 1 << 20), reuse=False))
    assert all(fresh[pid].limit_sources is not row.limit_sources for pid, row in kept.items())
    assert all(_clients(join.join(snap))[pid] is row for pid, row in kept.items())


def _daemon_clients(rows: join.Rows) -> Any:
    return [d.clients for d in rows.daemons]


def test_a_daemon_whose_readings_are_the_very_same_keeps_its_client_rows_at_once(tmp_path):
    snap = _snapshot(tmp_path)
    before = _daemon_clients(join.join(snap))
    # A new NVML reading whose process lists are the last ones (the source gives them again
    # while equal), the GPUs' utilization moved: not one client row derived or compared.
    again = copy.copy(snap)
    again.nvml = copy.copy(snap.nvml)
    assert again.nvml is not None and snap.nvml is not None
    again.nvml.gpus = [dataclasses.replace(g, utilization_ratio=0.5) for g in snap.nvml.gpus]
    assert all(a is b for a, b in zip(_daemon_clients(join.join(again)), before))
    # An equal list that is another object: compared client by client, the rows kept one by one
    moved = _moved(snap, 0)
    after = _daemon_clients(join.join(moved))
    assert all(a is not b and all(x is y for x, y in zip(a, b)) for a, b in zip(after, before))
    # A daemon's ps answer that is another list: its clients again
    listed = copy.copy(moved)
    listed.daemons = [dataclasses.replace(d, clients=list(d.clients)) for d in moved.daemons]
    assert all(a is not b for a, b in zip(_daemon_clients(join.join(listed)), after))


def test_a_derived_value_is_derived_again_only_for_another_reading_or_key():
    from mps_exporter.model import Derived

    derived: Derived[int] = Derived()
    calls: list = []

    def derive() -> int:
        calls.append(1)
        return len(calls)

    first, equal = [1], [1]
    assert derived.get([first], 0, derive) == 1
    assert derived.get([first], 0, derive) == 1  # the very reading: kept
    assert derived.get([equal], 0, derive) == 2  # an equal one that is another object: derived again
    assert derived.get([equal], 1, derive) == 3  # another key
    assert derived.get([equal, first], 1, derive) == 4  # another count of readings


def test_a_gpus_sharing_mode_and_a_servers_clients_follow_new_lists_and_stay_with_the_same(tmp_path):
    # _sharing and _clients_per_server are kept while the very lists stay: a process outside
    # MPS in a new compute list makes the GPU mixed, a client fewer in `ps` counts one fewer.
    snap = _snapshot(tmp_path)
    rows = join.join(snap)
    assert [g.sharing_mode for g in rows.gpus] == ["mps", "mps"]
    assert join.join(copy.copy(snap)).gpus[0].outside_mps is rows.gpus[0].outside_mps  # the same lists
    outside = copy.copy(snap)
    outside.nvml = copy.deepcopy(snap.nvml)
    assert outside.nvml is not None
    outside.nvml.gpus[0].compute_processes = outside.nvml.gpus[0].compute_processes + [ProcessMemory(99999, 1 << 30)]
    mixed = join.join(outside)
    assert [g.sharing_mode for g in mixed.gpus] == ["mixed", "mps"]
    assert [p.pid for p in mixed.gpus[0].outside_mps] == [99999]
    server = rows.daemons[0].servers[0]
    fewer = copy.copy(snap)
    fewer.daemons = [dataclasses.replace(snap.daemons[0], clients=[c for c in snap.daemons[0].clients
                                                                   if c.pid != min(c.pid for c in snap.daemons[0].clients)])]
    after = {s.pid: s for s in join.join(fewer).daemons[0].servers}
    assert after[server.pid].clients == server.clients - 1


def _warm(tmp_path: Path) -> Any:
    """The synthetic node's scenario and collector after a first collection (GPM's activity
    needs two samples) and a second of NVML's clock."""
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3)
    collector = scen.collector()
    collector.snapshot()
    scen.nvml.advance(1.0)
    return scen, collector


def test_a_steady_node_read_again_gives_the_same_readings_and_rows(tmp_path):
    """NVML's and each daemon's lists come back as the very objects of the last read while
    equal, so a second collection of a steady node is joined by identity: the same rows,
    the same memory readings for the exit tracker (issue 44)."""
    scen, collector = _warm(tmp_path)
    first = collector.snapshot()
    scen.nvml.advance(1.0)  # newer utilization samples, at the same ratios
    second = collector.snapshot()
    assert first.nvml is second.nvml and first.nvml is not None
    [d1], [d2] = first.daemons, second.daemons
    assert d1 is not d2 and d2.commands_sent != d1.commands_sent  # new: its command counts moved
    assert d2.servers is d1.servers and d2.clients is d1.clients and d2.default_pinned_limits is d1.default_pinned_limits
    assert join.rows_of(second) is join.rows_of(first)
    assert join.client_memory(second) is join.client_memory(first)


def test_a_gpu_that_moved_is_a_new_reading_and_the_others_stay(tmp_path):
    scen, collector = _warm(tmp_path)
    first = collector.snapshot()
    client = scen.nvml.gpus[1].mps_processes[0]
    client.usedGpuMemory += 1 << 20
    scen.nvml.gpus[1].compute_processes[1].usedGpuMemory += 1 << 20
    scen.nvml.advance(1.0)
    second = collector.snapshot()
    assert first.nvml is not None and second.nvml is not None and second.nvml is not first.nvml
    assert second.nvml.gpus[0] is first.nvml.gpus[0]
    assert second.nvml.gpus[1] is not first.nvml.gpus[1]
    moved = {p.pid: p.used_bytes for p in second.nvml.gpus[1].mps_clients}
    assert moved[client.pid] == {p.pid: p.used_bytes for p in first.nvml.gpus[1].mps_clients}[client.pid] + (1 << 20)
    assert join.rows_of(second) is not join.rows_of(first)


def test_a_daemon_whose_answer_changed_gives_its_new_lists(tmp_path):
    scen, collector = _warm(tmp_path)
    first = collector.snapshot()
    scen.daemon.servers.append(FakeServer(4001))  # a second server: get_server_list moved
    scen.nvml.advance(1.0)
    second = collector.snapshot()
    [d1], [d2] = first.daemons, second.daemons
    assert [s.pid for s in d1.servers] == [4000] and [s.pid for s in d2.servers] == [4000, 4001]
    assert d2.servers[0] == d1.servers[0]
    assert join.rows_of(second) is not join.rows_of(first)
    scen.nvml.advance(1.0)
    third = collector.snapshot()
    assert third.daemons[0].servers is d2.servers  # steady again: the new list kept


def test_a_steady_daemons_reads_compare_no_client_by_value(tmp_path, monkeypatch):
    """A `ps` that answered as the one before it is kept as the very list (DaemonReader
    _clients): the reads after it, which send no `ps`, compare none of its 384 rows field by
    field, nor check each against the live servers again (issue 44)."""
    from mps_exporter.model import PsEntry

    scen = scenarios.synthetic(tmp_path, gpus=8, clients_per_gpu=48)
    collector = scen.collector()
    for _ in range(3):  # `ps` twice alike: settled
        scen.nvml.advance(1.0)
        first = collector.snapshot()
    compared = []
    real_eq = PsEntry.__eq__
    monkeypatch.setattr(PsEntry, "__eq__", lambda a, b: compared.append(a) or real_eq(a, b))
    scen.nvml.advance(1.0)
    second = collector.snapshot()
    assert len(second.daemons[0].clients) == 384 and second.daemons[0].clients is first.daemons[0].clients
    assert compared == []
