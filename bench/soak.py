#!/usr/bin/env python3
"""Soak: a real `mps-exporter serve` for a long time under a steady stream of hostile
log lines, scraped every second; RSS, open fds and threads sampled all along.

Every --rotate-every seconds the log files are rotated (rename, then copytruncate in
turn) and every --vanish-every seconds the log directory disappears for a few
seconds (as NVIDIA's device plugin does), so the follower's reopen paths run too.

    python3 bench/soak.py --duration 3900 --out bench/results/soak

Writes OUT.csv (one row per sample) and OUT.json (summary: RSS, fd and thread
slopes after the warm-up by least squares, lines counted vs written, scrapes
answered, counters that went down, tracebacks). Numbers, not a pass/fail.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile import FILES, Exporter, Writer, counters_went_down, lines_counted, percentile, samples  # noqa: E402


def slope_per_hour(points: List[Tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) in value per hour."""
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return sum((t - mx) * (v - my) for t, v in points) / var * 3600 if var else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=3900, help="seconds (default 65 min)")
    ap.add_argument("--warmup", type=float, default=600, help="seconds left out of the slopes (default 10 min)")
    ap.add_argument("--rate", type=int, default=200, help="log lines per second (default 200)")
    ap.add_argument("--long-share", type=float, default=None, help="share of lines over the 64 KiB cap "
                    "(default: bench/hostile.py's, about 0.4 %%)")
    ap.add_argument("--sample-every", type=float, default=10)
    ap.add_argument("--rotate-every", type=float, default=300)
    ap.add_argument("--vanish-every", type=float, default=900)
    ap.add_argument("--out", default="bench/results/soak")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="mps-soak-"))
    logs = work / "mps-log"
    logs.mkdir()
    writer = Writer(logs, seed=7) if args.long_share is None else Writer(logs, seed=7, long_share=args.long_share)
    exporter = Exporter(logs, work / "exporter.log", ["--mps.state-file", str(work / "state.json")])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    csv = open(out.with_suffix(".csv"), "w")
    rows: List[Dict[str, float]] = []
    latencies: List[float] = []
    failed_scrapes, went_down, rotations, vanishes = 0, 0, 0, 0
    previous: Dict[str, float] = {}
    start = time.monotonic()
    next_sample = next_rotate = next_vanish = 0.0
    next_rotate, next_vanish = args.rotate_every, args.vanish_every
    gone_until = -1.0

    def catch_up(limit: float) -> Dict[str, float]:
        """Wait until every line written was counted (before the writer deletes or
        truncates what the exporter may not have read yet)."""
        deadline = time.monotonic() + limit
        s: Dict[str, float] = {}
        while time.monotonic() < deadline:
            try:
                s = samples(exporter.scrape())
            except OSError:  # counted by the main loop's scrapes; here only the count matters
                time.sleep(0.5)
                continue
            if all(lines_counted(s, f) >= writer.written[f] for f in FILES):
                break
            time.sleep(0.2)
        return s
    try:
        while (now := time.monotonic() - start) < args.duration:
            tick = time.monotonic()
            if gone_until < 0:
                writer.write(args.rate)
            elif now >= gone_until:
                logs.mkdir()
                gone_until = -1.0
            t0 = time.perf_counter()
            try:
                text = exporter.scrape()
                latencies.append(time.perf_counter() - t0)
                current = samples(text)
                went_down += len(counters_went_down(previous, current))
                previous = current
            except OSError:
                failed_scrapes += 1
            if now >= next_sample:
                st = exporter.proc_status()
                rows.append({"t": round(now, 1), "rss_kib": st["VmRSS"], "hwm_kib": st["VmHWM"],
                             "threads": st["Threads"], "fds": st["fds"],
                             "lines": sum(lines_counted(previous, f) for f in FILES),
                             "written": sum(writer.written.values())})
                if len(rows) == 1:
                    csv.write(",".join(rows[0]) + "\n")
                csv.write(",".join(str(v) for v in rows[-1].values()) + "\n")
                csv.flush()  # a soak cut short still leaves its samples
                next_sample += args.sample_every
            if gone_until < 0 and now >= next_rotate:
                rotations += 1
                catch_up(60)
                for f in FILES:
                    path = logs / f"{f}.log"
                    if not path.exists():
                        continue
                    if rotations % 2:
                        os.rename(path, logs / f"{f}.log.1")  # rename: the old file is read to its end
                    else:
                        shutil.copy(path, logs / f"{f}.log.1")  # copytruncate
                        with open(path, "r+b") as fh:
                            fh.truncate(0)
                next_rotate += args.rotate_every
            if gone_until < 0 and now >= next_vanish:
                catch_up(60)
                shutil.rmtree(logs)
                vanishes += 1
                gone_until = now + 5
                next_vanish += args.vanish_every
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        if gone_until >= 0:
            logs.mkdir()
        final = catch_up(120)
    finally:
        rc = exporter.stop()
    log_text = (work / "exporter.log").read_text(errors="replace")
    steady = [r for r in rows if r["t"] >= args.warmup]
    summary = {
        "duration_s": args.duration, "warmup_s": args.warmup, "rate_lines_per_s": args.rate,
        "samples": len(rows), "rotations": rotations, "directory_vanished": vanishes,
        "lines_written": writer.written, "bytes_written": writer.bytes,
        "lines_counted": {f: lines_counted(final, f) for f in FILES},
        "unrecognized": {f: int(final.get(f'mps_log_unrecognized_lines_total{{daemon="default",file="{f}"}}', -1))
                         for f in FILES},
        "scrapes": len(latencies) + failed_scrapes, "scrapes_failed": failed_scrapes,
        "scrape_p50_ms": round(percentile(latencies, 50) * 1000, 2),
        "scrape_p99_ms": round(percentile(latencies, 99) * 1000, 2),
        "counter_decreases": went_down, "tracebacks": log_text.count("Traceback"), "exit_code": rc,
        "rss_kib_first_last_after_warmup": [steady[0]["rss_kib"], steady[-1]["rss_kib"]] if steady else None,
        "rss_slope_kib_per_hour": round(slope_per_hour([(r["t"], r["rss_kib"]) for r in steady]), 1),
        "fds_slope_per_hour": round(slope_per_hour([(r["t"], r["fds"]) for r in steady]), 3),
        "threads_slope_per_hour": round(slope_per_hour([(r["t"], r["threads"]) for r in steady]), 3),
        "fds_min_max": [min(r["fds"] for r in rows), max(r["fds"] for r in rows)] if rows else None,
        "threads_min_max": [min(r["threads"] for r in rows), max(r["threads"] for r in rows)] if rows else None,
        "peak_rss_kib": max(r["hwm_kib"] for r in rows) if rows else None,
    }
    csv.close()
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
