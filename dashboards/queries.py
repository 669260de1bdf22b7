"""Every query of every generated dashboard, in a form Prometheus can run
without Grafana: what the tests use to prove the dashboards work."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterator, NamedTuple, Optional

JSON_DIR = Path(__file__).resolve().parent / "json"


class Query(NamedTuple):
    dashboard: str
    panel: str
    ref_id: str
    expr: str
    instant: bool = False  # Grafana runs it as an instant query (tables)


def queries(json_dir: Path = JSON_DIR) -> Iterator[Query]:
    for path in sorted(json_dir.glob("*.json")):
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            for t in panel.get("targets", []):
                yield Query(path.stem, panel["title"], t["refId"], t["expr"], bool(t.get("instant")))


VARIABLES = ("job", "node", "gpu", "daemon", "namespace", "pod")


def concrete(expr: str, rate_interval: str = "1m", selection: Optional[Dict[str, str]] = None) -> str:
    """Grafana's substitutions: `selection` (variable -> regex, e.g. one node) and
    "All" (.*) for every other variable, and a fixed rate interval."""
    expr = expr.replace("$__rate_interval", rate_interval)
    chosen = selection or {}
    return re.sub(r"\$(%s)\b" % "|".join(VARIABLES), lambda m: chosen.get(m.group(1), ".*"), expr)
