"""State files of the last release still load (issue 39): tests/logs/fixtures/statefile-v1
holds a version 1 state file (the counted log events as named fields, "counters"), recorded
with that release's code. Each of its daemons' entries loads to the state today's code
reaches from the same logs."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from mps_exporter.logs.state import LogState
from mps_exporter.logs.statefile import FORMAT_VERSION, StateStore
from mps_exporter.logs.render import COUNTED_EVENTS

from .conftest import FIXTURES

REPO = Path(__file__).resolve().parents[2]
SAVED = FIXTURES / "statefile-v1" / "state.json"
_spec = importlib.util.spec_from_file_location("record_v1", FIXTURES / "statefile-v1" / "record.py")
assert _spec is not None and _spec.loader is not None
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)


def test_the_recorded_file_is_version_1_and_covers_every_counter_it_named():
    doc = json.loads(SAVED.read_text())
    assert set(doc) == set(record.CASES)
    assert {e["version"] for e in doc.values()} == {1} and FORMAT_VERSION == 2
    named = set().union(*(e["state"]["counters"] for e in doc.values()))
    counted = {k for e in doc.values() for k, n in e["state"]["counters"].items() if n}
    assert counted == named  # every counter of version 1 is nonzero in some entry: its mapping is tested
    assert len(named) == 12


@pytest.mark.parametrize("daemon", sorted(record.CASES))
def test_a_version_1_entry_loads_to_the_state_the_logs_give(daemon, tmp_path):
    shutil.copy(SAVED, tmp_path / "state.json")
    store = StateStore(str(tmp_path / "state.json"))
    entry = store.load(daemon)
    assert entry is not None and store.errors == {}
    loaded = LogState.from_dict(entry["state"])
    today = record.state_of(REPO, daemon)
    assert loaded.snapshot() == today.snapshot()
    assert loaded.to_dict() == today.to_dict()
    assert set(loaded.snapshot().counts) <= set(COUNTED_EVENTS)
    # and what it writes back (version 2) loads to the same state again
    store.save(daemon, {"files": {}, "state": loaded.to_dict()})
    again = StateStore(str(tmp_path / "state.json")).load(daemon)
    assert again is not None and again["version"] == FORMAT_VERSION
    assert LogState.from_dict(again["state"]).snapshot() == today.snapshot()
