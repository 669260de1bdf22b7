"""The contract in code, shared/METRICS.md and the README agree."""

import re
from pathlib import Path

import pytest

from mps_exporter.cli import metrics_markdown
from mps_exporter.config import build_parser
from mps_exporter.contract import METRICS

ROOT = Path(__file__).resolve().parents[1]
METRICS_MD = ROOT.parent / "shared" / "METRICS.md"
# Labels the contract allows us to add ("add container_id and pod_uid where the cgroup shows them").
ALLOWED_EXTRA_LABELS = {"mps_client_info": {"container_id", "pod_uid"}}


def contract_rows():
    rows = {}
    for line in METRICS_MD.read_text().splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) == 4 and re.match(r"^mps_[a-z_]+$", cols[0]):
            rows[cols[0]] = (cols[1], {l.strip() for l in cols[2].split(",") if l.strip()})
    return rows


@pytest.mark.skipif(not METRICS_MD.exists(), reason="shared/METRICS.md not found")
def test_every_contract_metric_is_in_code_with_its_type_and_labels():
    rows = contract_rows()
    assert len(rows) >= 45
    for name, (mtype, labels) in rows.items():
        assert name in METRICS, f"{name} missing from exporter/contract.py"
        spec = METRICS[name]
        expected_type = "gauge" if mtype.startswith("gauge") else mtype
        assert spec.type == expected_type, name
        assert set(spec.labels) - ALLOWED_EXTRA_LABELS.get(name, set()) == labels, name


def test_readme_metric_table_is_generated_from_the_code():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- metrics:begin -->\n", 1)[1].split("<!-- metrics:end -->", 1)[0]
    assert block == metrics_markdown(), "README metric table is stale: paste `mps-exporter metrics`"


def test_readme_documents_every_flag():
    readme = (ROOT / "README.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    flags = {opt for p in sub.choices.values() for a in p._actions for opt in a.option_strings
             if opt.startswith("--") and opt != "--help"}
    missing = sorted(f for f in flags if f not in readme
                     and not re.sub(r"^--(no-)?collector\.\w+$", "--collector.<name>", f) in readme)
    assert not missing, f"flags not documented in README: {missing}"
