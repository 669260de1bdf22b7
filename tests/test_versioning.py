"""CHANGELOG.md and docs/versioning.md: the version story names the declared version, and
every metric of the contract is listed once, as stable or experimental (issue 43)."""

from __future__ import annotations

import re
from pathlib import Path

from alerts import definitions
from mps_exporter import __version__
from mps_exporter.catalog import METRICS

ROOT = Path(__file__).resolve().parent.parent
CHANGELOG = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
VERSIONING = (ROOT / "docs" / "versioning.md").read_text(encoding="utf-8")


def _listed(section: str) -> list:
    body = VERSIONING.split(f"### {section}\n", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^- `([a-z_:]+)`", body, re.MULTILINE)


def test_every_metric_is_listed_once_as_stable_or_experimental():
    stable, experimental = _listed("Stable"), _listed("Experimental")
    listed = stable + experimental
    assert sorted(listed) == sorted(set(listed)), "a metric listed twice"
    assert set(listed) - set(METRICS) == set(), "listed but not in the contract"
    assert set(METRICS) - set(listed) == set(), "in the contract but listed neither stable nor experimental"


def test_every_metric_a_shipped_rule_reads_is_stable():
    experimental = set(_listed("Experimental"))
    exprs = [a.expr for a in definitions.ALERTS] + [r.expr for r in definitions.RECORDINGS]
    read = {name for name in METRICS for e in exprs
            if re.search(re.escape(name) + r"(_bucket|_sum|_count)?\{", e)}
    assert len(read) > 20
    assert read & experimental == set()


def test_changelog_follows_keep_a_changelog_and_names_the_version():
    assert CHANGELOG.startswith("# Changelog\n") and "keepachangelog.com/en/1.1.0" in CHANGELOG
    headings = re.findall(r"^## \[([^\]]+)\](.*)$", CHANGELOG, re.MULTILINE)
    assert headings and headings[0] == ("Unreleased", "")
    # Released sections: `## [X.Y.Z] - YYYY-MM-DD`, newest first, each with its link.
    released = [(v, rest) for v, rest in headings[1:]]
    for version, rest in released:
        assert re.fullmatch(r"\d+\.\d+\.\d+", version) and re.fullmatch(r" - \d{4}-\d{2}-\d{2}", rest), version
    for version, _ in headings:
        assert re.search(rf"^\[{re.escape(version)}\]: https://", CHANGELOG, re.MULTILINE), version
    sections = {m for m in re.findall(r"^### (\w+)$", CHANGELOG, re.MULTILINE)}
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    # The declared version is either released (a heading) or the one Unreleased becomes.
    unreleased = CHANGELOG.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    assert __version__ in [v for v, _ in released] or f"`{__version__}`" in unreleased


def test_versioning_names_where_the_version_lives():
    assert "`__version__` in `exporter/__init__.py`" in VERSIONING
    assert re.search(r'^__version__ = "', (ROOT / "exporter" / "__init__.py").read_text(), re.MULTILINE)
    chart = (ROOT / "deploy" / "helm" / "mps-exporter" / "Chart.yaml").read_text()
    assert f'appVersion: "{__version__}"' in chart
