"""README's timeline of the shipped session against a replay of it: each row's `t` is
when /metrics shows what the row says (the first and, for a range, the last reading),
not when the event happened on the node."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from mps_exporter.collector import build_registry
from prometheus_client.exposition import generate_latest

from tests.support.shipped import replayed

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
Facts = Dict[str, object]


def _values(text: str, name: str, **labels: str) -> List[float]:
    out = []
    for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            out.append(float(m.group(2)))
    return out


def _facts(text: str) -> Facts:
    return {
        "up": _values(text, "mps_control_daemon_up"),
        "servers": len(_values(text, "mps_server_info")),
        "clients": len(_values(text, "mps_client_info")),
        "queued": sum(_values(text, "mps_queued_clients", reason="user_switch")),
        "handoffs": sum(_values(text, "mps_server_handoffs_total")),
        "fault": 1.0 in _values(text, "mps_server_status", status="FAULT"),
        "fatal": sum(_values(text, "mps_fatal_gpu_errors_total")),
        "rejected": sum(_values(text, "mps_client_rejections_total", reason="client_limit")),
        "exits_with_clients": sum(_values(text, "mps_server_exits_with_clients_total")),
        "time_slicing": 1.0 in _values(text, "mps_gpu_sharing_mode", mode="time_slicing"),
        "idle": 1.0 in _values(text, "mps_gpu_sharing_mode", mode="idle"),
        "default_limit": bool(_values(text, "mps_default_pinned_memory_limit_bytes")),
    }


def _timeline() -> List[Tuple[int, Facts]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp, replayed(tmp) as (bundle, at):
        for scrape in bundle.scrapes:
            text = generate_latest(build_registry(at(scrape.t), process=False)).decode()
            out.append((round(scrape.t), _facts(text)))
    return out


Check = Callable[[Facts], bool]
# Per README row (a phrase of its "what happened"): what /metrics shows over its `t`, and
# the row it must follow (its first reading is the first one after that row's start).
ROWS: Dict[str, Check] = {
    "capture starts": lambda f: f["up"] == [0.0],
    "`nvidia-cuda-mps-control -d`": lambda f: f["up"] == [1.0] and f["servers"] == 0,
    "three clients of uid 0": lambda f: f["servers"] == 1 and f["clients"] in (0, 3),
    "two stop": lambda f: f["clients"] == 1 and not f["queued"],
    "is queued behind uid 0's server": lambda f: f["queued"] == 1,
    "the uid 0 client stops": lambda f: f["handoffs"] == 1 and f["clients"] == 1,
    "`shutdown_server`": lambda f: f["servers"] == 0,
    "beside one without": lambda f: f["clients"] == 2,
    "a bystander client": lambda f: f["clients"] >= 1 and not f["fault"],
    "illegal memory access": lambda f: f["fault"],
    "52 clients at once": lambda f: f["servers"] == 1 and f["fatal"] == 1 and f["clients"] > 0,
    "SIGKILLed": lambda f: f["exits_with_clients"] == 1 and f["clients"] == 1,
    "`quit`": lambda f: f["up"] == [0.0] and not f["time_slicing"],
    "two CUDA processes without MPS": lambda f: f["time_slicing"],
    "nothing runs": lambda f: f["idle"] and f["up"] == [0.0],
}
# Facts a row's last column places at a time of its own ("from 57").
AT: Dict[str, Tuple[Check, str]] = {
    "fatal": (lambda f: f["fatal"] == 1, "from (\\d+) \\(MPS logs it"),
    "48": (lambda f: f["clients"] == 48, "`mps_server_clients 48` \\(from (\\d+)\\)"),
    "rejected": (lambda f: f["rejected"] == 4, "\\} 4` \\(from (\\d+)\\)"),
    "three clients": (lambda f: f["clients"] == 3, "three clients with their memory and the 24G limit \\(from (\\d+)\\)"),
    "default limit": (lambda f: f["default_limit"], "so from (\\d+)\\)"),
}


def _rows() -> List[Tuple[str, str, str]]:
    table = README.split("| t | what happened | what `/metrics` shows from t |\n| --- | --- | --- |\n", 1)[1]
    table = table.split("\n\n", 1)[0]
    return [tuple(cell.strip() for cell in line.strip("|").split("|", 2)) for line in table.splitlines()]  # type: ignore


def _span(timeline: List[Tuple[int, Facts]], check: Check, after: int) -> Optional[Tuple[int, int]]:
    """The first run of readings from `after` on where `check` holds: (first, last)."""
    first = last = None
    for t, facts in timeline:
        if t < after:
            continue
        if check(facts):
            first = t if first is None else first
            last = t
        elif first is not None:
            break
    return None if first is None else (first, last)


def test_readme_timeline_times_are_when_metrics_shows_them():
    timeline = _timeline()
    rows = _rows()
    assert len(rows) >= len(ROWS)
    checked, after = set(), 0
    for t_cell, happened, _shows in rows:
        key = next((k for k in ROWS if k in happened), None)
        if key is None:  # an action whose effect its last column places (e.g. "from 63")
            continue
        span = _span(timeline, ROWS[key], after)
        assert span is not None, f"/metrics never shows the row {happened!r} after {after} s"
        first, last = span
        # "a-b": the readings that show it; "a": from a on (a state that lasts, or one reading).
        assert t_cell == (f"{first}-{last}" if "-" in t_cell else str(first)), (
            f"row {happened!r}: README says {t_cell}, /metrics shows it at {first}-{last}")
        checked.add(key)
        after = (last if "-" in t_cell else first) + 1
    assert checked == set(ROWS)
    table = "\n".join(" | ".join(r) for r in rows)
    for name, (check, pattern) in AT.items():
        found = re.search(pattern, table)
        assert found, f"the table no longer says when /metrics shows {name}"
        first = next(t for t, facts in timeline if check(facts))
        assert int(found.group(1)) == first, f"{name}: README says from {found.group(1)}, /metrics from {first}"


def test_readme_names_the_panels_the_demo_leaves_empty():
    # README promises node-dashboard panels with data after one pass of the demo; the
    # compose demo test exempts the panels of the other client granularities and the
    # Kubernetes dashboard: README must name those exceptions.
    from tests.deploy.test_compose_demo import NEEDS_PODS, OTHER_GRANULARITIES

    paragraph = re.sub(r"\s+", " ", README.split("## Try it without a GPU", 1)[1].split("The session was", 1)[0])
    assert "every panel of the node dashboards has data once it has played through" in paragraph
    granularities = [mark.strip("()").split()[-1] for mark in OTHER_GRANULARITIES]
    assert granularities == ["pod", "server"]
    assert "(`--mps.client-granularity pod` and `server`, marked so in their titles" in paragraph
    for dashboard in NEEDS_PODS:
        assert f"the {dashboard.capitalize()} dashboard" in paragraph
