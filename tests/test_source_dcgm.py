"""The DCGM source against a double of DCGM's bindings written to a temporary
bindings directory, so the import-path logic runs for real."""

import math
import sys

import pytest

from mps_exporter.config import DEFAULT_DCGM_BINDINGS
from mps_exporter.sources import dcgm
from mps_exporter.sources.dcgm import FIELD_GROUP_NAME, DcgmClient, DcgmUnavailable, is_blank
from tests.fakes import fake_dcgm as fd

UUIDS = {0: "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70", 1: "GPU-00000001-0000-4000-8000-000000000001"}


@pytest.fixture(autouse=True)
def clean_imports(monkeypatch):
    """Each test imports the bindings afresh and leaves sys.path as it found it."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in fd.BINDING_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    for name in fd.BINDING_MODULES:
        sys.modules.pop(name, None)


@pytest.fixture
def engine():
    return fd.FakeHostengine(gpus=dict(UUIDS), values={
        0: {1002: 0.93, 1003: 0.41, 1004: 0.0, 1005: 0.12},
        1: {1002: 0.25, 1003: 0.10, 1004: 0.5, 1005: 0.75},
    })


def source_on(tmp_path, engine, version=4, **kwargs):
    """Bindings installed in the second of two default-like paths (the first is empty)."""
    missing = tmp_path / "dcgm3" / "bindings" / "python3"
    bindings = fd.install_bindings(tmp_path / "dcgm4" / "bindings" / "python3", engine, version=version)
    return DcgmClient([str(missing), str(bindings)], **kwargs), bindings


# -------------------------------------------------------------- availability
def test_default_paths_are_the_dcgm3_and_dcgm4_locations():
    assert DcgmClient().bindings_paths == DEFAULT_DCGM_BINDINGS == (
        "/usr/local/dcgm/bindings/python3", "/usr/share/datacenter-gpu-manager-4/bindings/python3")


def test_unavailable_without_bindings(tmp_path):
    source = DcgmClient([str(tmp_path / "nowhere"), str(tmp_path)])
    assert source.available() is False
    assert "no DcgmReader.py" in source.unavailable_reason
    with pytest.raises(DcgmUnavailable, match="bindings not found"):
        source.read()


def test_broken_install_is_unavailable_and_leaves_sys_path_alone(tmp_path, engine):
    broken = fd.install_bindings(tmp_path / "broken", engine, broken=True)
    before = list(sys.path)
    source = DcgmClient([str(broken)])
    assert source.available() is False
    assert "pydcgm" in source.unavailable_reason
    assert sys.path == before


def test_available_from_the_second_path_which_goes_on_sys_path(tmp_path, engine):
    source, bindings = source_on(tmp_path, engine)
    assert str(bindings) not in sys.path
    assert source.available() is True
    # The bindings import their siblings by plain name: the directory is on the path.
    assert str(bindings) in sys.path and sys.modules["dcgm_structs"].__file__.startswith(str(bindings))
    assert engine.connections == []  # importing does not connect


def test_reader_factory_makes_it_available_without_bindings(engine):
    cls = type("R", (fd.FakeDcgmReader,), {"engine": engine})
    assert DcgmClient([], reader_factory=cls).available() is True


# ----------------------------------------------------------------- reading
@pytest.mark.parametrize("version", [3, 4])
def test_reads_profiling_fields_by_number(tmp_path, engine, version):
    source, _ = source_on(tmp_path, engine, version=version)
    activity = source.read()
    expected = {gpu: {"sm_active": f[1002], "sm_occupancy": f[1003], "tensor_active": f[1004], "dram_active": f[1005]}
                for gpu, f in engine.values.items()}
    assert activity == expected
    # What the reader was asked for: fields 1002-1005, our own field group, nv-hostengine on localhost.
    assert engine.field_groups == {FIELD_GROUP_NAME: [1002, 1003, 1004, 1005]}
    assert engine.connections == ["localhost"]
    assert engine.watches == [{"interval_us": 10_000_000, "maxKeepAge": 60.0, "fieldIds": [1002, 1003, 1004, 1005]}]


def test_update_interval_and_hostname_are_passed_on(tmp_path, engine):
    source, _ = source_on(tmp_path, engine, hostname="127.0.0.1:5555", update_interval_seconds=1.5)
    source.read()
    assert engine.connections == ["127.0.0.1:5555"]
    assert engine.watches[0]["interval_us"] == 1_500_000


@pytest.mark.parametrize("version", [3, 4])
def test_blank_values_are_skipped(tmp_path, engine, version):
    engine.values[0] = {1002: 0.5, 1003: fd.DCGM_FP64_BLANK, 1004: fd.DCGM_FP64_NOT_SUPPORTED}  # 1005: no data
    source, _ = source_on(tmp_path, engine, version=version)
    assert source.read()[0] == {"sm_active": 0.5}


def test_blanks_a_reader_hands_through_are_skipped_by_the_source(engine):
    """DCGM 4.x with ignoreBlank=False returns the sentinels as values."""
    engine.values[1] = {1002: fd.DCGM_FP64_NOT_FOUND, 1003: 0.2, 1004: fd.DCGM_FP64_NOT_PERMISSIONED,
                        1005: fd.DCGM_FP64_BLANK}
    cls = type("DcgmReader", (fd.FakeDcgmReader,), {"engine": engine})
    reader = cls(fieldIds=[1002, 1003, 1004, 1005], ignoreBlank=False)
    assert reader.GetLatestGpuValuesAsFieldIdDict()[1][1002] == fd.DCGM_FP64_NOT_FOUND  # the double really passes it
    source = DcgmClient([], reader_factory=lambda **kw: cls(ignoreBlank=False, **kw))
    assert source.read()[1] == {"sm_occupancy": 0.2}


def test_dcgm3_reader_rejects_ignore_blank_so_the_source_must_not_pass_it(engine):
    cls = type("DcgmReader", (fd.DcgmReader3,), {"engine": engine})
    with pytest.raises(TypeError):
        cls(ignoreBlank=False)


@pytest.mark.parametrize("value, blank", [
    (fd.DCGM_FP64_BLANK, True), (fd.DCGM_FP64_NOT_FOUND, True), (fd.DCGM_FP64_NOT_SUPPORTED, True),
    (fd.DCGM_INT64_BLANK, True), (fd.DCGM_INT64_NOT_FOUND, True), (fd.DCGM_STR_BLANK, True),
    (fd.DCGM_STR_NOT_SUPPORTED, True), (None, True), (math.nan, True), (math.inf, True),
    (0.0, False), (1.0, False), (0.5, False), (0, False), (1, False),
])
def test_is_blank(value, blank):
    assert is_blank(value) is blank


# ---------------------------------------------------------------- failures
def test_hostengine_down_fails_clearly_then_recovers(tmp_path, engine, caplog):
    engine.running = False
    source, _ = source_on(tmp_path, engine)
    with pytest.raises(DcgmUnavailable, match="nv-hostengine running at localhost"):
        source.read()
    assert "Can't connection to nv-hostengine" in caplog.text  # the reader's own log line
    engine.running = True
    assert source.read()[0]["sm_active"] == 0.93


def test_hostengine_restart_costs_one_scrape(tmp_path, engine):
    source, _ = source_on(tmp_path, engine)
    source.read()
    engine.restart()  # the reader's handle is stale now
    with pytest.raises(DcgmUnavailable):
        source.read()
    engine.values[0][1002] = 0.5
    assert source.read()[0]["sm_active"] == 0.5
    assert len(engine.connections) == 2


def test_other_dcgm_errors_become_dcgm_unavailable(tmp_path, engine):
    engine.library_present = False
    source, _ = source_on(tmp_path, engine)
    with pytest.raises(DcgmUnavailable, match="DCGM read failed: DCGMError"):
        source.read()


def test_close_shuts_the_reader_down(tmp_path, engine):
    source, _ = source_on(tmp_path, engine)
    source.read()
    reader = source._reader
    source.close()
    assert reader.m_dcgmHandle is None
    source.read()  # a fresh reader connects again
    assert len(engine.connections) == 2


def test_activity_from_values_ignores_other_fields():
    values = {0: {150: 60, 1001: 0.9, 1002: 0.3}, 3: {}}
    assert dcgm.activity_from_values(values) == {0: {"sm_active": 0.3}, 3: {}}
