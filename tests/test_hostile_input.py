"""Issue 42, points 1 and 2: what any tenant can put in front of the exporter (its
environment, its command name) is parsed so that it can be refused, never raised past
its source; one hostile client costs at most its own series, never the scrape.

The whole-scrape tests drive the collector over the fakes (pynvml, the control
subprocess, /proc) as tests/test_multi_gpu.py does, and compare every other client's
series with a run in which the hostile client is an ordinary one."""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import Dict, List

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from mps_exporter import limits as lim
from mps_exporter import join as join_module
from mps_exporter.limits import own_limits
from mps_exporter.sources.control import MAX_LISTED, ControlError, parse_ps
from mps_exporter.units import ascii_digits, parse_decimal, parse_size, parse_uint
from tests.fakes.fake_control import PS_HEADER
from tests.fakes.fake_procfs import FakeProcess, write_proc
from tests.support import scenarios
from tests.support.golden import exposition

UUID0 = "GPU-4b5da867-9d06-5e2c-8dea-18b8dab8a008"
ONE_GPU = [(0, UUID0)]
HUGE = "9" * 400  # the issue's 400-digit size
PRIORITY, PINNED, THREADS, VISIBLE = ("CUDA_MPS_CLIENT_PRIORITY", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                                      "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_VISIBLE_DEVICES")


# ---------------------------------------------------------------- the parsers
@pytest.mark.parametrize("text, size", [
    ("2G", 2 << 30), ("512M", 512 << 20), ("0x80000000 bytes", 1 << 31), ("1073741824", 1 << 30),
    ("1.5G", 3 << 29), ("16T", 16 << 40), (" 2 GiB ", 2 << 30),
    ("٣G", None),  # \d matched it, float() read it: CUDA would not
    ("²G", None), (HUGE, None), (HUGE + "G", None), ("0x" + "f" * 40, None), ("1." + HUGE, None),
    ("99999999999999999999T", None),  # 20 digits, but past 2**64 bytes
    ("18446744073709551615", (1 << 64) - 1), ("18446744073709551616", None),
    ("nan", None), ("inf", None), ("1e3G", None), ("", None),
])
def test_sizes_are_ascii_bounded_and_exact(text, size):
    assert parse_size(text) == size


def test_digit_checks_take_ascii_only_and_bounded():
    assert "²".isdigit() and "٣".isdigit()  # what made int() raise (or read foreign digits)
    assert not ascii_digits("²") and not ascii_digits("٣") and not ascii_digits("") and not ascii_digits(" 1")
    assert ascii_digits("0123") and not ascii_digits(HUGE)
    assert parse_uint(" 42\n") == 42 and parse_uint("²") is None and parse_uint(HUGE) is None
    assert parse_decimal("25.5") == 25.5 and parse_decimal("٥٠") is None and parse_decimal("1_0") is None
    assert parse_decimal(HUGE + "." + HUGE) is None  # too long to be a percentage
    assert parse_decimal("1e999") == float("inf")  # a number, out of any range: the caller refuses it


