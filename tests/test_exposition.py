"""The encoded exposition (collector.Exposition): the readings' part is encoded once per
format and compression while the readings stay the same; the exporter's own series and
process_* are encoded in every scrape; the body is one valid exposition (one gzip stream,
one OpenMetrics EOF) with every family the collector has."""

from __future__ import annotations

import copy
import zlib
from typing import Any, List

import pytest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

import mps_exporter.collector as collector_module
from mps_exporter.collector import build_registry
from mps_exporter.families import FamilyBuilder
from tests.support import scenarios

OPENMETRICS = "application/openmetrics-text;version=1.0.0"


def gunzip_one_stream(body: bytes) -> bytes:
    d = zlib.decompressobj(31)
    text = d.decompress(body) + d.flush()
    assert d.eof and d.unused_data == b""  # one whole gzip stream, nothing after it
    return text


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    renders: List[int] = []
    real = collector_module.render_readings

    def counting(*args: Any, **kwargs: Any) -> None:
        renders.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(collector_module, "render_readings", counting)
    return renders


@pytest.mark.parametrize("accept", [OPENMETRICS, "text/plain"])
@pytest.mark.parametrize("zipped", [False, True])
def test_the_body_is_one_valid_exposition_with_every_family(tmp_path, accept, zipped):
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3)
    registry = build_registry(scen.collector(), process=True)
    encoder, content_type = choose_encoder(accept)
    for _ in range(2):  # encoded, then reused
        body = registry.encode(encoder, content_type, zipped)
        text = (gunzip_one_stream(body) if zipped else body).decode()
        parse = parse_openmetrics if accept == OPENMETRICS else parse_text
        names = {f.name for f in parse(text)}
        assert text.count("# EOF") == (1 if accept == OPENMETRICS else 0)
        wanted = {f.name for f in registry.collect()}
        assert names == wanted
        assert {"mps_client_memory_used_bytes", "mps_exporter_collector_success", "process_cpu_seconds"} <= \
            {n.removesuffix("_total") for n in names}


def test_a_gzip_body_whose_gpus_moved_deflates_only_the_families_that_moved(tmp_path, monkeypatch):
    """The readings' families are deflated one by one and kept while their text stays:
    the body is still one gzip stream of exactly the plain exposition."""
    import dataclasses

    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3)
    collector = scen.collector()
    registry = build_registry(collector, process=False)
    encoder, content_type = choose_encoder(OPENMETRICS)
    snap = collector.snapshot()
    served = [snap]
    collector.collection = lambda: served[0]  # type: ignore[method-assign]
    registry.encode(encoder, content_type, True)
    deflated: List[int] = []
    real = zlib.compressobj

    def counting(*args: Any) -> Any:
        deflated.append(1)
        return real(*args)

    monkeypatch.setattr(zlib, "compressobj", counting)
    for ratio in (0.25, 0.5):
        moved = copy.copy(snap)
        moved.nvml = dataclasses.replace(snap.nvml, gpus=[dataclasses.replace(g, utilization_ratio=ratio)
                                                          for g in snap.nvml.gpus])
        served[0] = moved
        deflated.clear()
        body = registry.encode(encoder, content_type, True)
        assert gunzip_one_stream(body) == registry.encode(encoder, content_type, False)
        assert any(line.startswith(b'mps_gpu_utilization_ratio{gpu="0"') and line.endswith(b" %r" % ratio)
                   for line in gunzip_one_stream(body).splitlines())
        assert len(deflated) == 2  # the GPUs' utilization family, and the exporter's own series


def test_the_readings_part_is_encoded_once_while_the_readings_stay(tmp_path, counted):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=2)
    collector = scen.collector()
    registry = build_registry(collector, process=False)
    encoder, content_type = choose_encoder(OPENMETRICS)
    snap = collector.snapshot()
    collector.collection = lambda: snap  # type: ignore[method-assign]  # the same readings twice
    first = registry.encode(encoder, content_type, True)
    second = registry.encode(encoder, content_type, True)
    assert len(counted) == 1
    assert gunzip_one_stream(first) == gunzip_one_stream(second)
    registry.encode(encoder, content_type, False)  # another compression: its own encoding
    text_encoder, text_type = choose_encoder("text/plain")
    registry.encode(text_encoder, text_type, True)  # another format: its own
    assert len(counted) == 3
    registry.encode(encoder, content_type, True)  # and the first one is still kept
    assert len(counted) == 3


