"""Daemon discovery: the device plugin's and the DRA driver's directory layouts, found
as they come and go, each daemon with its own control reading, log pipeline and
state-file entry; the daemon's -M read from /proc."""

from __future__ import annotations

import gc
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

import pytest
from prometheus_client.exposition import generate_latest

from mps_exporter import cli
from mps_exporter.collector import build_registry
from mps_exporter.config import DEVICE_PLUGIN, DRA, GLOB, Config, DaemonConfig, DiscoveryRoot
from mps_exporter.discovery import DaemonSet, find_control_daemon, fixed_prefix, scan
from mps_exporter.errors import ConfigError
from mps_exporter.sources.base import Backends
from mps_exporter.wiring import build_collector, build_readers
from tests.fakes.fake_control import FakeClient, FakeControlDaemon, FakeDaemons, FakeServer
from tests.fakes.fake_procfs import FakeProcess, write_proc

CLAIM = "0b7e1d52-3c2a-4f8e-9a51-6d0f3e2b1c47"
CONTROL_LOG = ("[2026-11-25 10:00:00.000 Control  1000] Starting control daemon using socket {pipe}/control\n"
               "[2026-11-25 10:00:00.001 Control  1000] To connect CUDA applications to this daemon, set env "
               "CUDA_MPS_PIPE_DIRECTORY={pipe}\n")


def make_daemon_dir(directory: Path, startup_log: bool = False) -> Path:
    """A daemon's directory as the device plugin or DRA driver leaves it: pipe/control, log/*.log."""
    (directory / "pipe").mkdir(parents=True)
    (directory / "pipe" / "control").touch()  # a FIFO on a real node; discovery only asks that it exists
    (directory / "log").mkdir()
    (directory / "log" / "control.log").write_text(CONTROL_LOG.format(pipe=directory / "pipe"))
    (directory / "log" / "server.log").write_text("")
    if startup_log:
        (directory / "log" / "startup.log").write_text("startup complete\n")
    return directory


def dra_dir(root: Path, claim: str, devices: str = "a1b2c") -> Path:
    return root / "gpu.nvidia.com" / "mps" / f"{claim}-{devices}"


# ------------------------------------------------------------------ layouts
def test_scan_names_daemons_by_layout(tmp_path):
    plugin, plugins_dir = tmp_path / "run-nvidia-mps", tmp_path / "kubelet-plugins"
    make_daemon_dir(plugin / "nvidia.com" / "gpu")
    make_daemon_dir(plugin / "nvidia.com" / "gpu.shared")
    (plugin / "shm").mkdir()  # the device plugin's shared shm: no daemon
    make_daemon_dir(dra_dir(plugins_dir, CLAIM), startup_log=True)
    half = dra_dir(plugins_dir, "11111111-2222-3333-4444-555555555555")
    (half / "pipe").mkdir(parents=True)  # prepared, daemon not started yet: no control pipe

    found = scan([DiscoveryRoot(DEVICE_PLUGIN, str(plugin)), DiscoveryRoot(DRA, str(plugins_dir))])

    assert [(d.name, d.layout, d.claim_uid) for d in found] == [
        (f"{CLAIM}-a1b2c", DRA, CLAIM), ("nvidia.com/gpu", DEVICE_PLUGIN, ""),
        ("nvidia.com/gpu.shared", DEVICE_PLUGIN, "")]
    gpu = found[1]
    assert gpu.pipe_directory == str(plugin / "nvidia.com" / "gpu" / "pipe")
    assert gpu.log_directory == str(plugin / "nvidia.com" / "gpu" / "log")


def test_glob_root_names_by_the_path_below_its_fixed_part(tmp_path):
    make_daemon_dir(tmp_path / "mps" / "team-a")
    found = scan([DiscoveryRoot(GLOB, str(tmp_path / "mps" / "*"))])
    assert [(d.name, d.claim_uid) for d in found] == [("team-a", "")]
    assert fixed_prefix("/a/b/*/c") == "/a/b/"
    assert fixed_prefix("/a/b[0-9]") == "/a/"


def test_daemon_set_rescans_at_most_every_interval_and_keeps_static_first(tmp_path):
    now = [0.0]
    static = DaemonConfig("default", str(tmp_path / "static-pipe"), str(tmp_path / "static-log"))
    daemons = DaemonSet([static], [DiscoveryRoot(DRA, str(tmp_path))], interval=5.0, clock=lambda: now[0])
    assert [d.name for d in daemons.current()] == ["default"]
    make_daemon_dir(dra_dir(tmp_path, CLAIM))
    now[0] = 4.9
    assert [d.name for d in daemons.current()] == ["default"]  # not yet due
    now[0] = 5.0
    assert [d.name for d in daemons.current()] == ["default", f"{CLAIM}-a1b2c"]


