"""Adding a source is one module: a `Source` in the registry gets its flag, is built,
read, rendered, recorded in a capture bundle and replayed, with no other file changed.

The example source is put into the registry the way a module of exporter/sources/
would be found there (registry.SOURCES), and taken out again afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterator, Optional

import pytest
from prometheus_client.exposition import generate_latest

from mps_exporter.bundle import BundleWriter, load
from mps_exporter.capture import Recorder, header
from mps_exporter.cli import parse_args
from mps_exporter.collector import build_registry
from mps_exporter.config import Config
from mps_exporter import contract
from mps_exporter.contract import FIXED, Label, gauge
from mps_exporter.families import FamilyBuilder
from mps_exporter.model import Snapshot
from mps_exporter.replay import Player
from mps_exporter.sources import registry
from mps_exporter.sources.base import Backends, ReadContext, Reader, Source
from mps_exporter.wiring import build_collector, build_readers


class ExampleSource(Source[Dict[str, float]]):
    """What exporter/sources/example.py would hold."""

    name = "example"
    help = "an example: fans by name"
    reading_type = Dict[str, float]

    def __init__(self) -> None:
        self.rpm = 1200.0

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[Dict[str, float]]]:
        def read(ctx: ReadContext) -> Dict[str, float]:
            return {"front": self.rpm}

        return Reader(read)

    def render(self, out: FamilyBuilder, snap: Snapshot) -> None:
        for fan, rpm in sorted((self.reading(snap) or {}).items()):
            out.add("mps_example_fan_rpm", rpm, fan=fan)


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> Iterator[ExampleSource]:
    source = ExampleSource()
    monkeypatch.setitem(registry.SOURCES, source.name, source)
    # What the module's `contract.table(...)` declares as it is imported (taken out again afterwards).
    spec = gauge("mps_example_fan_rpm", "Fan speed.", Label("fan", FIXED, "the example", "front"))
    monkeypatch.setitem(contract.DECLARED, spec.name, spec)
    yield source


def only_example() -> Config:
    cfg = Config()
    cfg.collectors.update({name: name == "example" for name in registry.SOURCES})
    return cfg


def text(readers: Dict[str, Reader[object]], clock=None) -> str:
    collector = build_collector(only_example(), readers, **({"clock": clock} if clock else {}))
    return generate_latest(build_registry(collector, process=False)).decode()


def test_the_source_gets_its_flags(example):
    assert parse_args(["dump", "--no-collector.example"])[1].collectors["example"] is False
    assert "example" not in build_readers(parse_args(["dump", "--no-collector.example"])[1])


def test_built_read_and_rendered(example):
    out = text(build_readers(only_example()))
    assert 'mps_example_fan_rpm{fan="front"} 1200.0' in out
    assert 'mps_exporter_collector_success{collector="example"} 1.0' in out


def test_recorded_and_replayed(example, tmp_path: Path):
    cfg = only_example()
    readers = build_readers(cfg)
    path = tmp_path / "example.jsonl.gz"
    writer = BundleWriter(str(path), header(cfg, readers, 1795234886.0))
    recorder = Recorder(cfg, readers, writer, clock=lambda: 1795234886.0, monotonic=lambda: 0.0)
    recorder.scrape()
    example.rpm = 900.0
    writer.close(recorder.end_record())
    bundle = load(str(path))
    assert bundle.header["sources"] == ["example"]
    player = Player(bundle, str(tmp_path / "logs"), monotonic=lambda: 0.0)
    replayed = text(player.readers(), clock=player.clock)
    assert 'mps_example_fan_rpm{fan="front"} 1200.0' in replayed  # the recorded reading, not today's 900


def test_every_module_of_the_sources_package_is_a_registered_source():
    modules = {p.stem for p in Path(registry.__file__).parent.glob("*.py")} - {"__init__", "base", "registry"}
    assert {type(s).__module__.rsplit(".", 1)[1] for s in registry.SOURCES.values()} == modules
    assert list(registry.SOURCES) == sorted(registry.SOURCES)  # flag help and collector order
