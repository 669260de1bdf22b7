"""Every declaration reaches the catalog, and README's metric table and docs/labels.md are
generated from it by docs/generate.py (`make generate`), not pasted and compared."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Tuple

import pytest

from mps_exporter import catalog, contract
from mps_exporter.contract import FIXED, INPUT, Label, counter, gauge
from mps_exporter.sources.registry import SOURCES

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
    for rel in ("README.md", "docs/labels.md", "docs/performance.md"):
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


def _flag_rows(markdown: str) -> Dict[str, Tuple[str, str]]:
    """The table's first flag of each row -> (default, meaning)."""
    rows = {}
    for line in markdown.splitlines()[2:]:
        flags, default, meaning = line[2:-2].split(" | ", 2)
        rows[flags.split(", ")[0].strip("`")] = (default, meaning)
    return rows


def test_readme_global_flags_are_the_parsers_with_the_config_defaults():
    from mps_exporter.cli import DEFAULTS, build_parser

    rows = _flag_rows(docs_generator().global_flags_markdown())
    serve = build_parser().serve_parser
    assert serve is not None
    by_flag = {action.option_strings[0]: action for action in serve._actions if action.option_strings}
    # Every global flag of serve has its row, and no source's flag (the table below has those).
    assert "--web.listen-address" in rows and "--log.level" in rows and "--collector.control-wait" in rows
    assert "--mps.command-timeout" not in rows and "--collector.nvml" not in rows and "--help" not in rows
    assert {f for f in by_flag if not f.startswith("--no-") and f != "-h"} - set(rows) <= {
        flag.name for source in SOURCES.values() for flag in source.flags} | {f"--collector.{n}" for n in SOURCES}
    assert rows["--web.listen-address"][0] == f"`{DEFAULTS.listen_address}`"
    assert rows["--collector.control-wait"][0] == f"`{DEFAULTS.control_wait:g}`"
    assert rows["--mps.exit-status"][0] == ("on" if DEFAULTS.exit_status else "off")
    assert rows["--web.systemd-socket"][0] == "off" and rows["--config.file"][0] == "none"
    assert rows["--log.level"][1] == "`debug`, `info`, `warn`, `error`"  # the parser's choices


def test_a_new_global_flag_and_a_changed_default_reach_the_readme(monkeypatch: pytest.MonkeyPatch):
    import dataclasses

    from mps_exporter import cli

    add_web = cli._add_web

    def with_example(p: Any) -> None:
        add_web(p)
        p.add_argument("--web.example-limit", dest="example_limit", type=int, default=3,
                       help="an example's limit (0: none; default %(default)s)")

    monkeypatch.setattr(cli, "_add_web", with_example)
    monkeypatch.setattr(cli, "DEFAULTS", dataclasses.replace(cli.DEFAULTS, max_requests=7))
    rows = _flag_rows(docs_generator().global_flags_markdown())
    assert rows["--web.example-limit"] == ("`3`", "an example's limit (0: none)")
    assert rows["--web.max-requests"][0] == "`7`"


def test_readme_text_for_a_flag_that_is_gone_fails_the_generator(monkeypatch: pytest.MonkeyPatch):
    generate = docs_generator()
    monkeypatch.setitem(generate.FLAG_DOCS, "--web.gone", "a flag that was removed")
    with pytest.raises(SystemExit, match="no such flag of serve: --web.gone"):
        generate.global_flags_markdown()
