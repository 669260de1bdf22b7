#!/usr/bin/env python3
"""Write the blocks of README.md and docs/labels.md that come from the code.

    python3 docs/generate.py           # rewrite the blocks
    python3 docs/generate.py --check   # exit 1 if one is stale

Each block sits between `<!-- NAME:begin -->` and `<!-- NAME:end -->` lines and
is replaced whole: README's metric tables (`metrics`) and docs/labels.md's label
table (`labels`), both from mps_exporter.catalog (every declared metric and
label). Edit the declarations, not the blocks. `make generate` runs this.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]


def blocks() -> Dict[str, Tuple[str, Callable[[], str]]]:
    """Block name -> (file relative to the repository, the block's text)."""
    if str(ROOT) not in sys.path:  # run as a script: dashboards/ (the useful queries) beside docs/
        sys.path.insert(0, str(ROOT))
    from dashboards import useful_queries
    from mps_exporter import catalog

    return {
        "metrics": ("README.md", catalog.metrics_markdown),
        "labels": ("docs/labels.md", catalog.labels_markdown),
        "collector-flags": ("README.md", catalog.collector_flags_markdown),
        "useful-queries": ("README.md", useful_queries.markdown),
    }


def replace_block(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"expected one {begin.strip()} ... {end} pair")
    head, rest = text.split(begin, 1)
    return head + begin + body + end + rest.split(end, 1)[1]


def outputs(root: Path = ROOT) -> Dict[str, str]:
    """File relative to root -> its text with every block regenerated."""
    files: Dict[str, str] = {}
    for name, (rel, body) in blocks().items():
        text = files.get(rel) or (root / rel).read_text(encoding="utf-8")
        try:
            files[rel] = replace_block(text, name, body())
        except ValueError as e:
            raise SystemExit(f"{rel}: {e}") from None
    return files


def main(argv: Optional[List[str]] = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report files that regenerating would change")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in outputs(root).items():
        if (root / rel).read_text(encoding="utf-8") != text:
            stale.append(rel)
            if not args.check:
                (root / rel).write_text(text, encoding="utf-8")
    for rel in stale:
        print(f"{'stale' if args.check else 'wrote'}: {rel}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
