"""Properties (hypothesis): chunk invariance, and fuzzing that must never raise."""

from __future__ import annotations

import os
import tempfile
from typing import Dict, List

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mps_exporter.families import FamilyBuilder
from mps_exporter.logs.render import render_log_metrics
from mps_exporter.logs.events import Unrecognized
from mps_exporter.logs.follower import FileFollower
from mps_exporter.logs.parser import PARSER_ERROR, parse_line
from mps_exporter.logs.pipeline import LogPipeline
from mps_exporter.logs.state import LogState

from .conftest import CAPTURE
from .helpers import UTC

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _capture_bytes(name: str) -> bytes:
    path = CAPTURE / f"{name}.log"
    return path.read_bytes() if path.is_file() else b""


CONTROL = _capture_bytes("control")
SERVER = _capture_bytes("server")
REAL_LINES = (CONTROL + SERVER).decode("utf-8").splitlines() or ["[2026-11-21 04:19:24.390 Control   546] NEW UI"]


def _follow_in_chunks(data: bytes, cuts: List[int]) -> List[str]:
    """Write `data` to a real file in pieces cut at `cuts`, polling after each piece."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "control.log")
        follower = FileFollower(path, max_line_bytes=4096)
        got: List[str] = []
        bounds = [0] + sorted(set(c % (len(data) + 1) for c in cuts)) + [len(data)]
        for start, end in zip(bounds, bounds[1:]):
            with open(path, "ab") as f:
                f.write(data[start:end])
            while True:
                lines, _ = follower.poll(max_bytes=1 + (end - start) // 3)  # small reads too
                if not lines:
                    break
                got += lines
        follower.close()
        return got


@SETTINGS
@given(st.lists(st.integers(min_value=0, max_value=10 ** 6), max_size=25))
def test_same_events_whatever_the_chunks(cuts):
    if not CONTROL:
        return  # no capture: nothing to compare (the capture tests report the skip)
    whole = CONTROL.decode("utf-8").splitlines()
    got = _follow_in_chunks(CONTROL, cuts)
    assert got == whole
    one_shot, chunked = LogState(), LogState()
    for line in whole:
        one_shot.apply(parse_line(line, "control", UTC), "control")
    for line in got:
        chunked.apply(parse_line(line, "control", UTC), "control")
    assert chunked.snapshot() == one_shot.snapshot()


@SETTINGS
@given(st.binary(max_size=3000), st.lists(st.integers(min_value=0, max_value=3000), max_size=10))
def test_random_bytes_in_chunks_give_every_terminated_line(data, cuts):
    got = _follow_in_chunks(data, cuts)
    assert len(got) == data.count(b"\n")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.sampled_from(["control", "server"]))
def test_parse_line_never_raises_on_text(text, file):
    result = parse_line(text, file)
    LogState().apply(result, file)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(REAL_LINES), st.data())
def test_mutated_real_lines_never_raise(line, data):
    chars = list(line)
    for _ in range(data.draw(st.integers(min_value=1, max_value=6))):
        op = data.draw(st.sampled_from(["replace", "insert", "delete", "digit"]))
        i = data.draw(st.integers(min_value=0, max_value=max(0, len(chars) - 1)))
        if op == "delete" and chars:
            del chars[i]
        elif op == "insert":
            chars.insert(i, data.draw(st.characters()))
        elif op == "digit" and chars:
            chars[i] = data.draw(st.sampled_from("0123456789-"))
        elif chars:
            chars[i] = data.draw(st.characters())
    mutated = "".join(chars)
    state = LogState()
    for file in ("control", "server"):
        result = parse_line(mutated, file, UTC)
        assert result.ts is None or isinstance(result.ts, float)
        state.apply(result, file)
        state.snapshot()


@SETTINGS
@given(st.binary(max_size=4000), st.binary(max_size=4000))
def test_pipeline_on_random_bytes_never_raises(control, server):
    with tempfile.TemporaryDirectory() as d:
        for name, data in (("control", control), ("server", server)):
            with open(os.path.join(d, f"{name}.log"), "wb") as f:
                f.write(data)
        snap = LogPipeline("fuzz", d, timezone="UTC").read_once()
    assert snap.lines == {"control": control.count(b"\n"), "server": server.count(b"\n")}
    assert snap.unrecognized["control"] <= snap.lines["control"]


def test_unrecognized_results_carry_a_reason():
    result = parse_line("\x00\xff garbage", "server")
    assert isinstance(result, Unrecognized) and result.reason


# ------------------------------------------------------- the project attacks itself
REAL_BYTES = [line for line in (CONTROL + SERVER).splitlines() if line] or [b"[2026-11-21 04:19:24.390 Control   546] NEW UI"]


@st.composite
def mutated_line(draw: st.DrawFn) -> bytes:
    """A real line of the recorded session, broken the ways a writer can break it."""
    line = bytearray(draw(st.sampled_from(REAL_BYTES)))
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        op = draw(st.sampled_from(["byte", "insert", "delete", "digits", "date", "nul"]))
        i = draw(st.integers(min_value=0, max_value=len(line)))
        if op == "byte" and i < len(line):
            line[i] = draw(st.integers(min_value=0, max_value=255))
        elif op == "insert":
            line[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del line[i:i + draw(st.integers(min_value=1, max_value=10))]
        elif op == "digits":  # past int()'s 4300-digit limit, and just past the bounds
            line[i:i] = b"9" * draw(st.sampled_from([10, 11, 20, 4301, 5000]))
        elif op == "date":
            line[1:11] = draw(st.sampled_from([b"9999-12-31", b"1970-01-01", b"0000-00-00", b"2026-02-30"]))
        else:
            line[i:i] = b"\x00" * draw(st.integers(min_value=1, max_value=100))
    return bytes(line).replace(b"\n", b"")


@settings(max_examples=500, deadline=None)
@given(mutated_line(), st.sampled_from(["control", "server"]))
def test_parser_never_raises_and_no_rule_ever_breaks(line, file):
    result = parse_line(line.replace(b"\x00", b"").decode("utf-8", "replace"), file, UTC)
    assert not (isinstance(result, Unrecognized) and result.reason == PARSER_ERROR), line[:200]
    LogState().apply(result, file)


def _rendered_counters(snap) -> Dict[str, float]:
    out = FamilyBuilder()
    render_log_metrics(out, "fuzz", snap, 0.0)
    return {f"{s.name}{sorted(s.labels.items())}": s.value for fam in out.families() for s in fam.samples
            if fam.type in ("counter", "histogram")}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(st.tuples(st.sampled_from(["control", "server"]), mutated_line()), max_size=120),
       st.lists(st.integers(min_value=0, max_value=10 ** 6), max_size=8))
def test_whole_pipeline_counts_every_complete_line_once_and_counters_never_go_down(rows, cuts):
    data = {f: b"".join(line + b"\n" for file, line in rows if file == f) for f in ("control", "server")}
    with tempfile.TemporaryDirectory() as d:
        pipe = LogPipeline("fuzz", d, timezone="UTC")
        previous: Dict[str, float] = {}
        written = {"control": 0, "server": 0}
        for f, blob in data.items():  # each file written in pieces, read after each piece
            bounds = [0] + sorted({c % (len(blob) + 1) for c in cuts}) + [len(blob)]
            for start, end in zip(bounds, bounds[1:]):
                with open(os.path.join(d, f"{f}.log"), "ab") as fh:
                    fh.write(blob[start:end])
                written[f] += blob[start:end].count(b"\n")
                snap = pipe.read_once()
                current = _rendered_counters(snap)
                assert [k for k, v in previous.items() if current.get(k, v) < v] == []
                previous = current
                assert snap.lines == written  # every complete line, once, as soon as it is complete
        assert snap.problems == () and snap.read_errors == {}
