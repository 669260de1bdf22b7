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
from typing import Iterator, List, Tuple

PATH = "/runbook"
SOURCE = Path(__file__).resolve().parent / "data" / "runbook.md"


_INLINE = re.compile(r"`([^`]+)`|\*\*(.+?)\*\*|\*([^*\s][^*]*?)\*|\[([^\]]+)\]\(([^)\s]+)\)")


def inline(text: str) -> str:
    """The runbook's inline Markdown as HTML: `code`, **strong**, *emphasis*, [links](url);
    everything else escaped."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        out.append(html.escape(text[pos:m.start()]))
        code, strong, em, label, url = m.groups()
        if code is not None:
            out.append(f"<code>{html.escape(code)}</code>")
        elif strong is not None:
            out.append(f"<strong>{inline(strong)}</strong>")
        elif em is not None:
            out.append(f"<em>{inline(em)}</em>")
        else:
            out.append(f'<a href="{html.escape(url, quote=True)}">{inline(label)}</a>')
        pos = m.end()
    out.append(html.escape(text[pos:]))
    return "".join(out)


def _anchor(title: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, spaces to dashes, the rest dropped."""
    return re.sub(r"[^a-z0-9_-]", "", title.lower().replace(" ", "-"))


def _blocks(lines: List[str]) -> Iterator[Tuple[str, List[str]]]:
    """(kind, lines) of each block: heading, code (indented 4 or fenced), list, paragraph."""
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            yield "code", lines[i + 1:j]
            i = j + 1
        elif re.match(r"#{1,6} ", line):
            yield "heading", [line]
            i += 1
        elif line.startswith("    "):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            block = [x[4:] for x in lines[i:j]]
            while block and not block[-1].strip():
                block.pop()
            yield "code", block
            i = j
        elif re.match(r"[-*] ", line):
            j = i + 1  # an item goes on over lines indented under it
            while j < len(lines) and (re.match(r"[-*] ", lines[j]) or lines[j].startswith("  ")):
                j += 1
            yield "list", lines[i:j]
            i = j
        else:
            j = i + 1
            while j < len(lines) and lines[j].strip() and not re.match(r"#{1,6} |[-*] |```|    ", lines[j]):
                j += 1
            yield "paragraph", lines[i:j]
            i = j


def page(markdown: str) -> bytes:
    """The runbook as one HTML page: each heading an anchor (its name lower-cased, as
    GitHub writes it, so `/runbook#mpsserverfault` lands on it), paragraphs, lists and
    code blocks as HTML, with the inline Markdown the runbook uses (code, strong,
    emphasis, links)."""
    parts = ["<!DOCTYPE html>\n<html>\n<head><meta charset=\"utf-8\"><title>MPS Exporter runbook</title>\n"
             "<style>body { max-width: 60em; margin: 1em auto; font-family: sans-serif; line-height: 1.4 }\n"
             "pre { background: #f4f4f4; padding: 0.5em; overflow-x: auto }</style></head>\n<body>\n"]
    for kind, block in _blocks(markdown.splitlines()):
        if kind == "heading":
            hashes, title = block[0].split(" ", 1)
            level, title = len(hashes), title.strip()
            parts.append(f'<h{level} id="{html.escape(_anchor(title), quote=True)}">{inline(title)}</h{level}>\n')
        elif kind == "code":
            parts.append(f"<pre><code>{html.escape(chr(10).join(block))}</code></pre>\n")
        elif kind == "list":
            items: List[List[str]] = []
            for line in block:
                if re.match(r"[-*] ", line):
                    items.append([line[2:].strip()])
                else:
                    items[-1].append(line.strip())
            parts.append("<ul>\n" + "".join(f"<li>{inline(' '.join(item))}</li>\n" for item in items) + "</ul>\n")
        else:
            parts.append(f"<p>{inline(' '.join(x.strip() for x in block))}</p>\n")
    parts.append("</body>\n</html>\n")
    return "".join(parts).encode("utf-8")


@lru_cache(maxsize=1)
def served_page() -> bytes:
    """The shipped runbook's page, built once."""
    return page(SOURCE.read_text(encoding="utf-8"))
