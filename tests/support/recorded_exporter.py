"""Run the real exporter (flags, web server, collector, log follower) on the
capture's busy moment instead of live NVML / MPS / /proc.

    python3 -m tests.support.recorded_exporter --web.listen-address 127.0.0.1:PORT [--web.config.file F]

Any `serve` flag works; the sources are the recorded ones of tests/support/scenarios.py.
"""

import sys
import tempfile
from pathlib import Path

from mps_exporter.cli import parse_args, setup_logging
from mps_exporter.service import serve
from mps_exporter.wiring import build_readers
from tests.support import scenarios


def main(argv=None) -> int:
    _, flags = parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    with tempfile.TemporaryDirectory() as tmp:
        scen = scenarios.busy(Path(tmp), logs=True)
        # The scenario decides where data comes from; the flags decide how it is served.
        scen.cfg.listen_address, scen.cfg.web_config_file = flags.listen_address, flags.web_config_file
        scen.cfg.telemetry_path, scen.cfg.web_config = flags.telemetry_path, flags.web_config
        scen.cfg.max_requests = flags.max_requests
        setup_logging(flags.log_level, flags.log_format)
        return serve(scen.cfg, readers=build_readers(scen.cfg, scen.backends()))


if __name__ == "__main__":
    sys.exit(main())
