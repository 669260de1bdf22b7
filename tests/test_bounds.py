"""Every label is declared once, as an object with its origin and bound (exporter/contract.py),
documented (docs/labels.md, generated: tests/test_catalog.py), and holds against hostile
input (issue 18 point 3)."""

from __future__ import annotations

from mps_exporter import contract as bounds
from mps_exporter.catalog import METRICS, labels
from mps_exporter.families import FamilyBuilder
from mps_exporter.logs.render import render_log_metrics
from mps_exporter.logs.parser import parse_line
from mps_exporter.logs.state import LogState

from .logs.helpers import UTC


def test_every_label_of_every_metric_has_an_origin_and_a_bound():
    for spec in METRICS.values():
        assert [label.name for label in spec.label_decls] == list(spec.labels), spec.name
        for label in spec.label_decls:
            assert label.origin in bounds.ORIGINS and label.source and label.bound, (spec.name, label)
        assert spec.input_labels == {l.name for l in spec.label_decls if l.origin == bounds.INPUT}


def test_a_label_is_declared_once_labels_of_one_name_differ_in_origin_source_or_bound():
    by_name = {}
    for label in labels():
        by_name.setdefault(label.name, []).append(label)
    for name, declared in by_name.items():
        assert len({(l.origin, l.source, l.bound) for l in declared}) == len(declared), name
    assert len(by_name["daemon"]) == 1 and len(labels()[bounds.DAEMON]) > 40  # one object, many metrics


def _series(snap, metric: str, label: str) -> set:
    out = FamilyBuilder()
    render_log_metrics(out, "default", snap, 0.0)
    return {s.labels[label] for fam in out.families() for s in fam.samples if s.name == metric}


def test_3000_exit_statuses_give_at_most_257_series():
    state = LogState()
    statuses = list(range(-1500, 1500))
    for i, status in enumerate(statuses):
        state.apply(parse_line(f"[2026-11-21 04:22:16.630 Control  546] Server {i + 1} exited with status {status}",
                               "control", UTC), "control")
    series = _series(state.snapshot(), "mps_server_exits_total", "status")
    assert series == set(bounds.EXIT_STATUSES) | {bounds.OTHER}
    assert len(series) == 257
    exits = state.snapshot().server_exits
    assert sum(exits.values()) == 3000 and exits[bounds.OTHER] == 3000 - 256  # nothing lost, only folded


def test_state_file_from_before_the_bound_is_folded():
    state = LogState()
    d = state.to_dict()
    d["maps"]["server_exits"] = {"0": 2, "1": 1, "99999": 3, "-7": 1, "9" * 40: 1}
    exits = LogState.from_dict(d).snapshot().server_exits
    assert exits == {"0": 2, "1": 1, "other": 5}


def test_1000_command_verbs_give_at_most_65_series():
    state = LogState()
    for i in range(1000):
        state.apply(parse_line(f"[2026-11-21 04:22:16.630 Control  546] Cmd:verb_{i}", "control", UTC), "control")
        state.apply(parse_line("[2026-11-21 04:22:16.630 Control  546] UI closed", "control", UTC), "control")
    series = _series(state.snapshot(), "mps_control_commands_total", "command")
    assert len(series) == bounds.MAX_COMMAND_VERBS + 1 and bounds.OTHER in series


def test_input_labels_are_cut_config_labels_are_not():
    out = FamilyBuilder()
    long = "x" * 10_000
    out.add("mps_client_info", 1, daemon="d" * 300, server_pid="1", pid="2", uid="0", user=long, command=long,
            pid_namespace=long, container_id=long, pod_uid=long, namespace=long, pod=long, container=long, owner="docker")
    out.add("mps_control_daemon_info", 1, daemon="default", version=long, pipe_directory="/p" * 200,
            log_directory="/l", claim_uid="", multiuser="")
    samples = {s.name: s.labels for fam in out.families() for s in fam.samples}
    client = samples["mps_client_info"]
    for label in ("user", "command", "pid_namespace", "container_id", "pod_uid", "namespace", "pod", "container"):
        assert len(client[label]) == bounds.MAX_LABEL_CHARS
    # A daemon's name and directories come from directories discovery found: input too.
    assert len(client["daemon"]) == bounds.MAX_LABEL_CHARS
    assert len(samples["mps_control_daemon_info"]["version"]) == bounds.MAX_LABEL_CHARS
    assert len(samples["mps_control_daemon_info"]["pipe_directory"]) == bounds.MAX_LABEL_CHARS
    out.add("mps_gpu_info", 1, gpu="0", uuid="u" * 300, name="n", driver_version="580", compute_mode="c",
            mig_mode="m")
    assert [s.labels["uuid"] for fam in out.families() for s in fam.samples
            if s.name == "mps_gpu_info"] == ["u" * 300]  # device labels are not cut
