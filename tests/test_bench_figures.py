"""Issue 44's figures: docs/performance.md's table comes from the records the benches write,
with the ratio and the goal computed from the two values of one run (bench/figures.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import figures

ROOT = Path(__file__).resolve().parents[1]


def _row(text: str, fig: figures.Figure) -> str:
    [row] = [line for line in text.splitlines() if line.startswith(f"| {fig.what} |")]
    return row


def test_every_figure_has_a_record_of_the_repository():
    records = figures.load()  # a figure without a record raises: never skipped
    assert set(records) == set(figures.FIGURES)
    for key, r in records.items():
        assert r["figure"] == key and r["value"] > 0 and r["reference"] > 0
        assert r["commit"] and r["date"] and r["cpus"] >= 1


def test_a_missing_record_names_the_bench_that_writes_it(tmp_path: Path):
    shutil.copytree(ROOT / figures.RECORDS, tmp_path / figures.RECORDS)
    (tmp_path / figures.RECORDS / "catch-up.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"catch-up \(python3 bench/logs_bench.py --catch-up"):
        figures.load(tmp_path)


def test_the_ratio_and_the_goal_come_from_the_two_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    shutil.copytree(ROOT / figures.RECORDS, tmp_path / figures.RECORDS)
    figures.record("cpu-15s", 0.26, 0.52, root=tmp_path)  # exactly the goal: 0.5x
    figures.record("cpu-1s", 10.5, 10.0, root=tmp_path)  # over it
    figures.record("catch-up", 2.0, 0.8, root=tmp_path)  # a speed: reference / value
    figures.record("first-scrape", 0.51, 0.07, root=tmp_path)  # an absolute goal
    assert "recorded cpu-15s" in capsys.readouterr().out
    text = figures.markdown(tmp_path)
    assert "| 0.26 ms/s |" in _row(text, figures.FIGURES["cpu-15s"])
    assert "| 0.50x | at most 0.5x | yes |" in _row(text, figures.FIGURES["cpu-15s"])
    assert "| 1.05x | at most 1.0x | no |" in _row(text, figures.FIGURES["cpu-1s"])
    assert "| 0.40x | at least 0.4x as fast | yes |" in _row(text, figures.FIGURES["catch-up"])
    assert "| at most 0.5 s | no |" in _row(text, figures.FIGURES["first-scrape"])
    written = json.loads((tmp_path / figures.RECORDS / "cpu-1s.json").read_text())
    assert (written["value"], written["reference"]) == (10.5, 10.0)


def test_a_record_is_checked_against_its_figure(tmp_path: Path):
    with pytest.raises(KeyError, match="no figure 'cpu-5s'"):
        figures.record("cpu-5s", 1.0, 1.0, root=tmp_path)
    shutil.copytree(ROOT / figures.RECORDS, tmp_path / figures.RECORDS)
    path = tmp_path / figures.RECORDS / "cpu-1s.json"
    path.write_text(path.read_text().replace('"figure": "cpu-1s"', '"figure": "cpu-15s"'))
    with pytest.raises(ValueError, match="records figure 'cpu-15s', not 'cpu-1s'"):
        figures.load(tmp_path)