def test_new_readings_are_encoded_again(tmp_path, counted):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=2)
    collector = scen.collector()
    registry = build_registry(collector, process=False)
    encoder, content_type = choose_encoder(OPENMETRICS)
    before = gunzip_one_stream(registry.encode(encoder, content_type, True)).decode()
    scen.nvml.gpus[0].memory_used += 1 << 20
    after = gunzip_one_stream(registry.encode(encoder, content_type, True)).decode()
    assert len(counted) == 2

    def used(text: str) -> float:
        return float(next(l for l in text.splitlines() if l.startswith("mps_gpu_memory_used_bytes{")).split()[-1])

    assert used(after) - used(before) == 1 << 20


def test_the_exporters_own_series_are_fresh_in_every_scrape(tmp_path, counted):
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1)
    collector = scen.collector()
    registry = build_registry(collector, process=False)
    encoder, content_type = choose_encoder(OPENMETRICS)
    snap = collector.snapshot()
    collector.collection = lambda: snap  # type: ignore[method-assign]
    registry.encode(encoder, content_type, False)
    snap.outcomes["nvml"].success = False
    text = registry.encode(encoder, content_type, False).decode()
    assert len(counted) == 1
    assert 'mps_exporter_collector_success{collector="nvml"} 0' in text


def test_a_waiting_client_ages_in_a_reused_exposition(tmp_path):
    from mps_exporter.model import LogSnapshot, PendingClient
    from mps_exporter.render import readings_key

    snap = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1).collector().snapshot()
    key = readings_key(snap, "client")
    snap.now += 5
    assert readings_key(snap, "client") == key  # nobody waits: the clock does not matter
    snap.logs["default"] = LogSnapshot(pending=[PendingClient(1, 1000, "user_switch", snap.now - 3)])
    key = readings_key(snap, "client")
    snap.now += 5
    assert readings_key(snap, "client") != key


def test_the_control_command_count_is_the_exporters_own_series_not_a_reading(tmp_path):
    from mps_exporter.render import readings_key

    collector = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1).collector()
    first, second = collector.snapshot(), collector.snapshot()  # every scrape sends commands (no logs here)
    assert first.daemons[0].commands_sent != second.daemons[0].commands_sent
    assert first.daemons == second.daemons  # so readings_key, which holds them, stays the same
    second.nvml, second.processes = first.nvml, first.processes  # (NVML's GPM starts in the first read)
    assert readings_key(first, "client") == readings_key(second, "client")
    registry = build_registry(collector, process=False)
    encoder, content_type = choose_encoder(OPENMETRICS)
    sent = [registry.encode(encoder, content_type, False).decode() for _ in range(2)]
    counts = [next(l for l in text.splitlines() if l.startswith('mps_exporter_control_commands_total{command="get_server_list"'))
              for text in sent]
    assert counts[0] != counts[1]  # fresh in every scrape though the readings' part is reused


def test_where_readings_changed_only_the_changed_series_are_written_again(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3)
    collector = scen.collector()
    registry = build_registry(collector, process=False)
    real, content_type = choose_encoder(OPENMETRICS)
    encoded: List[List[str]] = []

    def encoder(families: Any) -> bytes:
        encoded.append([f.name for f in families.collect()])
        return real(families)

    snap = collector.snapshot()
    collector.collection = lambda: snap  # type: ignore[method-assign]
    first = registry.encode(encoder, content_type, False).decode()
    readings = [names for names in encoded if len(names) == 1]
    assert len(readings) > 20  # one encoding per family the first time
    encoded.clear()
    snap.nvml = copy.deepcopy(snap.nvml)  # a new reading, as every read returns
    snap.nvml.gpus[0].memory_used_bytes += 1 << 20
    second = registry.encode(encoder, content_type, False).decode()
    assert encoded == []  # the series was in the last encoding: its line is kept, its value new
    changed = sorted(set(second.splitlines()) - set(first.splitlines()))
    assert len(changed) == 1 and changed[0].startswith('mps_gpu_memory_used_bytes{gpu="0"')