@pytest.mark.parametrize("env, ignored", [
    # the issue's examples: each made every scrape answer HTTP 500
    ({PRIORITY: "²"}, {lim.PRIORITY: lim.NOT_A_NUMBER}),
    ({PINNED: "²=1G"}, {lim.PINNED_MEMORY: lim.MALFORMED}),
    ({PINNED: "0=" + HUGE}, {lim.PINNED_MEMORY: lim.MALFORMED}),
    ({VISIBLE: "0,²", PINNED: "1=1G"}, {lim.PINNED_MEMORY: lim.INVISIBLE_DEVICE}),  # CUDA stops at "²"
    # and around them
    ({PINNED: "0=" + HUGE + "G"}, {lim.PINNED_MEMORY: lim.MALFORMED}),
    ({PINNED: "0=0x" + "f" * 400}, {lim.PINNED_MEMORY: lim.MALFORMED}),
    ({PINNED: HUGE + "=1G"}, {lim.PINNED_MEMORY: lim.MALFORMED}),
    ({PINNED: "0=1G\n"}, {}),
    ({PRIORITY: HUGE}, {lim.PRIORITY: lim.OUT_OF_RANGE}),
    ({PRIORITY: "١"}, {lim.PRIORITY: lim.NOT_A_NUMBER}),
    ({PRIORITY: "-1"}, {lim.PRIORITY: lim.NOT_A_NUMBER}),
    ({THREADS: "٥٠"}, {lim.ACTIVE_THREADS: lim.NOT_A_NUMBER}),
    ({THREADS: HUGE}, {lim.ACTIVE_THREADS: lim.NOT_A_NUMBER}),
    ({THREADS: "1e999"}, {lim.ACTIVE_THREADS: lim.OUT_OF_RANGE}),
    ({THREADS: "inf"}, {lim.ACTIVE_THREADS: lim.OUT_OF_RANGE}),
    ({THREADS: "NaN"}, {lim.ACTIVE_THREADS: lim.OUT_OF_RANGE}),
    ({THREADS: "50\n"}, {}),
    ({VISIBLE: HUGE, PINNED: "0=1G"}, {lim.PINNED_MEMORY: lim.INVISIBLE_DEVICE}),
])
def test_hostile_environments_are_refused_with_a_reason(env, ignored):
    assert own_limits(env, ONE_GPU).ignored == ignored


def row(pid: int, command: str, server: int = 4000, client_id: int = 7) -> str:
    """A `ps` row as the daemon writes it (tests/fakes/fake_control.py)."""
    return f"{pid:<10}{client_id:<10}{server:<15}{'GPU-a20825ef-ef8f-4f37':<26}{'4026531836':<15}{command:<15}"


def ps(*rows: str) -> str:
    return "\n".join([PS_HEADER, *rows]) + "\n"


def test_a_newline_in_a_command_continues_that_row():
    entries = parse_ps(ps(row(1, "evil\nname"), row(2, "python3")))
    assert [(e.pid, e.command) for e in entries] == [(1, "evil\nname"), (2, "python3")]
    entries = parse_ps(ps(row(1, "a\n\n  b  \nc"), row(2, "x\u2028y")))  # only "\n" ends a row
    assert [(e.pid, e.command) for e in entries] == [(1, "a\nb\nc"), (2, "x\u2028y")]
    assert parse_ps(ps(row(1, "\n"), row(2, "ok"))) == parse_ps(ps(row(1, ""), row(2, "ok")))


def test_a_line_before_any_row_is_dropped_and_a_flood_of_lines_is_one_command():
    assert [e.pid for e in parse_ps(ps("  stray words", row(2, "ok")))] == [2]
    flood = parse_ps(ps(row(1, "x" + "\ny" * (2 * MAX_LISTED)), row(2, "ok")))
    assert [e.pid for e in flood] == [1, 2] and len(flood[0].command) <= 4096  # not "too many clients"
    with pytest.raises(ControlError):  # more rows than clients can be is still no answer
        parse_ps(ps(*(row(i, "p") for i in range(1, MAX_LISTED + 2))))


# ---------------------------------------------------------------- through the whole scrape
def per_client_lines(text: str) -> Dict[str, List[str]]:
    """pid -> its series, for every per-client line of the exposition."""
    found: Dict[str, List[str]] = {}
    for line in text.split("\n"):  # the exposition's lines end in \n only: a label may hold \x85
        m = re.search(r'[{,]pid="([0-9]+)"', line)
        if line.startswith("mps_client_") and m:
            found.setdefault(m.group(1), []).append(line)
    return found


