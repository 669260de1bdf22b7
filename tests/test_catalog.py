"""Every declaration reaches the catalog, and README's metric table and docs/labels.md are
generated from it by docs/generate.py (`make generate`), not pasted and compared."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

from mps_exporter import catalog, contract
from mps_exporter.contract import FIXED, INPUT, Label, counter, gauge

ROOT = Path(__file__).resolve().parents[1]


def docs_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_declared_metric_is_in_the_catalog_in_table_order():
    assert set(catalog.METRICS) == set(contract.DECLARED)
    titles = [spec.table for spec in catalog.METRICS.values()]
    assert titles[0] == "GPU" and titles[-1] == "The exporter itself"
    assert titles == sorted(titles, key=titles.index), "a table's metrics are listed together"


def test_the_committed_blocks_are_what_the_generator_writes():
    assert docs_generator().main(["--check"]) == 0, "run `make generate`"


def test_readme_table_and_labels_doc_are_written_from_the_declarations(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    for rel in ("README.md", "docs/labels.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    readme_before = (tmp_path / "README.md").read_text()
    # A hand edit inside a block is overwritten; a new declaration appears in both files.
    (tmp_path / "README.md").write_text(readme_before.replace("| Power draw. |", "| hand-edited |"))
    fan = Label("fan", FIXED, "the example's fan names", "front, back")
    blade = Label("blade", INPUT, "an example input", "a test's own")
    for spec in contract.table("Example fans", gauge("mps_example_fan_rpm", "Fan speed.", fan),
                               counter("mps_example_fan_stalls_total", "Fan stalls.", fan, blade)):
        monkeypatch.setitem(catalog.METRICS, spec.name, spec)
        monkeypatch.setitem(contract.DECLARED, spec.name, spec)
    generate = docs_generator()
    assert generate.main([], root=tmp_path) == 0
    assert generate.main(["--check"], root=tmp_path) == 0
    readme = (tmp_path / "README.md").read_text()
    labels_doc = (tmp_path / "docs" / "labels.md").read_text()
    assert "| Power draw. |" in readme and "hand-edited" not in readme
    assert "### Example fans\n\n| name | type | labels | meaning |" in readme
    assert "| mps_example_fan_stalls_total | counter | fan, blade | Fan stalls. |" in readme
    assert ("| fan | mps_example_fan_rpm, mps_example_fan_stalls_total | fixed | the example's fan names "
            "| front, back |") in labels_doc
    assert "| blade | mps_example_fan_stalls_total | input | an example input | a test's own |" in labels_doc
    # Only the blocks change: the prose around them is the committed one.
    assert readme.split("<!-- metrics:begin -->")[0] == readme_before.split("<!-- metrics:begin -->")[0]
    assert readme.split("<!-- metrics:end -->")[1] == readme_before.split("<!-- metrics:end -->")[1]


def test_a_file_without_its_block_is_a_clear_error(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("no block here\n")
    shutil.copy(ROOT / "docs" / "labels.md", tmp_path / "docs" / "labels.md")
    with pytest.raises(SystemExit, match="README.md: expected one <!-- metrics:begin -->"):
        docs_generator().main([], root=tmp_path)


def test_the_collector_label_names_the_registered_sources():
    from mps_exporter.sources.registry import SOURCES

    row = next(line for line in catalog.labels_markdown().splitlines() if line.startswith("| collector |"))
    assert row.endswith(f"| {', '.join(SOURCES)} |")
