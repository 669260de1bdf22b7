#!/usr/bin/env python3
"""Hostile-input benchmark: a real `mps-exporter serve` follows 1 M mutated log lines
(bench/hostile.py) while it is scraped every half second.

Besides the mutated lines it gets the worst single lines we know: an exit status of
5,000 nines (past int()'s digit limit: once a lost 1 MiB batch), a 1 MiB and a
20 MiB line, a line of NULs, 3,000 distinct exit statuses (once 3,001 series), a
line dated 9999 (once 2.5e11 s in the wait sum, and the last-line time pinned at 9999).

    python3 bench/hostile_bench.py [--lines 1000000] [--rate 20000]

Prints: lines written vs counted per file (must be equal), unrecognized and
truncated lines, tracebacks in the exporter's log, peak RSS (VmHWM), scrapes
answered and their p50/p99/max, counters that went down, series in the last
exposition, the wait sums. Writes the same as JSON with --json PATH.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile import FILES, Exporter, Writer, counters_went_down, lines_counted, percentile, samples  # noqa: E402

HUGE_STATUS = b"[2026-11-21 04:22:16.630 Control   546] Server 1 exited with status " + b"9" * 5000


def specials(writer: Writer) -> None:
    """The single worst lines, once each."""
    writer.write_special("control", HUGE_STATUS)
    writer.write_special("server", b"[2026-11-21 04:22:16.630 Server   713] " + b"y" * (1 << 20))
    writer.write_special("control", b"[2026-11-21 04:22:16.630 Control   546] " + b"z" * (20 << 20))
    writer.write_special("server", b"\x00" * 100_000)
    for status in range(-1000, 2000):  # 3,000 distinct statuses
        writer.write_special("control", b"[2026-11-21 04:22:16.630 Control   546] Server %d exited with status %d"
                             % (100000 + status, status))
    writer.write_special("control", b"[2026-11-21 04:22:17.000 Control   546] NEW CLIENT 77 from user 5: "
                         b"Server is not ready, push client to pending list")
    writer.write_special("control", b"[9999-12-31 23:59:59.000 Control   546] NEW CLIENT 77 from user 5: "
                         b"Server already exists")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--rate", type=int, default=20_000, help="lines written per second")
    ap.add_argument("--long-share", type=float, default=0.0005, help="share of lines over the 64 KiB cap")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mps-hostile-"))
    logs = work / "mps-log"
    logs.mkdir()
    writer = Writer(logs, seed=11, long_share=args.long_share)
    exporter = Exporter(logs, work / "exporter.log")
    latencies: List[float] = []
    failures: List[str] = []
    went_down: List[str] = []
    done = threading.Event()
    last: Dict[str, Dict[str, float]] = {"s": {}}

    def scraper() -> None:
        previous: Dict[str, float] = {}
        while not done.is_set():
            t0 = time.perf_counter()
            try:
                current = samples(exporter.scrape())
                latencies.append(time.perf_counter() - t0)
                went_down.extend(counters_went_down(previous, current))
                previous = last["s"] = current
            except OSError as e:
                failures.append(repr(e))
            done.wait(0.5)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        chunk = max(1, args.rate // 10)
        written = 0
        specials(writer)
        while written < args.lines:
            tick = time.monotonic()
            n = min(chunk, args.lines - written)
            writer.write(n)
            written += n
            time.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))
        write_seconds = time.monotonic() - start
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            s = last["s"]
            if s and all(lines_counted(s, f) >= writer.written[f] for f in FILES):
                break
            time.sleep(0.5)
        caught_up = time.monotonic() - start
        time.sleep(1.0)  # one more scrape of the final state
        done.set()
        thread.join(10)
        status = exporter.proc_status()
    finally:
        done.set()
        rc = exporter.stop()
    final = last["s"]
    log_text = (work / "exporter.log").read_text(errors="replace")
    series = {k.split("{")[0] for k in final}
    result = {
        "lines_written": writer.written, "bytes_written": writer.bytes,
        "lines_counted": {f: lines_counted(final, f) for f in FILES},
        "lines_lost": {f: writer.written[f] - lines_counted(final, f) for f in FILES},
        "unrecognized": {f: int(final.get(f'mps_log_unrecognized_lines_total{{daemon="default",file="{f}"}}', -1))
                         for f in FILES},
        "truncated": {f: int(final.get(f'mps_log_truncated_lines_total{{daemon="default",file="{f}"}}', -1))
                      for f in FILES},
        "exit_status_series": sum(1 for k in final if k.startswith("mps_server_exits_total{")),
        "series_total": len(final), "metric_names": len(series),
        "queue_wait_sum": {k: v for k, v in final.items() if k.startswith("mps_client_queue_wait_seconds_sum")},
        "queue_wait_implausible": {k: v for k, v in final.items()
                                   if k.startswith("mps_client_queue_wait_implausible_total")},
        # The line dated 9999 must not move it (issue 26: it pinned the last-line time there).
        "last_line_time_ahead_of_clock_s": round(max((v for k, v in final.items()
                                                      if k.startswith("mps_log_last_line_timestamp_seconds")),
                                                     default=0.0) - time.time(), 1),
        "tracebacks": log_text.count("Traceback"), "warnings": log_text.count("level=warn"),
        "peak_rss_mib": round(status["VmHWM"] / 1024, 1), "threads": status["Threads"], "fds": status["fds"],
        "scrapes_answered": len(latencies), "scrapes_failed": len(failures),
        "scrape_p50_ms": round(percentile(latencies, 50) * 1000, 2),
        "scrape_p99_ms": round(percentile(latencies, 99) * 1000, 2),
        "scrape_max_ms": round(max(latencies) * 1000, 2) if latencies else None,
        "counters_down": len(went_down), "write_seconds": round(write_seconds, 1),
        "caught_up_seconds": round(caught_up, 1), "exit_code": rc,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
