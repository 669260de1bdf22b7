"""How many process exits a second the exit-status watcher (exporter/exitstatus.py) keeps
up with: `workers` processes each fork `per_worker` children that exit at once (status
0, 1, or SIGKILL'd by themselves), as fast as they can; then every child's PID is looked
up. Needs the proc connector (the host's PID namespace; CAP_NET_ADMIN before Linux 6.6).

    sudo python3 -m bench.exitstatus_bench --workers 4 --per-worker 5000

Then the watcher thread's own CPU through a flood of events that are not process exits
(threads started and ended: a fork and an exit event each, as a PyTorch client storm makes
them), with the kernel-side filter (exitstatus.attach_exits_only) and without it, same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from typing import List

from mps_exporter.exitstatus import ExitStatus, ExitWatcher


def _worker(n: int, out: str) -> None:
    pids: List[str] = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            if i % 3 == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(i % 3)
        os.waitpid(pid, 0)
        pids.append(f"{pid} {i % 3}")
    with open(out, "w") as f:
        f.write("\n".join(pids))
    os._exit(0)


def parse_rate(n: int = 20000) -> float:
    """Exit events a second `parse` takes apart, 20 to a datagram (what the thread does)."""
    from mps_exporter.exitstatus import CN_IDX_PROC, CN_MSG, CN_VAL_PROC, EXIT_DATA, NLMSGHDR, PROC_EVENT_EXIT, \
        PROC_EVENT_HEAD, parse
    one = []
    for pid in range(20):
        event = PROC_EVENT_HEAD.pack(PROC_EVENT_EXIT, 0, 0) + EXIT_DATA.pack(pid, pid, 256, 17) + b"\0" * 8
        cn = CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(event), 0) + event
        one.append(NLMSGHDR.pack(NLMSGHDR.size + len(cn), 3, 0, 0, 0) + cn)
    datagram = b"".join(one)
    start = time.perf_counter()
    for _ in range(n // 20):
        parse(datagram)
    return n / (time.perf_counter() - start)


def run(workers: int, per_worker: int) -> dict:
    watcher = ExitWatcher()
    if not watcher.start():
        return {"available": False, "why": watcher.why_not}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        children = []
        for w in range(workers):
            pid = os.fork()
            if pid == 0:
                _worker(per_worker, os.path.join(tmp, str(w)))
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
        storm = time.monotonic() - start
        time.sleep(0.5)  # the last events in flight
        expected = {0: ExitStatus(0, 0), 1: ExitStatus(1, 0), 2: ExitStatus(0, 9)}
        total = right = missing = 0
        for w in range(workers):
            with open(os.path.join(tmp, str(w))) as f:
                for line in f:
                    pid, kind = (int(x) for x in line.split())
                    total += 1
                    got = watcher.status(pid)
                    missing += got is None
                    right += got == expected[kind]
    watcher.close()
    return {"available": True, "exits": total, "seconds": round(storm, 3), "exits_per_second": round(total / storm),
            "right": right, "missing": missing, "overflows": watcher.lost, "cpus": os.cpu_count(),
            "parse_events_per_second": round(parse_rate())}


def _thread_cpu(tid: int) -> float:
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_flood(threads: int, filter_events: bool) -> dict:
    """The watcher thread's CPU seconds while `threads` threads start and end, filtered or not."""
    import threading
    watcher = ExitWatcher(filter_events=filter_events)
    if not watcher.start() or watcher.thread_id is None:
        return {"available": False, "why": watcher.why_not}
    time.sleep(0.2)
    before = _thread_cpu(watcher.thread_id)
    start = time.monotonic()
    for _ in range(threads):
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
    seconds = time.monotonic() - start
    time.sleep(0.5)  # the last events in flight
    cpu = _thread_cpu(watcher.thread_id) - before
    watcher.close()
    return {"filtered": watcher.filtered if filter_events else False, "threads": threads,
            "threads_per_second": round(threads / seconds), "watcher_cpu_seconds": round(cpu, 3)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--per-worker", type=int, default=2000)
    p.add_argument("--threads", type=int, default=20000)
    a = p.parse_args()
    result = run(a.workers, a.per_worker)
    print(json.dumps(result))
    if result.get("available"):
        for filter_events in (False, True):
            print(json.dumps(thread_flood(a.threads, filter_events)))
    return 0 if result.get("available") and not result.get("missing") else 1


if __name__ == "__main__":
    sys.exit(main())
