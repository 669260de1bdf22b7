"""Every declared metric and label, assembled: what README's metric table, docs/labels.md,
`mps-exporter metrics`, the dashboards' checks and the tests read.

Declarations live next to the code that emits them (contract.py says how); this
module imports those modules and lists their tables in README's order: the joined
GPU, daemon, server and client tables, the log tables, each source's own
(registry order), the exporter itself. docs/generate.py writes the Markdown
below into README.md and docs/labels.md (`make generate`).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from . import render
from .config import Config
from .contract import DECLARED, Label, MetricSpec
from .logs import render as log_render
from .sources.registry import SOURCES

TABLES: Tuple[Tuple[MetricSpec, ...], ...] = (
    render.GPU_METRICS, render.DAEMON_METRICS, render.SERVER_METRICS, render.CLIENT_METRICS,
    render.POD_SUM_METRICS, render.SERVER_SUM_METRICS, render.EDGE_METRICS, log_render.QUEUE_METRICS, log_render.LOG_METRICS,
    *(source.metrics for source in SOURCES.values() if source.metrics),
    render.SELF_METRICS,
)
METRICS: Dict[str, MetricSpec] = {spec.name: spec for specs in TABLES for spec in specs}

_missing = set(DECLARED) - set(METRICS)
if _missing:  # a module declared a table that no list above names
    raise RuntimeError(f"declared but not in the catalog: {sorted(_missing)}")


def label_bound(label: Label) -> str:
    """The label's bound as the docs say it (the collector names come from the registry)."""
    return label.bound.replace("{collectors}", ", ".join(SOURCES))


def labels() -> Dict[Label, List[str]]:
    """Every declared label -> the metrics that carry it, in table order."""
    out: Dict[Label, List[str]] = {}
    for spec in METRICS.values():
        for label in spec.label_decls:
            out.setdefault(label, []).append(spec.name)
    return out


def metrics_markdown() -> str:
    """README's metric tables (`mps-exporter metrics`)."""
    rows: List[str] = []
    title: Optional[str] = None
    for spec in METRICS.values():
        if spec.table != title:
            title = spec.table
            rows += ["", f"### {title}", "", "| name | type | labels | meaning |", "| --- | --- | --- | --- |"]
        rows.append(f"| {spec.name} | {spec.type} | {', '.join(spec.labels)} | {spec.help} |")
    return "\n".join(rows).lstrip("\n") + "\n"


def _default(value: Any) -> str:
    if value is None or value == "":
        return "none"
    if isinstance(value, (tuple, list)):
        return ", ".join(f"`{v}`" for v in value)
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def collector_flags_markdown() -> str:
    """README's table of the collectors and the flags each declares (Source.flags)."""
    defaults = Config()
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for name, source in SOURCES.items():
        default = {True: "on", False: "off", "auto": "on where its library imports"}[source.default]
        rows.append(f"| `--collector.{name}`, `--no-collector.{name}` | {default} | the {name} collector: "
                    f"{source.help} |")
        for flag in source.flags:
            text = re.sub(r"\s*\(default %\(default\)s\)", "", flag.help).replace("%%", "%")
            text = re.sub(r"\s*\((repeatable); default: [^)]*\)", r" (\1)", text)
            value = getattr(defaults, flag.dest, flag.default)
            rows.append(f"| `{flag.name}` | {_default(value)} | {text} |")
    return "\n".join(rows) + "\n"


def labels_markdown() -> str:
    """The table of docs/labels.md."""
    rows = ["| label | metrics | origin | source | bound |", "| --- | --- | --- | --- | --- |"]
    for label, metrics in labels().items():
        names = ", ".join(metrics) if len(metrics) <= 4 else f"{len(metrics)} metrics ({metrics[0]}, ...)"
        rows.append(f"| {label.name} | {names} | {label.origin} | {label.source} | {label_bound(label)} |")
    return "\n".join(rows) + "\n"
