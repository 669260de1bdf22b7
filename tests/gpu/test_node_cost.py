"""node_cost.py's profile table needs no GPU: it reads two dumps of the exporter's threads."""

from __future__ import annotations

import marshal
import re
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from tests.gpu.node_cost import PROFILED_THREADS, profile_markdown  # noqa: E402


def _dump(path: Path, counts: dict) -> None:
    path.write_bytes(marshal.dumps(counts))


def test_the_profile_table_is_the_window_per_scrape_without_the_dumps(tmp_path):
    stem = tmp_path / "exporter.profile"
    encode, read = "/pkg/mps_exporter/collector.py:858 Exposition.encode", "/pkg/mps_exporter/sources/nvml.py:477 _read_gpu"
    _dump(Path(f"{stem}.0"), {("N/A", encode): (1.0, 2.0, 10), ("mps-read-nvml-0", read): (0.5, 0.5, 5)})
    _dump(Path(f"{stem}.1"), {("N/A", encode): (1.4, 2.8, 14), ("mps-read-nvml-0", read): (0.7, 0.7, 9),
                              ("mps-read-nvml-1", read): (0.2, 0.2, 4), ("MainThread", "<string>:9 dump"): (5.0, 5.0, 1),
                              ("MainThread", "yappi.get_func_stats"): (3.0, 3.0, 1)})
    text = profile_markdown(stem, scrapes=4)
    assert "| N/A | 100.000 |" in text  # (1.4 - 1.0) s over 4 scrapes
    assert "| mps-read-nvml-N | 100.000 |" in text  # both GPUs' threads as one: (0.2 + 0.2) s / 4
    assert f"| N/A {encode} | 100.000 | 200.000 | 1.0 |" in text
    assert f"| mps-read-nvml-N {read} | 100.000 | 100.000 | 2.0 |" in text
    assert "dump" not in text and "yappi" not in text and "MainThread" not in text  # the profiler's own work


def test_the_profiled_bootstrap_dumps_each_thread_on_sigusr2(tmp_path):
    """The bootstrap as the exporter runs it (yappi: the test extra here, .whl/ on the GPU
    machine), with `main` a program that names a thread, works in it and signals itself
    before and after."""
    package = tmp_path / "pkg" / "mps_exporter"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli.py").write_text(textwrap.dedent("""
        import os, signal, threading

        def work():
            sum(i * i for i in range(200_000))

        def main(argv):
            os.kill(os.getpid(), signal.SIGUSR2)
            t = threading.Thread(target=work, name="mps-read-nvml-3")
            t.start()
            t.join()
            os.kill(os.getpid(), signal.SIGUSR2)
            return 0
        """))
    stem = tmp_path / "exporter.profile"
    run = subprocess.run([sys.executable, "-c", PROFILED_THREADS], capture_output=True, text=True,
                         env={"PYTHONPATH": str(package.parent), "MPS_PROFILE_OUT": str(stem), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    text = profile_markdown(stem, scrapes=1)
    assert re.search(r"^\| mps-read-nvml-N \| [1-9][0-9.]* \|$", text, re.M)  # named, though it had ended
    assert re.search(r"^\| mps-read-nvml-N \S+/cli\.py:\d+ work \| ", text, re.M)