def scrape(tmp: Path, env: Dict[str, str], command: str, granularity: str = "client") -> str:
    """The exposition of two GPUs, two clients each, the first client (10000) with `env`
    and `command` (its `ps` COMMAND column)."""
    scen = scenarios.synthetic(tmp, gpus=2, clients_per_gpu=2)
    scen.cfg.client_granularity = granularity
    hostile = next(c for c in scen.daemon.clients if c.pid == 10000)
    hostile.command = command
    write_proc(scen.proc_root, [FakeProcess(10000, uid=1000, environ=env)])
    text = exposition(scen.collector())
    families = list(text_string_to_metric_families(text))  # valid exposition, every line of it
    assert families
    return text


def test_the_issues_examples_cost_no_other_clients_series(tmp_path):
    base = per_client_lines(scrape(tmp_path / "base", {}, "python3"))
    assert set(base) == {"10000", "10001", "10002", "10003"}
    for i, (env, command) in enumerate([({PRIORITY: "²"}, "python3"), ({PINNED: "²=1G"}, "python3"),
                                        ({PINNED: "0=" + HUGE}, "python3"), ({VISIBLE: "0,²"}, "python3"),
                                        ({}, "evil\nname"),
                                        # the daemon's "not running" answer, as a command: not the answer
                                        ({}, "Cannot find MPS control daemon process")]):
        text = scrape(tmp_path / str(i), env, command)
        assert 'mps_exporter_collector_success{collector="control"} 1.0' in text
        assert 'mps_exporter_collector_success{collector="proc"} 1.0' in text
        lines = per_client_lines(text)
        assert {pid: lines.get(pid) for pid in ("10001", "10002", "10003")} == \
            {pid: base[pid] for pid in ("10001", "10002", "10003")}
        assert any(line.startswith("mps_client_info{") for line in lines["10000"])  # refused, not dropped
        if command == "evil\nname":
            assert 'command="evil\\nname"' in text


def test_a_client_that_cannot_be_rendered_costs_its_own_series_and_is_logged_once(tmp_path, monkeypatch, caplog):
    real = join_module._client_in_force

    def broken(pid, *args, **kwargs):  # a failure no parser foresaw, in client 10001 alone
        if pid == 10001:
            raise OverflowError("int too large to convert to float")
        return real(pid, *args, **kwargs)

    monkeypatch.setattr(join_module, "_client_in_force", broken)
    monkeypatch.setattr(join_module, "_failures_warned", set())
    for granularity in ("client", "server", "pod"):
        scen = scenarios.synthetic(tmp_path / granularity, gpus=2, clients_per_gpu=2)
        scen.cfg.client_granularity = granularity
        collector = scen.collector()
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger=join_module.__name__):
            texts = [exposition(collector) for _ in range(3)]
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "client 10001" in r.getMessage()]
        assert len(warned) == (1 if granularity == "client" else 0)  # once per process lifetime, not per scrape
        assert all("Traceback" not in r.getMessage() and r.exc_info is None for r in caplog.records)
        for text in texts:
            list(text_string_to_metric_families(text))
            if granularity == "client":
                lines = per_client_lines(text)
                assert "10001" not in lines  # not one of its series: none half-rendered
                assert {"10000", "10002", "10003"} <= set(lines)
                assert all(any(line.startswith("mps_client_info{") for line in lines[p])
                           for p in ("10000", "10002", "10003"))
            else:
                assert "mps_server_client_memory_used_bytes" in text or "mps_pod_client_memory_used_bytes" in text
                counted = [line for line in text.splitlines()
                           if line.startswith(("mps_pod_clients{", "mps_server_clients{"))]
                assert counted


# Text a tenant may put in a variable or a command name: ASCII and foreign digits, signs,
# units, separators, newlines, NaN and the infinities, and very long numbers.
HOSTILE_PIECES = st.sampled_from(["0", "1", "9", "²", "٣", "١", "-", "+", ".", "=", ",", "G", "M", "0x", "e",
                                  "nan", "inf", "NaN", "\n", "\r", "\u2028", " ", "GPU-", "MIG-", HUGE, "\x00"])
