"""How a metric is declared: its labels as objects carrying origin and bound, its spec.

A metric is declared once, next to the code that emits it (render.py for the
joined GPU, daemon, server and client tables and the exporter's own families,
logs/render.py for the log families, a source module for what that source
renders alone), by `table(title, gauge(...), counter(...), ...)`. Declaring
registers the spec here, where `FamilyBuilder` looks every sample up: it refuses
undeclared names and wrong label sets, and cuts INPUT label values, so the
exposition cannot drift from the declarations. `catalog.METRICS` assembles every
declaration in table order; README's metric table and docs/labels.md are
generated from it (`make generate`).

Labels: any process on a node can write to the MPS log files, and users choose
their processes' names and cgroups: a label taken from there could otherwise grow
the series without bound (3,000 random exit statuses once made 3,001 series of
mps_server_exits_total). So every label is a `Label` that says where its value
comes from and what bounds it. A label used by several metrics is one object
(the shared ones below); a metric whose label of the same name is bounded
differently declares its own object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Collection, Dict, FrozenSet, Tuple

GAUGE = "gauge"
COUNTER = "counter"
HISTOGRAM = "histogram"

# Where a label's value comes from.
CONFIG = "configuration"  # the operator's flags or config file
FIXED = "fixed"  # a closed set in the code
DEVICE = "device"  # NVML: the GPUs and driver of the node
INPUT = "input"  # what processes and users on the node write: MPS logs, control output, /proc
ORIGINS = (CONFIG, FIXED, DEVICE, INPUT)

OTHER = "other"  # the value of everything past a bound
MAX_LABEL_CHARS = 128  # any INPUT label value is cut to this many characters (FamilyBuilder)
CUT = f"cut to {MAX_LABEL_CHARS} characters"


@dataclass(frozen=True)
class Label:
    name: str
    origin: str  # CONFIG, FIXED, DEVICE or INPUT
    source: str  # where the value comes from
    bound: str  # what keeps the number of values (and their length) bounded

    def __post_init__(self) -> None:
        if self.origin not in ORIGINS:
            raise ValueError(f"label {self.name}: origin {self.origin!r} is not one of {ORIGINS}")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str
    help: str
    label_decls: Tuple[Label, ...]
    table: str = ""  # the README table it is listed in (set by `table`)
    # Derived from label_decls: the names, as a set for the per-sample check, and the
    # INPUT ones whose values FamilyBuilder cuts to MAX_LABEL_CHARS.
    labels: Tuple[str, ...] = field(init=False)
    label_set: FrozenSet[str] = field(init=False, repr=False)
    input_labels: FrozenSet[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        names = tuple(label.name for label in self.label_decls)
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: a label appears twice in {names}")
        object.__setattr__(self, "labels", names)
        object.__setattr__(self, "label_set", frozenset(names))
        object.__setattr__(self, "input_labels", frozenset(l.name for l in self.label_decls if l.origin == INPUT))


def gauge(name: str, help_text: str, *labels: Label) -> MetricSpec:
    return MetricSpec(name, GAUGE, help_text, labels)


def counter(name: str, help_text: str, *labels: Label) -> MetricSpec:
    if not name.endswith("_total"):
        raise ValueError(f"counter {name} must end in _total")
    return MetricSpec(name, COUNTER, help_text, labels)


def histogram(name: str, help_text: str, *labels: Label) -> MetricSpec:
    return MetricSpec(name, HISTOGRAM, help_text, labels)


# Every declared spec by name, filled as the declaring modules are imported. The
# complete list, in table order: catalog.METRICS.
DECLARED: Dict[str, MetricSpec] = {}


def table(title: str, *specs: MetricSpec) -> Tuple[MetricSpec, ...]:
    """Declare these metrics, listed under `title` in README's metric table."""
    out = tuple(replace(spec, table=title) for spec in specs)
    for spec in out:
        known = DECLARED.get(spec.name)
        if known is not None and known != spec:  # the same declaration imported twice is fine
            raise ValueError(f"{spec.name} is declared twice, differently")
        DECLARED[spec.name] = spec
    return out


# ---------------------------------------------------------------- labels many metrics share
GPU = Label("gpu", DEVICE, "NVML device index; pinned limits: the device ordinal MPS names",
            "the node's GPUs (log-only ordinals: those of running servers)")
UUID = Label("uuid", DEVICE, "NVML", "one per GPU")
# Daemons found under discovery roots (anyone who can make a directory there names one).
MAX_DISCOVERED = 512
DAEMON = Label("daemon", INPUT, "`--config.file` daemon names (default `default`); discovered daemons: the directory "
               "below the root (device plugin: the resource name; DRA: `<claim UID>-<hash>`); found by process "
               "only: its pipe directory where the host has it at that path, else `<pid>:<pipe directory>`",
               f"the configured daemons plus at most {MAX_DISCOVERED} discovered, gone when their directory or "
               f"process goes; {CUT}")
SERVER_PID = Label("server_pid", INPUT, "control daemon `get_server_list` / `ps`, else the logs' running servers",
                   "running servers (the logs remember at most 1024)")
CLIENT_PID = Label("pid", INPUT, "control daemon `ps`, NVML's MPS client list",
                   "running clients (MPS admits at most 48 per GPU; the logs remember at most 4096)")
UID = Label("uid", INPUT, "/proc/PID/status, else the logs", "one per running server or client")
USER = Label("user", INPUT, "passwd name of the uid (else the uid)", f"one per running server or client; {CUT}")


# ---------------------------------------------------------------- bounds on values taken from input
# mps_server_exits_total{status}: what wait() can report is 0..255; anything else is "other".
EXIT_STATUSES = frozenset(str(n) for n in range(256))

# mps_control_commands_total{command}: MPS verbs are lower-case words; the first
# MAX_COMMAND_VERBS distinct ones are kept, the rest (typos in a control session) count as "other".
MAX_COMMAND_VERBS = 64
_VERB = re.compile(r"[a-z][a-z0-9_]{0,47}")


def exit_status(status: int) -> str:
    value = str(status)
    return value if value in EXIT_STATUSES else OTHER


def command_verb(verb: str, known: Collection[str]) -> str:
    """The label of a `Cmd:` verb, given the verbs already counted."""
    if not _VERB.fullmatch(verb):
        return OTHER
    if verb not in known and len(known) >= MAX_COMMAND_VERBS:
        return OTHER
    return verb


# Histogram buckets of mps_exporter_collector_read_duration_seconds: 1 ms to 10 s.
READ_DURATION_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Histogram buckets of mps_client_queue_wait_seconds: 50 ms to 10 min.
QUEUE_WAIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 60, 120, 300, 600)
# A queue wait longer than this, or negative, is a clock step or a corrupt timestamp.
MAX_PLAUSIBLE_QUEUE_WAIT = 86400.0
