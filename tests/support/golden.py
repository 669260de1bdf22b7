"""The golden exposition (tests/golden/busy.prom): the busy scenario's scrape, with what
legitimately changes between runs masked. `make generate` writes it:

    python3 -m tests.support.golden           # rewrite tests/golden/busy.prom
    python3 -m tests.support.golden --check   # exit 1 if it is stale

tests/test_collector.py compares a fresh scrape with it: review its diff like code. A scrape
in which a collector failed (`mps_exporter_collector_success 0`: its series are gone) is
refused, with the collector and the reason it logged; nothing is written.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional

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


class CollectorFailed(Exception):
    """The scenario's scrape had a failed collector: it is no golden exposition."""


def failed_collectors(text: str) -> List[str]:
    """The collectors an exposition reports failed (`mps_exporter_collector_success 0`)."""
    return re.findall(r'^mps_exporter_collector_success\{collector="([^"]+)"\} 0(?:\.0)?$', text, flags=re.M)


@contextlib.contextmanager
def _warnings() -> Iterator[List[str]]:
    """The exporter's warnings and errors logged inside the block (why a collector failed)."""
    messages: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("mps_exporter"), Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def busy_exposition() -> str:
    """The busy scenario's normalized scrape; raises CollectorFailed where a collector failed."""
    with tempfile.TemporaryDirectory() as tmp, _warnings() as warned:
        text = normalized(exposition(scenarios.busy(Path(tmp)).collector()))
    failed = failed_collectors(text)
    if failed:
        why: Dict[str, str] = {}
        for name in failed:
            said = [m.split(": ", 1)[1] for m in warned if m.startswith(f"collector {name} failed: ")]
            why[name] = said[0] if said else "; ".join(warned) or "nothing logged"
        raise CollectorFailed("; ".join(f"collector {name} failed: {reason}" for name, reason in why.items()))
    return text


def main(argv: Optional[List[str]] = None, golden: Path = GOLDEN) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether regenerating would change it")
    args = parser.parse_args(argv)
    try:
        text = busy_exposition()
    except CollectorFailed as e:
        print(f"golden: not writing {golden.name}: the busy scenario's scrape lost series: {e}", file=sys.stderr)
        return 1
    if golden.read_text() == text:
        return 0
    print(f"{'stale' if args.check else 'wrote'}: {golden.relative_to(golden.parents[2])}")
    if not args.check:
        golden.write_text(text)
    return 1 if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
