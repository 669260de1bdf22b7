"""What a source declares about itself; `registry.SOURCES` collects every module's `SOURCE`.

Names: a `Source` subclass (`NvmlSourceSpec`, ...) is the declaration; the library
clients it builds live beside it and are named for what they talk to (`NvmlClient`,
`DcgmClient`, `ProcClient`, `control.ControlClient` and its per-daemon `DaemonReader`).
A module is named after its collector (`proc.py` is `--collector.proc`).

A source module ends with `SOURCE = SomeSource()`, a `Source` that says:
- its collector name and flag default (`--collector.NAME`, `--no-collector.NAME`);
- `flags`: the command-line flags only it reads (`Flag`: serve, dump, capture and
  status take them);
- `metrics`: the metrics it renders alone, declared in its module with
  `contract.table` (README's table and docs/labels.md list them: `make generate`);
- `build`: its live reader from the configuration (None: not available here);
- `store`: where its reading goes in the `Snapshot` that render reads, and `render`:
  the families a source renders alone (default: its reading in `Snapshot.extra`,
  rendered by its `render`; the sources joined into the GPU, server and client
  tables store into the snapshot's typed fields instead);
- `record`/`load`/`replay`: how a capture bundle holds its readings (the
  default: the reading as JSON, decoded back through `reading_type`).
cli (flags), service (wiring), collector (reading), capture and replay iterate
the registry: adding a source is one module here plus its tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar, Union, cast

from ..codec import RecordedFailure, encode, recorded
from ..config import Config
from ..contract import MetricSpec
from ..families import FamilyBuilder
from ..model import Snapshot

R = TypeVar("R")


class ReadContext:
    """What a read may ask of the collection it belongs to (collector.py implements it)."""

    now: float  # the collection's clock

    def devices(self) -> List[int]:
        """The GPU indexes NVML knows ([0] before it has answered once)."""
        raise NotImplementedError

    def uuids(self) -> Dict[int, str]:
        """The UUIDs of those GPUs by index ({} before NVML has answered once)."""
        raise NotImplementedError

    def wait(self, names: Sequence[str]) -> Snapshot:
        """Wait for these sources of the same collection (under a deadline, for at most
        half the time left); the snapshot so far. A source that fails, is disabled or is
        late leaves its part empty."""
        raise NotImplementedError

    def known(self, names: Sequence[str]) -> Snapshot:
        """These sources as far as they are known now, without waiting: a read of this
        collection that has ended, else the last reading that may stand in for it."""
        raise NotImplementedError


def _nothing() -> None:
    return None


def _always() -> bool:
    return True


def _unheard(exits: Any) -> None:
    return None


@dataclass
class Reader(Generic[R]):
    """A built source. `read` runs once per collection, in its own thread."""

    read: Callable[[ReadContext], R]
    # The same read where it can answer from what the source keeps, with no I/O that may
    # block (a stat() of /proc or of a local log at most), run in the scrape's own thread;
    # None where it cannot (a new process, a daemon come or gone), and `read` runs in the
    # source's thread. Each hand-off to another thread cost a scrape milliseconds on
    # cores that a client storm keeps busy (issue 29).
    quick: Optional[Callable[[ReadContext], Optional[R]]] = None
    start: Callable[[], None] = _nothing  # serve: start background work (log followers)
    catch_up: Callable[[], None] = _nothing  # dump: take in what is there now, synchronously
    close: Callable[[], None] = _nothing
    # serve: False while what it would serve is not yet true (the logs catching up on
    # their history); /-/ready answers 503 until every reader is ready.
    ready: Callable[[], bool] = _always
    # serve: the kernel's process exits (exitstatus.ExitWatcher, where it listens), for a
    # source that can spare work with them (proc: no stat() of a process that has not exited)
    hear_exits: Callable[[Any], None] = _unheard
    source: Any = field(default=None, repr=False)  # the live object, for tests and benchmarks


@dataclass
class Backends:
    """The library boundaries, replaced by fakes in tests and the benchmark."""

    nvml_module: Any = None  # None: import pynvml
    control_runner: Any = None  # control.Runner; None: run the real program
    # The daemons to watch (discovery.DaemonSet), shared by the sources that read per
    # daemon; None: built from the configuration (wiring.build_readers).
    daemon_set: Any = None
    # The wall clock; replay's present clock, for the log state's check of line times.
    clock: Callable[[], float] = time.time
    # NVML fakes that answer at once: every GPU's read and GPM work waited for, no stand-in
    # (a late answer there is the scheduler's: at load 34 a 0 ms fake missed the 0.25 s wait).
    nvml_wait_for_every_answer: bool = False


class PartialFailure(Exception):
    """A source failed in part: keep what it read, report the collector as failed."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class Flag:
    """A flag a source declares, e.g. `Flag("--mps.command-timeout", "command_timeout", ...)`.

    Its value lands in the Config field `dest`, whose default is the flag's (help texts
    say `%(default)s`). A setting no Config field holds, one new source's own, is
    `cfg.settings[dest]`, with its `default` given here.
    """

    name: str
    dest: str
    help: str
    refuses: Tuple[str, ...]  # values it rejects with one line and exit 2 (tests/test_cli.py walks them)
    type: Callable[[str], Any] = str
    # The value as the setting; raises ValueError (the flag's name is put before the message).
    check: Optional[Callable[[Any], Any]] = None
    default: Any = None  # only for a dest that is no Config field
    repeatable: bool = False  # each use appends; unused, the Config default stands
    metavar: Optional[str] = None