def _client_samples(text: str) -> List[str]:
    return sorted(l for l in text.splitlines() if l.startswith("mps_client_"))


def test_a_clients_series_are_reused_while_its_inputs_stay_and_redone_when_one_moves(tmp_path, monkeypatch):
    import mps_exporter.render as render_module

    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=3)
    collector = scen.collector()
    registry = build_registry(collector, process=False)
    encoder, content_type = choose_encoder(OPENMETRICS)
    rendered: List[int] = []
    real = render_module._render_client

    def counting(c: Any, *args: Any) -> Any:
        rendered.append(c.pid)
        return real(c, *args)

    monkeypatch.setattr(render_module, "_render_client", counting)
    first = registry.encode(encoder, content_type, False).decode()
    assert len(rendered) == 3
    scen.nvml.gpus[0].util_gpu += 40  # the GPU's numbers move, the clients' do not
    second = registry.encode(encoder, content_type, False).decode()
    assert first != second and len(rendered) == 3
    assert _client_samples(second) == _client_samples(first)

    pid = scen.nvml.gpus[0].mps_processes[0].pid
    scen.nvml.gpus[0].mps_processes[0].usedGpuMemory += 1 << 20  # one client's memory moves
    third = registry.encode(encoder, content_type, False).decode()
    assert rendered[3:] == [pid]  # that client alone
    line = next(l for l in third.splitlines() if l.startswith("mps_client_memory_used_bytes{") and f'pid="{pid}"' in l)
    before = next(l for l in first.splitlines() if l.startswith("mps_client_memory_used_bytes{") and f'pid="{pid}"' in l)
    assert float(line.split()[-1]) - float(before.split()[-1]) == 1 << 20


def _families(snap: Any, memo: Any = None) -> List[Any]:
    from mps_exporter.render import FamilyBuilder, render_readings

    out = FamilyBuilder()
    render_readings(out, snap, "client", (), memo)
    return out.families()


def test_a_daemon_s_very_same_client_rows_render_as_fresh_even_where_the_gpus_uuids_moved(tmp_path):
    """The memo gives a daemon's client families at once for the very rows it rendered
    last (the join keeps the tuple): equal to a render without it, the UUIDs included."""
    from mps_exporter.join import rows_of
    from mps_exporter.render import ClientTableMemo, FamilyBuilder

    rows = rows_of(scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3).collector().snapshot())
    d, memo = rows.daemons[0], ClientTableMemo()

    def render(uuids, with_memo):
        out = FamilyBuilder()
        (memo if with_memo else ClientTableMemo()).render_clients(out, d, uuids)
        return [(name, [(s.labels, s.value) for s in samples]) for name, samples in out.parts()]

    moved = {**rows.uuids, 1: "GPU-ffffffff-0000-0000-0000-000000000000"}
    for uuids in (rows.uuids, rows.uuids, moved, moved, rows.uuids):
        assert render(uuids, True) == render(uuids, False)
    assert any(s[0]["uuid"] == moved[1] for name, samples in render(moved, True) for s in samples if "uuid" in s[0])


