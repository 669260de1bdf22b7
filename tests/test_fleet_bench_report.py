"""bench/fleet_bench.py's capacity lines: never negative figures, whatever the runs'
noise (CI runs it at 2 and 3 nodes, where the fitted slope can come out negative)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("fleet_bench", ROOT / "bench" / "fleet_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(n: int, seconds: float) -> dict:
    return {"n": n, "mode": "client", "groups": {"mps-exporter.heavy": seconds}, "series_per_node": 1000.0,
            "recorded_per_node": 50.0, "recorded_fleet": 20.0}


def test_noisy_small_runs_give_no_negative_capacity():
    bench = _bench()
    # 3 nodes measured faster than 2: the fit's slope is negative.
    lines = bench._extrapolation([_run(2, 0.240), _run(3, 0.190)])
    text = "\n".join(lines)
    assert not re.search(r"(?<![\w|])-\d", text.replace("| --- ", "")), text
    rows = [line for line in lines if line.startswith("| 1,000 |") or line.startswith("| 10,000 |")]
    assert len(rows) == 2
    seconds = [float(re.search(r"\| ([\d,.]+) s \|", row).group(1).replace(",", "")) for row in rows]
    assert seconds[0] > 0 and seconds[1] > seconds[0]
    assert "at most" in lines[0]


def test_a_clean_fit_is_kept():
    lines = _bench()._extrapolation([_run(10, 0.110), _run(100, 1.010)])
    assert "10 ms + 10.0 ms per node" in lines[0], lines[0]
