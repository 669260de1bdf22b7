"""The project's own address is declared once, in pyproject.toml's [project.urls] (where a
Python project states its home, and what `pip show` and `--help` read): every other place
that names the project's repository (runbook links in the generated rules, the systemd
unit, the docs, the mixin's `jb install`) names that one. Whoever hosts the project
elsewhere changes that line (and RUNBOOK_URL_PATTERN for runbooks kept on a wiki) and
this test lists what to regenerate or edit."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A repository address on a git host whose repository is named like the project.
PROJECT_ADDRESS = re.compile(r"https?://(?:github\.com|gitlab\.com)/[\w.-]+/mps-exporter(?=[/#\s\"')>]|$)")
RECORDS = ("reports/", "bench/results/", "tests/data/")  # measurements as they were written
# Not the project's files: CI runs from a `git archive` copy (no .git), a developer's tree has these.
NOT_OURS = {".git", ".venv", "__pycache__", "node_modules", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


def _files():
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_OURS and not d.endswith(".egg-info")]
        for name in names:
            yield os.path.relpath(os.path.join(top, name), ROOT)


def _source_url() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["urls"]["Source"])


def test_every_place_that_names_the_project_names_the_declared_address():
    source = _source_url()
    named, elsewhere = 0, []
    for name in _files():
        if name.startswith(RECORDS) or name == "pyproject.toml":
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for found in PROJECT_ADDRESS.findall(text):
            named += 1
            if found != source:
                elsewhere.append(f"{name}: {found}")
    assert elsewhere == []
    assert named > 20  # the runbook links of the generated rule files, at least: the search works


def test_the_declared_addresses_are_one_repository():
    with open(ROOT / "pyproject.toml", "rb") as f:
        urls = tomllib.load(f)["project"]["urls"]
    assert {name: url.startswith(urls["Source"]) for name, url in urls.items()} == {name: True for name in urls}