def test_the_client_memo_renders_what_a_fresh_render_does_whatever_input_moves(tmp_path):
    """Every input render_client reads, moved one after the other: with the memo the
    families are those of a render without it."""
    import dataclasses

    from mps_exporter.model import LogServer, LogSnapshot, ProcessMemory
    from mps_exporter.render import ClientTableMemo

    snap = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3).collector().snapshot()
    memo = ClientTableMemo()
    d = snap.daemons[0]
    pid, other = d.clients[0].pid, d.clients[1].pid
    gpu = next(g for g in snap.nvml.gpus if any(p.pid == pid for p in g.mps_clients))

    def set_memory(used: int) -> None:
        gpu.mps_clients = [ProcessMemory(p.pid, used if p.pid == pid else p.used_bytes) for p in gpu.mps_clients]

    moves = [
        lambda: None,
        lambda: setattr(snap.nvml.gpus[0], "utilization_ratio", 0.77),
        lambda: set_memory(5 << 30),
        lambda: snap.processes.__setitem__(pid, dataclasses.replace(  # the client's own limit
            snap.processes[pid], environ={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"})),
        lambda: setattr(d, "default_pinned_limits", {0: 3 << 30}),
        lambda: setattr(d, "default_client_priority", 1),
        lambda: setattr(d, "default_active_thread_percentage", 40.0),
        lambda: setattr(d.servers[0], "pinned_limits", {0: 4 << 30, 1: 4 << 30}),
        lambda: snap.logs.__setitem__(d.name, LogSnapshot(servers={d.servers[0].pid: LogServer(d.servers[0].pid, priority=1)},
                                                          client_start_times={pid: 1.7e9}, client_limits={other: (25.0, {0: 1 << 30})})),
        lambda: setattr(d, "clients", [c for c in d.clients if c.pid != other]),
        lambda: setattr(snap.nvml.gpus[1], "uuid", "GPU-ffffffff-0000-0000-0000-000000000000"),
    ]
    for step, move in enumerate(moves):
        move()
        # As a new collection would hand them over: every reading a new object (the moves
        # above change the old ones in place, which no source does).
        read = dataclasses.replace(snap, nvml=dataclasses.replace(snap.nvml),
                                   daemons=[dataclasses.replace(x) for x in snap.daemons],
                                   processes=dict(snap.processes),
                                   logs={k: dataclasses.replace(v) for k, v in snap.logs.items()})
        assert _families(read, memo) == _families(read), f"move {step}"



# ---------------------------------------------------------------- line by line reuse
ACCEPTS = [OPENMETRICS, "text/plain", "text/plain;version=1.0.0;escaping=allow-utf-8",
           "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8"]


def _plain(encoder: Any, families: List[Any]) -> bytes:
    """client_python's own encoding of the families, nothing reused."""
    return encoder(type("Plain", (), {"collect": lambda self: families})())


def _arrive(scen: Any, pid: int, gpu: int = 0) -> None:
    from tests.fakes.fake_control import FakeClient
    from tests.fakes.fake_procfs import FakeProcess, write_proc
    from tests.fakes.fake_pynvml import FakeProcess as NvmlProcess

    g = scen.nvml.gpus[gpu]
    write_proc(scen.proc_root, [FakeProcess(pid, uid=1000 + pid % 7)])
    g.mps_processes = g.mps_processes + [NvmlProcess(pid, 300 << 20)]
    g.compute_processes = g.compute_processes + [NvmlProcess(pid, 300 << 20)]
    scen.daemon.clients = scen.daemon.clients + [FakeClient(pid, 4000, g.uuid, pid)]


def _leave(scen: Any, pid: int) -> None:
    for g in scen.nvml.gpus:
        g.mps_processes = [p for p in g.mps_processes if p.pid != pid]
        g.compute_processes = [p for p in g.compute_processes if p.pid != pid]
    scen.daemon.clients = [c for c in scen.daemon.clients if c.pid != pid]


def test_every_scrape_is_what_client_python_writes_for_its_families(tmp_path):
    """Through changing readings (values, clients arriving and leaving, the read duration
    histograms moving), in every format and compression, interleaved: the body is
    byte for byte client_python's encoding of the scrape's families."""
    from mps_exporter.render import render_readings, render_self
    from mps_exporter.sources.registry import own_renders

    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=4)
    collector = scen.collector()
    registry = build_registry(collector, process=False)
    gpu = scen.nvml.gpus[0]
    steps = [
        lambda: None,
        lambda: setattr(gpu.mps_processes[0], "usedGpuMemory", gpu.mps_processes[0].usedGpuMemory + (1 << 20)),
        lambda: setattr(gpu.mps_processes[1], "usedGpuMemory", 0),  # 0.0, then back
        lambda: setattr(gpu.mps_processes[1], "usedGpuMemory", 7 << 40),  # printed with an exponent
        lambda: _arrive(scen, 31000),
        lambda: (_arrive(scen, 31001, gpu=1), _arrive(scen, 31002)),
        lambda: _leave(scen, gpu.mps_processes[0].pid),
        lambda: (_leave(scen, 31001), setattr(gpu, "memory_used", gpu.memory_used + 12345)),
        lambda: setattr(gpu, "util_gpu", 0),
        lambda: _arrive(scen, 31001, gpu=1),  # back after a scrape away
        lambda: setattr(scen.daemon, "running", False),  # the daemon's families go
        lambda: setattr(scen.daemon, "running", True),  # and come back
    ]
    checked = 0
    for step in steps:
        step()
        scen.nvml.advance(1.0)
        snap = collector.snapshot()  # the read durations' histograms move in every one
        collector.collection = lambda snap=snap: snap  # type: ignore[method-assign]
        readings = FamilyBuilder()
        render_readings(readings, snap, "client", own_renders())
        own = FamilyBuilder()
        render_self(own, snap)
        families = readings.families() + own.families()
        for accept in ACCEPTS:
            encoder, content_type = choose_encoder(accept)
            for zipped in (True, False):
                body = registry.encode(encoder, content_type, zipped)
                assert (gunzip_one_stream(body) if zipped else body) == _plain(encoder, families), (accept, zipped)
                checked += 1
    assert checked == len(steps) * len(ACCEPTS) * 2


def _odd_families(step: int) -> List[Any]:
    """Families of every type and shape client_python writes, moving with `step`: new
    and vanished series, zeros of both signs, NaN, infinities, escaped label values,
    counters and histograms with `_created` (the classic format moves those to families
    of their own), samples with timestamps and exemplars (never reused by line)."""
    from prometheus_client.core import (CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily,
                                        HistogramMetricFamily, InfoMetricFamily, StateSetMetricFamily,
                                        SummaryMetricFamily)
    from prometheus_client.samples import Exemplar, Sample, Timestamp

    values = [0.0, -0.0, 1.0, float("nan"), float("inf"), -2.5, 1e22, 123456789.0, 3]
    g = GaugeMetricFamily("odd_gauge", 'Help with "quotes", \\ and\nnewline.', labels=["k", "v"])
    for i in range(6):
        if (i + step) % 4:  # one series in four missing, a different one each step
            g.add_metric([f"s{i}", ['pl"ain', "back\\slash", "new\nline", "ünï", "cr\rx", ""][i]],
                         values[(i * step) % len(values)])
    c = CounterMetricFamily("odd_requests", "Counter.", labels=["path"], created=1.7e9 if step % 2 else None)
    c.add_metric(["/a"], step * 1.5, created=1.7e9 + step if step % 3 else None)
    c.add_metric(["/b"], 7.0)
    h = HistogramMetricFamily("odd_seconds", "Histogram.", labels=["op"], unit="seconds")
    h.add_metric(["x"], [("0.1", step % 3), ("1.0", 4 + step % 2), ("+Inf", 6)], 3.25 + step % 2)
    if step % 2:
        h.add_metric(["y"], [("+Inf", step)], 0.5)
    gh = GaugeHistogramMetricFamily("odd_queue", "Gauge histogram.", buckets=[("1.0", step % 2), ("+Inf", 3)],
                                    gsum_value=2.0)
    s = SummaryMetricFamily("odd_summary", "Summary.", count_value=step, sum_value=step / 3)
    info = InfoMetricFamily("odd_build", "Info.", value={"version": f"1.{step % 2}"})
    state = StateSetMetricFamily("odd_state", "State set.", value={"on": step % 2 == 0, "off": step % 2 == 1})
    stamped = GaugeMetricFamily("odd_stamped", "Timestamps.", labels=["k"])
    stamped.add_metric(["t"], step, timestamp=1.7e9 + step if step % 2 else Timestamp(1700000000, step))
    stamped.add_metric(["u"], 1.0)
    ex = CounterMetricFamily("odd_exemplar", "Exemplars.", labels=["k"])
    ex.samples.append(Sample("odd_exemplar_total", {"k": "e"}, float(step), None, Exemplar({"trace": "abc"}, 0.5)))
    help_changes = GaugeMetricFamily("odd_help", "First help." if step < 3 else "Second help.", value=1.0)
    return [g, c, h, gh, s, info, state, stamped, ex, help_changes][step % 2:] if step % 5 == 4 else \
        [g, c, h, gh, s, info, state, stamped, ex, help_changes]


@pytest.mark.parametrize("accept", ACCEPTS)
def test_reused_lines_are_what_client_python_writes_for_any_family(accept):
    encoder, _ = choose_encoder(accept)
    families_encoder = collector_module._FamilyEncoder(encoder)
    assert families_encoder.by_line
    for step in range(12):
        families = _odd_families(step)
        assert families_encoder.encode(families) + families_encoder.trailer == _plain(encoder, families), step
        kept = families_encoder._last
        assert set(kept) == {f.name for f in families}  # the last encoding's families alone
        for family in families:
            if kept[family.name].prefixes is not None:  # and their series alone
                assert set(kept[family.name].prefixes) == {(s.name, tuple(s.labels.items())) for s in family.samples}


def test_a_format_whose_lines_are_not_prefix_and_value_is_reused_only_whole():
    from prometheus_client.openmetrics.exposition import generate_latest

    def integers(registry: Any) -> bytes:  # a format that spells 1.0 as 1
        return generate_latest(registry).replace(b".0\n", b"\n")

    from prometheus_client.core import GaugeMetricFamily

    families_encoder = collector_module._FamilyEncoder(integers)
    assert not families_encoder.by_line
    for step in range(6):
        families = [GaugeMetricFamily("odd_halves", "1.5, 2.0, 2.5, ...", value=1.5 + step / 2)] + _odd_families(step)
        assert families_encoder.encode(families) + families_encoder.trailer == _plain(integers, families), step


def test_the_client_memo_renders_what_a_fresh_render_does_whatever_row_field_moves(tmp_path):
    """Every field of a client row moved in turn, READING or not: the memo's families are
    those of a render without it (a family that reads a READING field must be emitted by
    emit_client_readings, or this fails)."""
    import dataclasses
    from typing import Mapping

    from mps_exporter.families import FamilyBuilder
    from mps_exporter.join import ClientRow, join
    from mps_exporter.render import ClientTableMemo, render_rows

    rows = join(scenarios.busy(tmp_path).collector().snapshot())

    def moved(v: Any) -> Any:
        if isinstance(v, bool) or v is None:
            return 1
        if isinstance(v, (int, float)):
            return v + 1
        if isinstance(v, str):
            return v + "x"
        if isinstance(v, Mapping):
            return {k: (w + 1 if isinstance(w, (int, float)) else w + "x") for k, w in v.items()} or {0: 1}
        return tuple(v) + (1,)

    def families(r: Any, memo: Any) -> List[Any]:
        out = FamilyBuilder()
        render_rows(out, r, "client", memo)
        return out.families()

    checked = 0
    for f in dataclasses.fields(ClientRow):
        if f.name == "daemon":
            continue
        memo = ClientTableMemo()
        families(rows, memo)
        (d,) = rows.daemons
        c = d.clients[1]
        variant = dataclasses.replace(rows, daemons=(dataclasses.replace(d, clients=(
            d.clients[0], dataclasses.replace(c, **{f.name: moved(getattr(c, f.name))}), *d.clients[2:])),))
        assert families(variant, memo) == families(variant, None), f.name
        checked += 1
    assert checked >= 20


def test_a_client_whose_memory_moved_to_another_gpu_is_rendered_anew():
    """Only values moved is a shortcut (the last samples' labels, new values); the same
    number of memory series on another GPU is not that."""
    import dataclasses

    from mps_exporter.join import ClientRow, DaemonRow
    from mps_exporter.limits import LIMITS
    from mps_exporter.render import ClientTableMemo, FamilyBuilder

    uuids = {0: "GPU-0", 1: "GPU-1"}
    row = ClientRow("default", 42, 7, 1000, "alice", "python3", "4026531836", "", "", "", "", "", "",
                    memory_used_bytes={0: 1 << 30}, gpus=(0,), pinned_memory_limit_bytes={0: 2 << 30, 1: 2 << 30},
                    limit_sources={limit: "none" for limit in LIMITS})
    daemon = DaemonRow("default", True, "13000", "/tmp/p", "/tmp/l", "", None, None, {}, None, (), (row,))
    memo = ClientTableMemo()

    def memory(r: ClientRow) -> dict:
        out = FamilyBuilder()
        memo.render_clients(out, dataclasses.replace(daemon, clients=(r,)), uuids)
        return {(name, s.labels["gpu"]): s.value for name, samples in out.parts() for s in samples
                if name in ("mps_client_memory_used_bytes", "mps_client_pinned_memory_usage_ratio")}

    assert memory(row) == {("mps_client_memory_used_bytes", "0"): 1 << 30,
                           ("mps_client_pinned_memory_usage_ratio", "0"): 0.5}
    moved = dataclasses.replace(row, memory_used_bytes={0: 3 << 29})
    assert memory(moved) == {("mps_client_memory_used_bytes", "0"): 3 << 29,
                             ("mps_client_pinned_memory_usage_ratio", "0"): 0.75}
    elsewhere = dataclasses.replace(row, memory_used_bytes={1: 1 << 29})
    assert memory(elsewhere) == {("mps_client_memory_used_bytes", "1"): 1 << 29,
                                 ("mps_client_pinned_memory_usage_ratio", "1"): 0.25}


def _own_families(snap: Any) -> List[Any]:
    from mps_exporter.render import render_self

    own = FamilyBuilder()
    render_self(own, snap)
    return own.families()


@pytest.mark.parametrize("accept", ACCEPTS)
def test_the_own_series_are_written_into_their_last_text_while_the_series_stay(tmp_path, monkeypatch, accept):
    """Values moving every scrape, series hardly ever: samples and client_python's encoder
    only where the series changed, and every scrape's own text client_python's bytes."""
    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1)
    collector = scen.collector()
    encoder, _ = choose_encoder(accept)
    own = collector_module._OwnSeries(collector_module._FamilyEncoder(encoder))
    built: List[int] = []
    real = collector_module.FamilyBuilder

    def counting() -> Any:
        built.append(1)
        return real()

    monkeypatch.setattr(collector_module, "FamilyBuilder", counting)
    snaps = [collector.snapshot() for _ in range(4)]
    snaps[2].outcomes["nvml"].duration_seconds = 1234567.5  # a value client_python writes with an exponent
    for snap in snaps:
        assert own.encode(snap) == b"".join(_plain(encoder, [f]).replace(b"# EOF\n", b"") for f in _own_families(snap))
    assert len(built) == 1  # the first scrape's series: rendered as samples once, checked against the encoder
    snaps[3].outcomes["nvml"].duration_seconds = None  # a series goes: the series changed
    assert own.encode(snaps[3]) == b"".join(
        _plain(encoder, [f]).replace(b"# EOF\n", b"") for f in _own_families(snaps[3]))
    assert len(built) == 2


def test_own_series_in_a_format_whose_lines_are_not_prefix_and_value_are_encoded_whole(tmp_path):
    from prometheus_client.openmetrics.exposition import generate_latest

    def integers(registry: Any) -> bytes:  # a format that spells 1.0 as 1
        return generate_latest(registry).replace(b".0\n", b"\n")

    collector = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=1).collector()
    own = collector_module._OwnSeries(collector_module._FamilyEncoder(integers))
    for _ in range(3):
        snap = collector.snapshot()
        assert own.encode(snap) == b"".join(_plain(integers, [f]).replace(b"# EOF\n", b"")
                                            for f in _own_families(snap))
    assert own._kept is not None and own._kept.parts is None


def test_a_recorder_keeps_a_family_builders_series_in_its_order_and_skips_what_it_skips():
    from mps_exporter.families import SeriesRecorder

    def render(out: Any, value: Any) -> None:
        out.add("mps_exporter_collector_success", 1, collector="nvml")
        out.add("mps_exporter_collector_duration_seconds", value, collector="nvml")
        out.add_histogram("mps_exporter_collector_read_duration_seconds", [(0.1, 2), (float("inf"), 3)], 0.75,
                          collector="nvml")
        out.add("mps_exporter_collector_success", 0, collector="proc")

    shapes = []
    for value in (0.5, None, float("nan"), 2):
        recorded, built = SeriesRecorder(), FamilyBuilder()
        render(recorded, value)
        render(built, value)
        assert recorded.values() == [s.value for f in built.families() for s in f.samples]
        shapes.append(recorded.shape())
    assert shapes[0] == shapes[3] and shapes[1] == shapes[2] and shapes[0] != shapes[1]
