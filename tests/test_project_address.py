"""The project's own address is declared once, in pyproject.toml's [project.urls] (where a
Python project states its home, and what `pip show` and `--help` read): every other place
that names the project's repository (runbook links in the generated rules, the systemd
unit, the docs, the mixin's `jb install`) names that one. Whoever hosts the project
elsewhere changes that line (and RUNBOOK_URL_PATTERN for runbooks kept on a wiki) and
this test lists what to regenerate or edit."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A repository address on a git host whose repository is named like the project.
PROJECT_ADDRESS = re.compile(r"https?://(?:github\.com|gitlab\.com)/[\w.-]+/mps-exporter(?=[/#\s\"')>]|$)")
RECORDS = ("reports/", "bench/results/", "tests/data/")  # measurements as they were written


def _source_url() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["urls"]["Source"])


def test_every_place_that_names_the_project_names_the_declared_address():
    source = _source_url()
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named, elsewhere = 0, []
    for name in files:
        if name.startswith(RECORDS) or name == "pyproject.toml":
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
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