def not_empty(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


def positive(value: float) -> float:
    if not value > 0:
        raise ValueError("must be positive")
    return value


def not_negative(value: float) -> float:
    if not value >= 0:
        raise ValueError("must not be negative")
    return value


class Source(Generic[R]):
    name: ClassVar[str]
    help: ClassVar[str]
    default: ClassVar[Union[bool, str]] = True  # "auto": on where its library is found
    recorded: ClassVar[bool] = True  # False: capture and replay carry its input instead (the logs)
    reading_type: ClassVar[Any] = None  # what a read returns, for decoding bundles
    # True: read between scrapes by the collector's refresher (--collector.refresh-interval),
    # for reads that are slow or slow down in a client storm; scrapes serve the latest one.
    # False: read in every scrape (cheap at scrape time, docs/performance.md says why).
    background: ClassVar[bool] = False
    # True: a scrape waits at most --collector.control-wait for this read; not done by then,
    # it serves the last reading and the read ends for the next scrape (for reads that must
    # not run on a timer yet stall in a client storm: the control daemon's commands).
    served_while_reading: ClassVar[bool] = False
    flags: ClassVar[Tuple[Flag, ...]] = ()
    metrics: ClassVar[Tuple[MetricSpec, ...]] = ()  # what `render` emits: its `contract.table(...)`

    def setting(self, cfg: Config, dest: str) -> Any:
        """The value of this source's flag `dest` that no Config field holds (its default
        where the command line did not set it: tests, replay)."""
        if dest in cfg.settings:
            return cfg.settings[dest]
        return next(flag.default for flag in self.flags if flag.dest == dest)

    def enabled(self, cfg: Config) -> bool:
        return cfg.collectors.get(self.name, self.default) is not False

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[R]]:
        raise NotImplementedError

    def store(self, snap: Snapshot, reading: R) -> None:
        snap.extra[self.name] = reading

    def render(self, out: FamilyBuilder, snap: Snapshot) -> None:
        """Families of this source alone, from `self.reading(snap)` (render.py calls it)."""

    def reading(self, snap: Snapshot) -> Optional[R]:
        """What `store` put into the snapshot by default (None: no reading)."""
        return cast(Optional[R], snap.extra.get(self.name))

    # ---------------------------------------------------------- bundles
    def record(self, reading: R) -> Any:
        return record_value(reading)

    def record_failure(self, message: str) -> Any:
        return {"error": message}

    def load(self, entry: Any) -> Any:
        """A recorded entry, checked: what `replay` takes. ValueError when damaged."""
        return recorded(entry, self.reading_type, self.name)

    def replay(self, loaded: Any) -> R:
        """The reading again, or the recorded error raised again."""
        result: R = replay_value(loaded)
        return result

    def shift(self, reading: R, seconds: float) -> R:
        """The replayed reading with every unix time it holds moved by `seconds` (replay
        on the present clock), as a copy: the bundle's reading is played again. A
        reading that holds no time (the default) stays as it is."""
        return reading


def record_value(reading: Any) -> Any:
    """A reading as its bundle entry."""
    return {"value": encode(reading)}


def replay_value(loaded: Any) -> Any:
    """A loaded bundle entry: its reading, or the recorded error raised again."""
    if isinstance(loaded, RecordedFailure):
        raise RecordedFailure(str(loaded))
    return loaded
