"""The alert runbook, shipped in the package and served at /runbook.

Each alert's runbook_url points here by default (alerts/config.py,
RUNBOOK_URL_PATTERN), so the runbook always matches the exporter's version.
`make generate` copies alerts/runbook.md to data/runbook.md.
"""

from __future__ import annotations

import html
import re
from functools import lru_cache
from pathlib import Path

PATH = "/runbook"
SOURCE = Path(__file__).resolve().parent / "data" / "runbook.md"


def page(markdown: str) -> bytes:
    """The runbook as one HTML page: each `## Heading` an anchor (its name
    lower-cased, as GitHub writes it, so `/runbook#mpsserverfault` lands on it),
    the text between headings as it is, escaped."""
    parts = ["<!DOCTYPE html>\n<html>\n<head><meta charset=\"utf-8\"><title>MPS Exporter runbook</title></head>\n<body>\n"]
    for chunk in re.split(r"^(#{1,2} .+)$", markdown, flags=re.M):
        heading = re.fullmatch(r"(#{1,2}) (.+)", chunk)
        if heading:
            level, title = len(heading.group(1)), heading.group(2).strip()
            anchor = re.sub(r"[^a-z0-9_-]", "", title.lower().replace(" ", "-"))
            parts.append(f'<h{level} id="{html.escape(anchor, quote=True)}">{html.escape(title)}</h{level}>\n')
        elif chunk.strip():
            parts.append(f"<pre style=\"white-space: pre-wrap\">{html.escape(chunk.strip())}</pre>\n")
    parts.append("</body>\n</html>\n")
    return "".join(parts).encode("utf-8")


@lru_cache(maxsize=1)
def served_page() -> bytes:
    """The shipped runbook's page, built once."""
    return page(SOURCE.read_text(encoding="utf-8"))
