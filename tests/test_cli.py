"""The `mps-exporter` program itself, as a user runs it on a machine without a GPU."""

import socket
import subprocess
import threading
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mps_exporter.sources.registry import SOURCES
from tests.support.data import CAPTURE, EDGES, LIMITS24
from tests.support.tools import require
EXE = [sys.executable, "-m", "mps_exporter.cli"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def test_serves_without_gpu_and_keeps_serving(tmp_path):
    port = free_port()
    (tmp_path / "log").mkdir()
    proc = subprocess.Popen(EXE + ["--web.listen-address", f"127.0.0.1:{port}", "--mps.pipe-directory", str(tmp_path / "pipe"),
                                   "--mps.log-directory", str(tmp_path / "log"),
                                   "--mps.control-binary", str(tmp_path / "no-such-nvidia-cuda-mps-control")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 20
        while True:
            try:
                status, body = get(f"http://127.0.0.1:{port}/metrics")
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "exporter did not come up"
                time.sleep(0.2)
        assert status == 200
        assert 'mps_exporter_collector_success{collector="nvml"} 0.0' in body
        assert 'mps_control_daemon_up{daemon="default"} 0.0' in body
        assert 'mps_exporter_build_info{' in body
        # the log files do not exist yet (MPS has not started): not an error
        assert 'mps_exporter_collector_success{collector="logs"} 1.0' in body
        for _ in range(3):  # and it keeps serving
            assert get(f"http://127.0.0.1:{port}/metrics")[0] == 200
        status, landing = get(f"http://127.0.0.1:{port}/")
        assert status == 200 and "/metrics" in landing
        assert get(f"http://127.0.0.1:{port}/-/healthy")[0] == 200
        assert proc.poll() is None
    finally:
        proc.terminate()
        out = proc.communicate(timeout=10)[0]
    assert proc.returncode == 0, out
    # failures are logged once, in logfmt, not on every scrape
    assert out.count("collector nvml failed") == 1, out
    # and where NVML is missing, the warning points at the demo
    (nvml_failed,) = [line for line in out.splitlines() if "collector nvml failed" in line]
    assert "level=warn" in nvml_failed and "mps-exporter replay" in nvml_failed, nvml_failed


def test_dump_of_a_captured_log_directory_passes_promtool():
    res = subprocess.run(EXE + ["dump", "--mps.log-directory", str(CAPTURE), "--mps.pipe-directory", "/nonexistent",
                                "--mps.control-binary", "/nonexistent/nvidia-cuda-mps-control", "--mps.log-timezone", "UTC"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert 'mps_fatal_gpu_errors_total{daemon="default"} 1.0' in res.stdout
    assert 'mps_server_handoffs_total{daemon="default"} 4.0' in res.stdout
    check = subprocess.run([require("promtool"), "check", "metrics"], input=res.stdout, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), check.stdout + check.stderr


def dump(log_directory: Path) -> str:
    res = subprocess.run(EXE + ["dump", "--mps.log-directory", str(log_directory), "--mps.pipe-directory", "/nonexistent",
                                "--mps.control-binary", "/nonexistent/nvidia-cuda-mps-control", "--mps.log-timezone", "UTC",
                                "--no-collector.nvml"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_dump_counts_terminate_client_and_knows_every_line_of_the_issue_24_run():
    """The whole logs of the H100 run of issue 24: one `terminate_client`, a server started
    under `set_default_client_priority 1`, clients of every limit form."""
    out = dump(LIMITS24)
    for sample in ('mps_clients_terminated_total{daemon="default"} 1.0',
                   'mps_server_starts_total{daemon="default"} 5.0',
                   'mps_control_commands_total{command="terminate_client",daemon="default"} 1.0',
                   'mps_control_commands_total{command="set_default_client_priority",daemon="default"} 2.0',
                   'mps_log_unrecognized_lines_total{daemon="default",file="control"} 0.0',
                   'mps_log_unrecognized_lines_total{daemon="default",file="server"} 0.0'):
        assert sample in out, sample


def test_dump_counts_the_fatal_gpu_error_of_a_cuda_11_server():
    out = dump(Path(__file__).parent / "logs" / "fixtures" / "cuda11-fatal")
    for sample in ('mps_fatal_gpu_errors_total{daemon="default"} 1.0',
                   'mps_client_connections_total{daemon="default"} 2.0',
                   'mps_log_unrecognized_lines_total{daemon="default",file="control"} 0.0',
                   'mps_log_unrecognized_lines_total{daemon="default",file="server"} 0.0'):
        assert sample in out, sample


def test_dump_counts_refusals_and_a_server_killed_under_its_client():
    """Real lines of the H100 run (an excerpt: three of its refusal lines, the server
    SIGKILLed under client 3965 and the next one, shut down after its client left)."""
    out = dump(Path(__file__).parent / "logs" / "fixtures" / "h100-edges-excerpt")
    for sample in ('mps_client_rejections_total{daemon="default",reason="client_limit"} 3.0',
                   'mps_server_client_limit{daemon="default"} 48.0',
                   'mps_server_exits_with_clients_total{daemon="default"} 1.0',
                   'mps_server_exits_total{daemon="default",status="0"} 2.0',
                   'mps_log_unrecognized_lines_total{daemon="default",file="control"} 0.0',
                   'mps_log_unrecognized_lines_total{daemon="default",file="server"} 0.0'):
        assert sample in out, sample
    # The whole run: 4 refusals, 4 exits with status 0, one of them under a client.
    out = dump(EDGES)
    for sample in ('mps_client_rejections_total{daemon="default",reason="client_limit"} 4.0',
                   'mps_server_exits_with_clients_total{daemon="default"} 1.0',
                   'mps_server_exits_total{daemon="default",status="0"} 4.0',
                   # a refused client's context 0 connects, and `Client process P disconnected` comes twice;
                   # the client of the killed server never disconnects
                   'mps_client_connections_total{daemon="default"} 56.0',
                   'mps_client_disconnections_total{daemon="default"} 55.0',
                   'mps_log_unrecognized_lines_total{daemon="default",file="server"} 0.0'):
        assert sample in out, sample


@pytest.mark.parametrize("args,message", [
    (["--no-such-flag"], "unrecognized arguments"),
    (["--mps.command-timeout", "0"], "--mps.command-timeout must be positive"),
    (["--web.telemetry-path", "metrics"], "must start with '/'"),
    (["--config.file", "/nonexistent.yml"], "cannot read config file"),
    (["--log.level", "loud"], "invalid choice"),
    # issue 43: the proc collector reported success reading nothing
    (["--path.procfs", "/nonexistent/proc"], "--path.procfs '/nonexistent/proc': no such directory"),
    (["dump", "--path.procfs", "/dev/null"], "--path.procfs '/dev/null': not a directory"),
])
def test_bad_flags_give_one_line_and_exit_2(args, message, capsys):
    code, lines = parse_error(args, capsys)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def parse_error(args, capsys):
    """(exit code, stderr lines) of the command line's parse, in this process (a process of
    its own costs a second of imports; the next test checks the real process once)."""
    from mps_exporter.cli import parse_args

    with pytest.raises(SystemExit) as exit:
        parse_args(args)
    return exit.value.code, capsys.readouterr().err.strip().splitlines()


def test_a_bad_flag_ends_the_process_with_one_line_and_exit_2():
    res = subprocess.run(EXE + ["dump", "--log.level", "loud"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "invalid choice" in res.stderr


@pytest.mark.parametrize("content,message", [
    ("daemons: [", "not valid YAML"),
    ("daemons: []", "non-empty list under 'daemons'"),
    ("daemons:\n  - name: a\n", "needs 'name' and 'pipe_directory'"),
    ("daemons:\n  - {name: a, pipe_directory: /p}\n  - {name: a, pipe_directory: /q}\n", "appears twice"),
    ("daemons:\n  - {name: a, pipe_directory: /p, colour: red}\n", "unknown keys"),
])
def test_bad_config_file(tmp_path, content, message, capsys):
    f = tmp_path / "mps.yml"
    f.write_text(content)
    code, lines = parse_error(["dump", "--config.file", str(f)], capsys)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("content,where", [
    # issue 43: PyYAML's first line ("while parsing a flow sequence") said neither what nor where
    ("daemons:\n  - name: a\n    pipe_directory: [/p\n", "line 4, column 1: expected ',' or ']', but got '<stream end>' "
                                                          "(while parsing a flow sequence at line 3, column 21)"),
    ("daemons:\n  - name: a\n\tpipe_directory: /p\n", "line 3, column 1: found character '\\t' that cannot start "
                                                      "any token (while scanning for the next token)"),
    ("daemons:\n  - {name: a, pipe_directory: /p}\n   bad: 1\n", "line 3, column 4: expected <block end>, but found "
                                                                   "'<block mapping start>'"),
])
def test_a_yaml_error_names_its_line_and_column(tmp_path, content, where, capsys):
    f = tmp_path / "mps.yml"
    f.write_text(content)
    code, lines = parse_error(["dump", "--config.file", str(f)], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert f"config file {f} is not valid YAML: {where}" in lines[0], lines[0]


def test_config_file_names_the_daemons(tmp_path):
    f = tmp_path / "mps.yml"
    f.write_text(f"daemons:\n  - {{name: train, pipe_directory: {tmp_path}/p1, log_directory: {tmp_path}/l1}}\n"
                 f"  - {{name: infer, pipe_directory: {tmp_path}/p2}}\n")
    res = subprocess.run(EXE + ["dump", "--config.file", str(f), "--no-collector.nvml",
                                "--mps.control-binary", "/nonexistent/x"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert 'mps_control_daemon_up{daemon="train"} 0.0' in res.stdout
    assert 'mps_control_daemon_up{daemon="infer"} 0.0' in res.stdout


def test_taken_port_is_one_error_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run(EXE + ["--web.listen-address", f"127.0.0.1:{port}", "--no-collector.logs",
                                    "--mps.control-binary", "/nonexistent/x"],
                             capture_output=True, text=True, timeout=30)
    assert res.returncode == 1
    assert "cannot listen on 127.0.0.1:" in res.stderr and "Traceback" not in res.stderr, res.stderr


# ---------------------------------------------------------------- every flag, a bad value

# Bad values for every flag of every subcommand. A flag missing here fails
# test_every_flag_has_a_bad_value, so a new flag cannot skip the walk.
# "=x" gives a value to a flag that takes none.
BAD_VALUES = {
    "--mps.pipe-directory": [""],
    "--mps.log-directory": [""],
    "--config.file": ["/nonexistent/mps.yml", "{bad_yaml}"],
    "--mps.discover": ["kubelet", "dra,x"],
    "--mps.discover.device-plugin-root": [""],
    "--mps.discover.dra-root": [""],
    "--mps.discover-glob": [""],
    "--mps.discover-interval": ["abc", "0", "-1"],
    "--log.level": ["loud"],
    "--log.format": ["xml"],
    "--web.listen-address": ["999.1.1.1:10138", "nope", "::1:10138", "127.0.0.1:99999", "[::1:10138"],
    "--web.telemetry-path": ["metrics"],
    "--web.systemd-socket": ["=x"],
    "--web.config.file": ["/nonexistent/web.yml", "{bad_web}"],
    "--web.max-requests": ["abc", "-1"],
    "--web.disable-exporter-metrics": ["=x"],
    "--mps.discover-processes": ["=x"],
    "--no-mps.discover-processes": ["=x"],
    "--scrape.max-duration": ["abc", "-1"],
    "--scrape.timeout-offset": ["abc", "-0.5"],
    "--collector.refresh-interval": ["abc", "-1", "nan"],
    "--collector.pause-after": ["abc", "0", "-1"],
    "--collector.control-wait": ["abc", "-1", "nan"],
    "--textfile": ["", "/", "/nonexistent-dir/mps.prom", "{bad_yaml}/mps.prom", "/proc/mps.prom"],
    "--mps.client-granularity": ["pid", "node", ""],
    "--mps.oom-margin-ratio": ["abc", "-0.1", "1", "nan"],
    "--mps.device-full-ratio": ["abc", "0", "1.5", "nan"],
    "--mps.exit-status": ["=x"],
    "--no-mps.exit-status": ["=x"],
    "--out": ["", "/nonexistent/dir/x.jsonl.gz"],
    "--duration": ["abc", "0"],
    "--interval": ["abc", "-1"],
    "--log-history": ["lots"],
    "--speed": ["abc", "0"],
    "--loop": ["=x"],
    "bundle": ["/nonexistent/session.jsonl.gz", "{bad_yaml}"],
    "--watch": ["abc", "0", "-1"],
    "--output": ["xml"],
    "--bundle": ["/nonexistent/session.jsonl.gz", "{bad_yaml}"],
    "--at": ["abc", "-1"],
}
for _name, _source in SOURCES.items():  # the sources' flags say what they refuse
    BAD_VALUES[f"--collector.{_name}"] = BAD_VALUES[f"--no-collector.{_name}"] = ["=x"]
    BAD_VALUES.update({flag.name: list(flag.refuses) for flag in _source.flags})


def flags_by_command():
    """{subcommand: [flag or positional name]} from the parser itself."""
    import argparse

    from mps_exporter.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for command, sub in subparsers.choices.items():
        names = []
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            names.append(max(action.option_strings, key=len) if action.option_strings else action.dest)
        out[command] = names
    return out


def test_every_flag_has_a_bad_value():
    flags = {f for names in flags_by_command().values() for f in names}
    assert flags - set(BAD_VALUES) == set()
    assert set(BAD_VALUES) - flags == set()  # and the table names no flag that is gone


BAD_VALUE_SECONDS = 20
WALK = [(command, flag, value) for command, names in flags_by_command().items()
        for flag in names for value in BAD_VALUES[flag]]


@pytest.mark.parametrize("command,flag,value", WALK, ids=[f"{c} {f} {v!r}" for c, f, v in WALK])
def test_every_flag_with_a_bad_value_is_one_line_and_exit_2(command, flag, value, tmp_path, capsys):
    from mps_exporter import cli

    bad_yaml = tmp_path / "bad.yml"
    bad_yaml.write_text("daemons: [\n")
    bad_web = tmp_path / "web.yml"
    bad_web.write_text("basic_auth_users:\n  alice: hunter2\n")
    value = value.format(bad_yaml=bad_yaml, bad_web=bad_web)
    if flag == "bundle":
        args = [value]
    elif value.startswith("="):
        args = [flag + value]
    else:
        args = [flag, value]
    required = ["--out", str(tmp_path)] if command == "capture" and flag != "--out" else []
    # In a thread with a limit: a value that turns out valid starts the command (a server,
    # a capture), which would hang the suite instead of failing this test.
    exits: list = []

    def run() -> None:
        try:
            exits.append(cli.main([command, *required, *args]))
        except SystemExit as e:
            exits.append(e.code)

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(BAD_VALUE_SECONDS)
    assert not caller.is_alive(), f"{command} {flag} {value!r} was accepted: still running after {BAD_VALUE_SECONDS} s"
    out, err = capsys.readouterr()
    assert exits == [2], err
    assert not out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mps-exporter: error: "), err


def test_the_default_command_reports_like_serve(capsys):
    from mps_exporter import cli

    for argv in (["--mps.command-timeout", "abc"], ["serve", "--mps.command-timeout", "abc"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        assert capsys.readouterr().err == "mps-exporter: error: argument --mps.command-timeout: invalid float value: 'abc'\n"


def test_version_exits_0():
    from mps_exporter import __version__

    res = subprocess.run(EXE + ["--version"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and res.stdout == f"mps-exporter {__version__}\n", res


def test_top_level_help_shows_the_serve_flags():
    res = subprocess.run(EXE + ["--help"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0
    for flag in ("--web.listen-address", "--web.max-requests", "--mps.log-directory", "--collector.logs"):
        assert flag in res.stdout
    assert "mps-exporter serve --help" in res.stdout


def test_dump_textfile_that_fails_while_written_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    # The directory passed the check, then the disk filled up (or the directory went away).
    import mps_exporter.wiring as wiring
    from mps_exporter import cli

    def full(path: str, registry: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wiring, "write_to_textfile", full)
    code = cli.main(["dump", "--textfile", str(tmp_path / "mps.prom"), "--mps.control-binary", str(tmp_path / "none"),
                     "--mps.log-directory", str(tmp_path), "--no-collector.nvml", "--no-collector.dcgm"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"mps-exporter: error: --textfile '{tmp_path / 'mps.prom'}': No space left on device\n" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag,process_metrics", [([], True), (["--web.disable-exporter-metrics"], False)])
def test_disable_exporter_metrics_drops_the_process_metrics(flag, process_metrics):
    """exporter-toolkit's flag: /metrics without the exporter's own process_* series; the
    collectors' own (mps_exporter_*) stay, alerts are built on them."""
    from mps_exporter.cli import parse_args
    from mps_exporter.service import serve

    port = free_port()
    cfg = parse_args(["serve", "--web.listen-address", f"127.0.0.1:{port}", *flag])[1]
    stop, ready = threading.Event(), threading.Event()
    server = threading.Thread(target=serve, args=(cfg, stop, ready), kwargs={"readers": {}}, daemon=True)
    server.start()
    try:
        assert ready.wait(20)
        body = get(f"http://127.0.0.1:{port}/metrics")[1]
    finally:
        stop.set()
        server.join(20)
    assert ("\nprocess_cpu_seconds_total " in body) == process_metrics
    assert ("\nprocess_" in body or body.startswith("process_")) == process_metrics
    assert "mps_exporter_build_info{" in body
