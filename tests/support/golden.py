"""The golden exposition (tests/golden/busy.prom): the busy scenario's scrape, with what
legitimately changes between runs masked. `make generate` writes it:

    python3 -m tests.support.golden           # rewrite tests/golden/busy.prom
    python3 -m tests.support.golden --check   # exit 1 if it is stale

tests/test_collector.py compares a fresh scrape with it: review its diff like code.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from prometheus_client.exposition import generate_latest

from mps_exporter.collector import MpsCollector, build_registry
from tests.support import scenarios

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "busy.prom"


def exposition(collector: MpsCollector) -> str:
    return generate_latest(build_registry(collector, process=False)).decode()


def normalized(text: str) -> str:
    """Mask what legitimately changes between runs: durations and the Python version."""
    text = text.replace(str(scenarios.CAPTURE), "<capture>")
    text = re.sub(r'^(mps_exporter_collector_duration_seconds\{[^}]*\}) \S+$', r"\1 <duration>", text, flags=re.M)
    text = re.sub(r'^(mps_exporter_collector_read_duration_seconds_(?:bucket|sum)\{[^}]*\}) \S+$', r"\1 <duration>",
                  text, flags=re.M)
    text = re.sub(r'^(mps_exporter_collector_last_success_timestamp_seconds\{[^}]*\}) \S+$', r"\1 <time>", text,
                  flags=re.M)
    return re.sub(r'python_version="[^"]*"', 'python_version="<python>"', text)


def busy_exposition() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return normalized(exposition(scenarios.busy(Path(tmp)).collector()))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether regenerating would change it")
    args = parser.parse_args(argv)
    text = busy_exposition()
    if GOLDEN.read_text() == text:
        return 0
    print(f"{'stale' if args.check else 'wrote'}: {GOLDEN.relative_to(GOLDEN.parents[2])}")
    if not args.check:
        GOLDEN.write_text(text)
    return 1 if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