HOSTILE = st.one_of(st.lists(HOSTILE_PIECES, max_size=8).map("".join), st.text(max_size=24))
HOSTILE_ENV = st.fixed_dictionaries({}, optional={PRIORITY: HOSTILE, PINNED: HOSTILE, THREADS: HOSTILE,
                                                  VISIBLE: HOSTILE})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(env=HOSTILE_ENV, command=HOSTILE.filter(lambda c: "\x00" not in c and "\r" not in c and "\u2028" not in c),
       granularity=st.sampled_from(["client", "client", "server", "pod"]))
@example(env={PRIORITY: "²"}, command="python3", granularity="client")
@example(env={PINNED: "²=1G"}, command="python3", granularity="client")
@example(env={PINNED: "0=" + HUGE}, command="python3", granularity="server")
@example(env={VISIBLE: "0,²", PINNED: "0=1G"}, command="python3", granularity="pod")
@example(env={THREADS: "٥٠", PRIORITY: HUGE}, command="python3", granularity="client")
@example(env={THREADS: "nan"}, command="evil\nname", granularity="client")
@example(env={}, command="0\x850", granularity="client")  # NEL: a line end to str.splitlines, not to ps
@example(env={THREADS: "1e999"}, command="\n\n" + HUGE + "\nx y", granularity="client")
def test_hostile_clients_never_cost_the_scrape_or_other_clients(env, command, granularity):
    # NUL cannot be in an environment value; \r and \u2028 are not line ends of `ps` here,
    # but the fake daemon's rows would be cut by them: left to the parse_ps tests.
    env = {k: v.replace("\x00", "") for k, v in env.items()}
    with tempfile.TemporaryDirectory() as tmp:
        base = scrape(Path(tmp) / "base", {}, "python3", granularity)
        text = scrape(Path(tmp) / "hostile", env, command, granularity)
    for collector in ("control", "proc", "nvml"):
        assert f'mps_exporter_collector_success{{collector="{collector}"}} 1.0' in text
    if granularity == "client":
        lines, before = per_client_lines(text), per_client_lines(base)
        for pid in ("10001", "10002", "10003"):
            assert lines[pid] == before[pid]
        assert any(line.startswith("mps_client_info{") for line in lines["10000"])
    else:  # the sums: every client counted, its memory in them
        def sums(t: str) -> List[str]:
            return sorted(line for line in t.split("\n")
                          if line.startswith(("mps_pod_clients{", "mps_server_clients{",
                                              "mps_server_client_memory_used_bytes{",
                                              "mps_pod_client_memory_used_bytes{")))
        assert sums(text) == sums(base)


def test_set_commands_with_foreign_digits_in_control_log_are_ignored(tmp_path):
    # Anyone who reaches the control pipe writes these lines (MPS echoes each command).
    from mps_exporter.logs.pipeline import LogPipeline

    stamp = "[2026-11-21 04:19:24.390 Control   546]"
    (tmp_path / "control.log").write_text("".join(f"{stamp} Cmd:{cmd}\n" for cmd in (
        "set_active_thread_percentage ² 30", "set_active_thread_percentage 713 ٣٠",
        "set_device_pinned_mem_limit 713 ² 2G", f"set_device_pinned_mem_limit 713 0 {HUGE[:20]}T")))
    (tmp_path / "server.log").write_text("")
    from mps_exporter.families import FamilyBuilder
    from mps_exporter.logs.render import render_log_metrics

    snap = LogPipeline("default", str(tmp_path), timezone="UTC").read_once()
    out = FamilyBuilder()
    render_log_metrics(out, "default", snap, 0.0)
    internal = [s.value for fam in out.families() for s in fam.samples if s.name == "mps_log_read_errors_total"
                and s.labels["reason"] == "internal_error" and s.labels["file"] == "control"]
    assert snap.lines["control"] == 4 and internal == [0.0]  # read, and no line's handling raised
