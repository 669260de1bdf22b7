"""The raw cost of one scrape: time spent inside the NVML and control calls the
exporter makes, measured by running the exporter's own NVML and control sources
with every pynvml function and every control process timed.

Running the exporter's sources (not a hand-written list of calls) keeps the
call sequence identical to the exporter's: the same GPM sample per GPU, the
same process-utilization window, the same cached per-server facts.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict


class TimedModule:
    """Wraps a module: calls of its `nvml*` functions add their wall time to `seconds`."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed


class TimedRunner:
    """A control runner that times each control process."""

    def __init__(self, runner: Callable) -> None:
        self._runner = runner
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._runner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


class RawScrape:
    """One NvmlClient and one DaemonReader per daemon, as the exporter builds them."""

    def __init__(self, pipe_directory: str, log_directory: str, facts_refresh_seconds: float,
                 nvml_module: Any = None, runner: Callable = None) -> None:
        from mps_exporter.config import DaemonConfig
        from mps_exporter.sources import control as mps_control
        from mps_exporter.sources.nvml import NvmlClient

        if nvml_module is None:
            import pynvml as nvml_module
        self.nvml = TimedModule(nvml_module)
        self.runner = TimedRunner(runner or mps_control.subprocess_runner)
        self.nvml_source = NvmlClient(self.nvml)
        daemon = DaemonConfig(name="default", pipe_directory=pipe_directory, log_directory=log_directory)
        self.control = mps_control.DaemonReader(
            daemon, mps_control.ControlClient(pipe_directory, runner=self.runner),
            facts_refresh_seconds=facts_refresh_seconds)

    def once(self) -> Dict[str, float]:
        """Seconds inside NVML and inside control processes for one scrape's calls."""
        n0, c0, nc0, cc0 = self.nvml.seconds, self.runner.seconds, self.nvml.calls, self.runner.calls
        reading = self.nvml_source.read()
        devices = [g.index for g in reading.gpus] or [0]
        self.control.read(devices)
        nvml_s, control_s = self.nvml.seconds - n0, self.runner.seconds - c0
        return {"nvml": nvml_s, "control": control_s, "total": nvml_s + control_s,
                "nvml_calls": self.nvml.calls - nc0, "control_calls": self.runner.calls - cc0}
