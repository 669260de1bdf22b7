"""Issue 39's test of the rows: a joined client metric is a row field (exporter/join.py), a
declaration and an emit line (exporter/render.py). Written into a copy of the repository
(as tests/test_example_source.py writes a source), the metric is served, and `status`
shows the field with the value /metrics publishes, with nothing under exporter/status/
edited."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.repo_copy import RepoCopy, files

# (file, a line already there, what goes after it): the whole change.
EDITS = [
    ("exporter/join.py", "    start_time_source: str = UNKNOWN  # logs, proc or none\n",
     "    gpu_count: int = 0  # the GPUs it is on\n"),
    ("exporter/join.py", "        start_time=start, start_time_source=start_source",
     ", gpu_count=len(gpus)"),
    ("exporter/render.py", '    gauge("mps_client_start_time_seconds", "Unix time the client connected.", DAEMON, *CLIENT),\n',
     '    gauge("mps_client_gpus", "GPUs the client is on.", DAEMON, *CLIENT),\n'),
    ("exporter/render.py", '    out.add("mps_client_start_time_seconds", c.start_time, **cp)\n',
     '    out.add("mps_client_gpus", c.gpu_count, **cp)\n'),
]

# In the copy: one collection of the busy capture, its /metrics and its status.
PROBE = """
import json, sys, tempfile
from pathlib import Path
from prometheus_client.exposition import generate_latest
from mps_exporter.collector import build_registry
from mps_exporter.status import command, view
from tests.support import scenarios

with tempfile.TemporaryDirectory() as tmp:
    collector = scenarios.busy(Path(tmp)).collector()
    snap = collector.snapshot()
    collector.collection = lambda: snap
    text = generate_latest(build_registry(collector, process=False)).decode()
    st = json.loads(command.to_json(view.build(snap, "probe")))
served = {line.split('pid="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
          for line in text.splitlines() if line.startswith("mps_client_gpus{")}
shown = {str(c["pid"]): c.get("gpu_count") for d in st["daemons"] for c in d["clients"]}
print(json.dumps({"served": served, "shown": shown}))
"""


@pytest.mark.slow
def test_a_joined_client_metric_is_a_row_field_a_declaration_and_an_emit_line(tmp_path: Path):
    copy = RepoCopy(tmp_path)
    repo = copy.repo
    before = files(repo)
    for rel, anchor, added in EDITS:
        path = repo / rel
        text = path.read_text()
        assert text.count(anchor) == 1, (rel, anchor)
        path.write_text(text.replace(anchor, anchor + added))
    found = json.loads(copy.run(sys.executable, "-c", PROBE, timeout=300).strip().splitlines()[-1])
    changed = {rel for rel, content in files(repo).items() if before.get(rel) != content}
    assert changed == {"exporter/join.py", "exporter/render.py"}
    assert found["served"] == {"1647": 1.0, "1648": 1.0, "1649": 1.0}  # the busy capture's clients, one GPU
    assert found["shown"] == {"1647": 1, "1648": 1, "1649": 1}  # status shows the field, nothing there edited
