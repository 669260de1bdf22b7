"""The docs name only declared metrics and document every flag (README's metric table itself
is generated from the declarations: tests/test_catalog.py)."""

import re
from pathlib import Path

from mps_exporter.catalog import METRICS
from mps_exporter.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "alerts" / "runbook.md", *sorted((ROOT / "docs").glob("*.md"))]
# Words of the mps_ shape that name Python modules, not metrics.
MODULE_NAMES = {"mps_exporter", "mps_control"}
SERIES_SUFFIXES = ("", "_bucket", "_sum", "_count", "_created")


def test_every_metric_the_docs_name_is_in_the_contract():
    series = {name + suffix for name in METRICS for suffix in SERIES_SUFFIXES}
    for doc in DOCS:
        words = set(re.findall(r"(?<![\w:])(mps_[a-z0-9_]+)(?![\w:(])", doc.read_text()))
        unknown = words - series - MODULE_NAMES
        assert not unknown, f"{doc.relative_to(ROOT)} names metrics the contract lacks: {sorted(unknown)}"


def test_readme_documents_every_flag():
    readme = (ROOT / "README.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    flags = {opt for p in sub.choices.values() for a in p._actions for opt in a.option_strings
             if opt.startswith("--") and opt != "--help"}
    missing = sorted(f for f in flags if f not in readme
                     and re.sub(r"^--(no-)?collector\.\w+$", "--collector.<name>", f) not in readme)
    assert not missing, f"flags not documented in README: {missing}"


def test_the_layout_table_names_every_module_and_package():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Package layout", 1)[1].split("\n## ", 1)[0]
    first_cells = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `exporter/")]
    # `exporter/config.py`, `cli.py` -> config, cli; `exporter/sources/` -> sources
    named = {re.sub(r"^exporter/|\.py$|/$", "", name) for cell in first_cells for name in re.findall(r"`([^`]+)`", cell)}
    exporter = ROOT / "exporter"
    expected = {p.stem for p in exporter.glob("*.py") if p.stem != "__init__"}
    expected |= {p.name for p in exporter.iterdir() if (p / "__init__.py").exists()}
    assert sorted(expected - named) == [], "README's package layout leaves these out"
