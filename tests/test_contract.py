"""The contract in code (exporter/contract.py), the README's table and the docs agree.

The contract started from a metrics document outside the project; since the project stands
alone, exporter/contract.py is the source and everything inside the repository is checked
against it.
"""

import re
from pathlib import Path

from mps_exporter.cli import build_parser
from mps_exporter.contract import METRICS, markdown_table

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "alerts" / "runbook.md", *sorted((ROOT / "docs").glob("*.md"))]
# Words of the mps_ shape that name Python modules, not metrics.
MODULE_NAMES = {"mps_exporter", "mps_control"}
SERIES_SUFFIXES = ("", "_bucket", "_sum", "_count", "_created")


def readme_rows():
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) == 4 and re.match(r"^mps_[a-z_]+$", cols[0]):
            rows[cols[0]] = (cols[1], {l.strip() for l in cols[2].split(",") if l.strip()})
    return rows


def test_readme_table_lists_every_contract_metric_with_its_type_and_labels():
    rows = readme_rows()
    assert set(rows) == set(METRICS)
    for name, spec in METRICS.items():
        mtype, labels = rows[name]
        assert mtype == spec.type, name
        assert labels == set(spec.labels), name


def test_every_metric_the_docs_name_is_in_the_contract():
    series = {name + suffix for name in METRICS for suffix in SERIES_SUFFIXES}
    for doc in DOCS:
        words = set(re.findall(r"(?<![\w:])(mps_[a-z0-9_]+)(?![\w:(])", doc.read_text()))
        unknown = words - series - MODULE_NAMES
        assert not unknown, f"{doc.relative_to(ROOT)} names metrics the contract lacks: {sorted(unknown)}"


def test_readme_metric_table_is_generated_from_the_code():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- metrics:begin -->\n", 1)[1].split("<!-- metrics:end -->", 1)[0]
    assert block == markdown_table(), "README metric table is stale: paste `mps-exporter metrics`"


def test_readme_documents_every_flag():
    readme = (ROOT / "README.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    flags = {opt for p in sub.choices.values() for a in p._actions for opt in a.option_strings
             if opt.startswith("--") and opt != "--help"}
    missing = sorted(f for f in flags if f not in readme
                     and re.sub(r"^--(no-)?collector\.\w+$", "--collector.<name>", f) not in readme)
    assert not missing, f"flags not documented in README: {missing}"
