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


def test_where_readings_changed_only_the_changed_families_are_encoded_again(tmp_path):
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
    again = [names[0] for names in encoded if len(names) == 1]
    assert again == ["mps_gpu_memory_used_bytes"]
    changed = sorted(set(second.splitlines()) - set(first.splitlines()))
    assert len(changed) == 1 and changed[0].startswith('mps_gpu_memory_used_bytes{gpu="0"')


def _client_samples(text: str) -> List[str]:
    return sorted(l for l in text.splitlines() if l.startswith("mps_client_"))


def test_the_client_table_is_reused_while_its_inputs_stay_and_redone_when_one_moves(tmp_path, monkeypatch):
    import mps_exporter.render as render_module

    scen = scenarios.synthetic(tmp_path, gpus=1, clients_per_gpu=3)
    collector = scen.collector()
    registry = build_registry(collector, process=False)
    encoder, content_type = choose_encoder(OPENMETRICS)
    tables: List[int] = []
    real = render_module.render_clients

    def counting(*args: Any, **kwargs: Any) -> None:
        tables.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(render_module, "render_clients", counting)
    first = registry.encode(encoder, content_type, False).decode()
    scen.nvml.gpus[0].util_gpu += 40  # the GPU's numbers move, the clients' do not
    second = registry.encode(encoder, content_type, False).decode()
    assert first != second and len(tables) == 1
    assert _client_samples(second) == _client_samples(first)

    pid = scen.nvml.gpus[0].mps_processes[0].pid
    scen.nvml.gpus[0].mps_processes[0].usedGpuMemory += 1 << 20  # one client's memory moves
    third = registry.encode(encoder, content_type, False).decode()
    assert len(tables) == 2
    plain = render_module.FamilyBuilder()  # the same readings without the memo
    render_module.render_readings(plain, collector.snapshot(), "client")
    memory = next(f for f in plain.families() if f.name == "mps_client_memory_used_bytes")
    expected = next(s.value for s in memory.samples if s.labels["pid"] == str(pid))
    line = next(l for l in third.splitlines() if l.startswith("mps_client_memory_used_bytes{") and f'pid="{pid}"' in l)
    assert float(line.split()[-1]) == expected