def test_a_discovered_daemon_at_a_static_daemons_pipe_is_watched_once(tmp_path):
    directory = make_daemon_dir(tmp_path / "nvidia.com" / "gpu")
    static = DaemonConfig("gpu", str(directory / "pipe"), str(directory / "log"))
    daemons = DaemonSet([static], [DiscoveryRoot(DEVICE_PLUGIN, str(tmp_path))])
    assert [d.name for d in daemons.current()] == ["gpu"]


# ------------------------------------------------------------------ flags
def parse_args(argv: List[str]) -> Config:
    return cli.parse_args(argv)[1]


def test_discover_flags_and_the_default_daemon(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    cfg = parse_args(["serve", "--mps.discover", "device-plugin,dra", "--mps.discover.dra-root", "/host/plugins"])
    assert cfg.discover == [DiscoveryRoot(DEVICE_PLUGIN, "/run/nvidia/mps"), DiscoveryRoot(DRA, "/host/plugins")]
    assert cfg.daemons == []  # a DRA node has no /tmp/nvidia-mps: not watched unless named
    cfg = parse_args(["serve", "--mps.discover", "dra", "--mps.pipe-directory", "/tmp/nvidia-mps"])
    assert [d.name for d in cfg.daemons] == ["default"]
    assert [d.name for d in parse_args(["serve"]).daemons] == ["default"]
    with pytest.raises(SystemExit):
        parse_args(["serve", "--mps.discover", "kubelet"])


def test_config_file_discover_entries(tmp_path):
    path = tmp_path / "mps.yml"
    path.write_text("discover:\n  - layout: dra\n  - layout: device-plugin\n    root: /mps\n  - glob: /srv/*\n")
    cfg = parse_args(["serve", "--config.file", str(path)])
    assert cfg.daemons == []
    assert cfg.discover == [DiscoveryRoot(DRA, "/var/lib/kubelet/plugins"), DiscoveryRoot(DEVICE_PLUGIN, "/mps"),
                            DiscoveryRoot(GLOB, "/srv/*")]
    path.write_text("discover:\n  - layout: kubelet\n")
    from mps_exporter.config import load_daemons_file
    with pytest.raises(ConfigError, match=r"discover\[0\]"):
        load_daemons_file(str(path))


# ------------------------------------------------------------------ -M from /proc
def test_multiuser_from_the_daemons_command_line_through_its_root(tmp_path):
    """The DRA driver's daemon runs chrooted in a pod: its CUDA_MPS_PIPE_DIRECTORY is a path
    inside its root, matched to ours by device and inode."""
    pipe = make_daemon_dir(dra_dir(tmp_path / "plugins", CLAIM)) / "pipe"
    rootfs = tmp_path / "daemon-root"
    (rootfs / "tmp").mkdir(parents=True)
    (rootfs / "tmp" / "nvidia-mps").symlink_to(pipe)  # the pod's mount of the host directory
    proc = write_proc(tmp_path / "proc", [FakeProcess(77, comm="nvidia-cuda-mps"), FakeProcess(78)])
    (proc / "77" / "cmdline").write_bytes(b"nvidia-cuda-mps-control\0-d\0-M\0")
    (proc / "77" / "root").symlink_to(rootfs)
    (proc / "78" / "cmdline").write_bytes(b"python3\0train.py\0")
    (proc / "78" / "root").symlink_to("/")
    assert find_control_daemon(str(pipe), str(proc)) == (77, ["nvidia-cuda-mps-control", "-d", "-M"])
    assert find_control_daemon(str(tmp_path), str(proc)) is None  # another directory: no daemon


# ------------------------------------------------------------------ live set
def discovery_config(tmp_path: Path, roots: List[DiscoveryRoot], state_file: bool = True) -> Config:
    cfg = Config()
    cfg.discover = roots
    cfg.discovery_interval = 0.2
    cfg.procfs = str(write_proc(tmp_path / "proc", []))
    cfg.collectors.update(nvml=False, dcgm=False, proc=False)
    cfg.log_timezone = "UTC"
    cfg.state_file = str(tmp_path / "state.json") if state_file else None
    return cfg


def scrape(collector) -> str:
    return generate_latest(build_registry(collector, process=False)).decode()


def daemons_in(text: str) -> Dict[str, str]:
    """daemon -> its mps_control_daemon_up value."""
    out = {}
    for line in text.splitlines():
        if line.startswith("mps_control_daemon_up{"):
            out[line.split('daemon="', 1)[1].split('"', 1)[0]] = line.rsplit(" ", 1)[1]
    return out


def state_daemons(cfg: Config) -> set:
    """The daemons the state file holds (none while it is not written yet)."""
    path = Path(cfg.state_file or "")
    return set(json.loads(path.read_text())) if path.is_file() else set()


def wait_for(predicate: Callable[[], bool], seconds: float = 40.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


def test_both_layouts_come_and_go_while_serving(tmp_path):
    plugin, plugins_dir = tmp_path / "mps-root", tmp_path / "plugins"
    plugin.mkdir()
    plugins_dir.mkdir()
    cfg = discovery_config(tmp_path, [DiscoveryRoot(DEVICE_PLUGIN, str(plugin)), DiscoveryRoot(DRA, str(plugins_dir))])
    uuid = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"
    fakes = FakeDaemons()
    readers = build_readers(cfg, Backends(control_runner=fakes))
    for r in readers.values():
        r.start()
    collector = build_collector(cfg, readers)
    try:
        assert daemons_in(scrape(collector)) == {}
        # The daemons answer before their directories appear: a scan between the two would
        # read a daemon that is not running yet.
        gpu, claim = plugin / "nvidia.com" / "gpu", dra_dir(plugins_dir, CLAIM)
        fakes.by_pipe[str(gpu / "pipe")] = FakeControlDaemon(servers=[FakeServer(500)],
                                                             clients=[FakeClient(501, 500, uuid)])
        fakes.by_pipe[str(claim / "pipe")] = FakeControlDaemon()
        make_daemon_dir(gpu)
        make_daemon_dir(claim, startup_log=True)
        wait_for(lambda: len(daemons_in(scrape(collector))) == 2)
        text = scrape(collector)
        assert daemons_in(text) == {"nvidia.com/gpu": "1.0", f"{CLAIM}-a1b2c": "1.0"}
        assert f'claim_uid="{CLAIM}",daemon="{CLAIM}-a1b2c"' in text
        assert 'mps_server_clients{daemon="nvidia.com/gpu",server_pid="500"} 1.0' in text
        # Each daemon's logs have their own pipeline: control.log's lines counted per daemon.
        wait_for(lambda: f'mps_log_lines_total{{daemon="{CLAIM}-a1b2c",file="control"}} 2.0' in scrape(collector))
        wait_for(lambda: state_daemons(cfg) == {"nvidia.com/gpu", f"{CLAIM}-a1b2c"})

        # The DRA driver releases the claim: the directory goes, directory and all.
        shutil.rmtree(claim)
        del fakes.by_pipe[str(claim / "pipe")]
        text = scrape(collector)  # the logs source drops it at once instead of failing
        assert 'mps_exporter_collector_success{collector="logs"} 1.0' in text
        wait_for(lambda: list(daemons_in(scrape(collector))) == ["nvidia.com/gpu"])
        assert CLAIM not in scrape(collector)
        wait_for(lambda: state_daemons(cfg) == {"nvidia.com/gpu"})
    finally:
        for r in readers.values():
            r.close()


@pytest.mark.slow
def test_200_claims_appear_and_leave_leaving_nothing_behind(tmp_path):
    """Done-when 1: 200 DRA claims' daemons appear within one re-scan and leave within one
    after their directories are removed; memory and the state file return to their size."""
    plugins_dir = tmp_path / "plugins"
    static_dir = make_daemon_dir(tmp_path / "static")
    cfg = discovery_config(tmp_path, [DiscoveryRoot(DRA, str(plugins_dir))])
    cfg.daemons = [DaemonConfig("default", str(static_dir / "pipe"), str(static_dir / "log"))]
    fakes = FakeDaemons({str(static_dir / "pipe"): FakeControlDaemon()})
    readers = build_readers(cfg, Backends(control_runner=fakes))
    for r in readers.values():
        r.start()
    collector = build_collector(cfg, readers)
    pipelines = readers["logs"].source.pipelines
    controls = readers["control"].source
    claims = [f"{i:08x}-0000-4000-8000-{i:012x}" for i in range(200)]

    held: List[int] = []  # allocated blocks while the 200 are watched

    def cycle() -> None:
        for claim in claims:
            fakes.by_pipe[str(dra_dir(plugins_dir, claim) / "pipe")] = FakeControlDaemon()
            make_daemon_dir(dra_dir(plugins_dir, claim))
        started = time.monotonic()
        wait_for(lambda: len(daemons_in(scrape(collector))) == 201)
        assert time.monotonic() - started < 2 * cfg.discovery_interval + 10  # a re-scan, plus the scrape
        wait_for(lambda: len(state_daemons(cfg)) == 201)
        assert len(pipelines) == 201 and len(controls) == 201
        held.append(sys.getallocatedblocks())
        shutil.rmtree(plugins_dir / "gpu.nvidia.com" / "mps")
        fakes.by_pipe = {str(static_dir / "pipe"): fakes.by_pipe[str(static_dir / "pipe")]}
        wait_for(lambda: list(daemons_in(scrape(collector))) == ["default"])
        wait_for(lambda: len(pipelines) == 1 and len(controls) == 1)

    try:
        wait_for(lambda: Path(cfg.state_file).exists())
        state_before = Path(cfg.state_file).stat().st_size
        cycle()  # the first one warms caches (regexes, thread pool, interned names) that stay
        # Blocks the interpreter holds (tracemalloc would slow 200 threads past the waits).
        gc.collect()
        before = sys.getallocatedblocks()
        cycle()
        gc.collect()
        grown = sys.getallocatedblocks() - before
        print(f"200 claims, second cycle: {held[-1] - before:+d} allocated blocks while watched, {grown:+d} after; state file {state_before} -> "
              f"{Path(cfg.state_file).stat().st_size} bytes")
        assert set(json.loads(Path(cfg.state_file).read_text())) == {"default"}
        assert Path(cfg.state_file).stat().st_size <= state_before + 64  # offsets may grow by digits
        # What 200 daemons hold while watched (pipelines, followers, states, readings) would
        # show here if any of it stayed behind.
        assert grown < (held[-1] - before) / 50, f"{grown} blocks held after 200 daemons came and went"
        threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("mps-logs-"))
        assert threads == ["mps-logs-default", "mps-logs-discovery"]  # the gone daemons' threads ended
    finally:
        for r in readers.values():
            r.close()


def test_status_lists_every_daemon_found(tmp_path):
    import io

    from mps_exporter.status import command

    plugin, plugins_dir = tmp_path / "mps-root", tmp_path / "plugins"
    gpu = make_daemon_dir(plugin / "nvidia.com" / "gpu")
    make_daemon_dir(dra_dir(plugins_dir, CLAIM))  # its daemon not running: listed all the same
    cfg = discovery_config(tmp_path, [DiscoveryRoot(DEVICE_PLUGIN, str(plugin)), DiscoveryRoot(DRA, str(plugins_dir))],
                           state_file=False)
    cfg.status.output = "json"
    fakes = FakeDaemons({str(gpu / "pipe"): FakeControlDaemon(servers=[FakeServer(500)])})
    out = io.StringIO()
    command.status(cfg, out, Backends(control_runner=fakes))
    listed = {d["name"]: d for d in json.loads(out.getvalue())["daemons"]}
    assert set(listed) == {"nvidia.com/gpu", f"{CLAIM}-a1b2c"}
    assert [s["pid"] for s in listed["nvidia.com/gpu"]["servers"]] == [500]
    assert listed[f"{CLAIM}-a1b2c"]["claim_uid"] == CLAIM
    cfg.status.output = "text"
    out = io.StringIO()
    command.status(cfg, out, Backends(control_runner=fakes))
    assert "MPS daemon nvidia.com/gpu: up" in out.getvalue()
    assert f"MPS daemon {CLAIM}-a1b2c: DOWN" in out.getvalue()


# ------------------------------------------------------------------ the live run's logs
LIVE = Path(__file__).resolve().parent / "data" / "captures" / "h100-discovery"


@pytest.mark.parametrize("daemon", ["device-plugin-nvidia.com_gpu", "dra-claim-multiuser", "dra-claim-later"])
def test_live_daemons_logs_read_whole(daemon):
    """The three daemons of the H100 run (tests/gpu/reports/h100-discovery): every line known,
    one server, one client, whatever layout; the -M daemon's client waits for its server
    to start (never behind another user)."""
    from mps_exporter.logs.pipeline import LogPipeline

    snap = LogPipeline(daemon, str(LIVE / daemon), timezone="UTC").read_once()
    assert snap.unrecognized == {"control": 0, "server": 0}
    assert (snap.count("mps_server_starts_total"), snap.count("mps_client_connections_total")) == (1, 1)
    assert snap.pushes["user_switch"] == 0


def test_device_plugin_daemon_without_its_log_directory_keeps_the_logs_collector_up(tmp_path):
    """The device plugin removes a daemon's log directory at every restart of its daemon pod
    while the pipe directory stays: the daemon is still watched and the logs collector
    still succeeds; the missing directory shows in mps_log_read_errors_total."""
    plugin = tmp_path / "mps-root"
    gpu = make_daemon_dir(plugin / "nvidia.com" / "gpu")
    cfg = discovery_config(tmp_path, [DiscoveryRoot(DEVICE_PLUGIN, str(plugin))], state_file=False)
    fakes = FakeDaemons({str(gpu / "pipe"): FakeControlDaemon()})
    readers = build_readers(cfg, Backends(control_runner=fakes))
    for r in readers.values():
        r.start()
    collector = build_collector(cfg, readers)
    try:
        wait_for(lambda: 'mps_log_lines_total{daemon="nvidia.com/gpu",file="control"} 2.0' in scrape(collector))
        shutil.rmtree(gpu / "log")
        wait_for(lambda: 'reason="missing_directory"} 1.0' in scrape(collector))
        text = scrape(collector)
        assert daemons_in(text) == {"nvidia.com/gpu": "1.0"}
        assert 'mps_exporter_collector_success{collector="logs"} 1.0' in text
    finally:
        for r in readers.values():
            r.close()


def test_capture_records_the_daemons_found_at_its_start(tmp_path):
    """A bundle holds a fixed daemon list: discovery's daemons join the static ones, with
    their logs, and replay finds them by position (a resource name is no file name)."""
    from mps_exporter.bundle import load
    from mps_exporter.capture import capture

    plugin = tmp_path / "mps-root"
    gpu = make_daemon_dir(plugin / "nvidia.com" / "gpu")
    cfg = discovery_config(tmp_path, [DiscoveryRoot(DEVICE_PLUGIN, str(plugin))], state_file=False)
    cfg.capture.out = str(tmp_path)
    cfg.capture.duration_seconds, cfg.capture.interval_seconds = 0.6, 0.2
    fakes = FakeDaemons({str(gpu / "pipe"): FakeControlDaemon(servers=[FakeServer(500)])})
    assert capture(cfg, readers=build_readers(cfg, Backends(control_runner=fakes), recorded=True)) == 0
    (path,) = tmp_path.glob("mps-capture-*.jsonl.gz")
    bundle = load(str(path))
    assert [d["name"] for d in bundle.header["daemons"]] == ["nvidia.com/gpu"]
    assert b"Starting control daemon" in b"".join(c.data for c in bundle.logs if c.daemon == "nvidia.com/gpu")


def test_the_logs_quick_read_answers_between_scans_and_leaves_comings_and_goings_to_the_thread(tmp_path):
    from mps_exporter.logs.pipeline import LogPipeline
    from mps_exporter.sources.base import PartialFailure
    from mps_exporter.sources.logs import DaemonPipelines, pipelines_reader

    def answer(read):  # what a read returned, or kept while failing (catching up, a problem)
        try:
            return read(None)
        except PartialFailure as e:
            return e.result

    plugins_dir = tmp_path / "plugins"
    now = [0.0]
    daemons = DaemonSet([], [DiscoveryRoot(DRA, str(plugins_dir))], interval=5.0, clock=lambda: now[0])
    pipelines = DaemonPipelines(daemons, lambda d: LogPipeline(d.name, d.log_directory, timezone="UTC"))
    reader = pipelines_reader(pipelines)
    assert reader.quick is not None
    claim = "00000001-0000-4000-8000-000000000001"
    make_daemon_dir(dra_dir(plugins_dir, claim))
    assert reader.quick(None) is None  # never synced (and a scan is due): the thread reads
    assert list(answer(reader.read)) == [f"{claim}-a1b2c"]
    for p in pipelines.pipelines.values():
        p.read_once()
    assert list(answer(reader.quick)) == [f"{claim}-a1b2c"]  # between scans: at once, in the scrape
    make_daemon_dir(dra_dir(plugins_dir, "00000002-0000-4000-8000-000000000002"))
    now[0] += 5.0
    assert reader.quick(None) is None  # a scan is due: it may start or stop a pipeline
    daemons.rescan()
    assert reader.quick(None) is None  # the daemons watched changed: sync() has work
    assert len(answer(reader.read)) == 2
    for p in pipelines.pipelines.values():
        p.read_once()
    assert len(answer(reader.quick)) == 2
    shutil.rmtree(dra_dir(plugins_dir, claim) / "log")
    for p in pipelines.pipelines.values():
        p.read_once()  # the missing directory is a problem of that pipeline
    assert reader.quick(None) is None  # problems: read() sees to them
