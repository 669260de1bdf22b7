"""What the benchmarks print: Markdown rows and the load average beside them (other
work on the machine skews timings)."""

from __future__ import annotations

import os
from typing import Dict, List


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_rows(rows: List[Dict[str, object]]) -> None:
    """One Markdown table: a column per key of the first row, a line per row."""
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")
