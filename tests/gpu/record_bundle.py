"""Record the shipped replay bundle: `mps-exporter capture` during a scripted MPS session.

    python3 tests/gpu/record_bundle.py --work /tmp/bundle --out DIR [--duration 75]

On a GPU machine (root, PyTorch, MPS binaries, `mps_exporter` importable). The
capture starts before the control daemon, so the bundle shows it coming up.
Scenarios, in order: MPS starts with its own pipe and log directories and a
daemon default pinned limit (24G); three clients with 2, 8 and 1 GiB, whose
server's limit is then lowered to 12G (the clients keep the 24G they connected
with); a client of uid 1500 queued behind uid 0's server and admitted once that
drains; a client near its own pinned memory limit beside one without; a fatal
GPU error beside a bystander; more clients than MPS accepts on one GPU (the rest
are refused); a server SIGKILLed under its client; quit; two CUDA processes
without MPS (time-slicing). The capture
ends a few seconds later, so that every panel of the per-node dashboards has
data in the demo. The timeline (wall clock, same clock as the logs) is written
next to the bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import oracles  # noqa: E402
from truth_check import SECOND_UID, Session, run, wait_for  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/mps-bundle")
    ap.add_argument("--out", required=True)
    ap.add_argument("--duration", type=float, default=300, help="upper bound; the capture is ended after the session")
    ap.add_argument("--refusal-clients", type=int, default=52, help="clients at once on GPU 0 (0: skip)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    s = Session(work, len(run(["nvidia-smi", "-L"]).strip().splitlines()))
    capture = subprocess.Popen(
        [sys.executable, "-m", "mps_exporter.cli", "capture", "--out", str(out), "--duration", str(args.duration),
         "--interval", "1", "--mps.pipe-directory", str(s.pipe), "--mps.log-directory", str(s.logdir)],
        stdout=open(work / "capture.log", "w"), stderr=subprocess.STDOUT, cwd="/tmp",
        env={k: v for k, v in s.env.items() if not k.startswith("CUDA_MPS_")})
    try:
        s.mark("capture started (no control daemon yet)")
        time.sleep(3)
        s.mark("nvidia-cuda-mps-control -d")
        s.start_daemon()
        time.sleep(2)
        s.mark("set_default_device_pinned_mem_limit 0 24G")
        s.ctl("set_default_device_pinned_mem_limit 0 24G")
        time.sleep(2)
        s.mark("three clients: 2, 8 and 1 GiB (uid 0)")
        mixed = [s.client("a", 2), s.client("b", 8), s.client("c", 1, n=4096)]
        s.wait_ready(mixed, 60)
        s.mark("three clients ready")
        time.sleep(3)
        for srv in s.servers():
            s.mark(f"set_device_pinned_mem_limit {srv} 0 12G (the connected clients keep 24G)")
            s.ctl(f"set_device_pinned_mem_limit {srv} 0 12G")
        time.sleep(4)
        s.mark("clients a, b stop; c holds the uid 0 server")
        s.stop(mixed[:2])
        s.mark("uid 1500 client arrives: queued behind uid 0's server")
        second = s.client("q_user", 0.5, uid=SECOND_UID)
        wait_for(lambda: any(w.client_pid == second.pid for w in oracles.queue_waits(s.control_log())), 60)
        s.mark(f"uid 1500 client {second.pid} pushed to the pending list")
        time.sleep(5)
        s.mark("client c stops: the uid 0 server drains, uid 1500's server starts")
        s.stop(mixed[2:])
        s.wait_ready([second], 60)
        s.mark("uid 1500 client admitted and ready")
        time.sleep(2)
        s.stop([second])
        s.mark("uid 1500 client done; shutdown_server of its server")
        s.shutdown_servers()
        s.mark("client near its own pinned limit (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G, holds 1.25 GiB, "
               "CUDA_MPS_CLIENT_PRIORITY=1) and one without a limit (1 GiB)")
        near = s.client("near", 1.25, env={"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G",
                                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
                                            "CUDA_MPS_CLIENT_PRIORITY": "1"})
        plain = s.client("plain", 1)
        s.wait_ready([near, plain], 60)
        s.mark("near-limit and plain clients ready")
        time.sleep(4)
        s.stop([near, plain])
        s.mark("faults: bystander (1 GiB), then fault.py (device-side assert)")
        bystander = s.client("bystander", 1)
        s.wait_ready([bystander], 60)
        s.run_script("assert", "fault.py").proc.wait(60)
        s.mark("fault.py exited; fatal.py (illegal address: a fatal GPU error)")
        time.sleep(2)
        s.run_script("fatal", "fatal.py").proc.wait(60)
        s.mark("fatal.py exited")
        time.sleep(3)
        s.stop([bystander])
        if args.refusal_clients:
            s.shutdown_servers()
            s.mark(f"{args.refusal_clients} clients at once on GPU 0: MPS accepts 48, refuses the rest")
            many = [s.client(f"r{i}", 0, n=64, idle=True) for i in range(args.refusal_clients)]
            s.wait_ready(many, 150)
            s.mark(f"{sum(c.is_ready() for c in many)} ready, {sum(not c.is_ready() for c in many)} refused")
            time.sleep(2)
            s.stop(many)
        s.shutdown_servers()
        victim = s.client("victim", 1)
        s.wait_ready([victim], 60)
        for srv in s.servers():
            s.mark(f"kill -9 server {srv} under client {victim.pid}")
            os.kill(srv, 9)
        victim.proc.wait(60)
        s.mark("the client failed; quit")
        time.sleep(2)
        s.quit()
        s.mark("daemon gone; two CUDA processes without MPS (time-slicing)")
        sliced = [s.client(f"ts{i}", 1, mps=False) for i in range(2)]
        s.wait_ready(sliced, 60)
        time.sleep(8)
        s.stop(sliced)
        s.mark("time-slicing clients done")
        time.sleep(4)
    finally:
        s.kill_all()
        s.quit()
        if capture.poll() is None:
            capture.terminate()  # SIGTERM: capture writes what it has (the normal end)
            capture.wait(30)
        (out / "timeline.json").write_text(json.dumps({
            "timeline": s.timeline,
            "client outputs": {c.tag: c.text().strip()[-300:] for c in s.clients},
            "client pids": {c.tag: c.pid for c in s.clients},
        }, indent=1))
        shutil.copy(work / "capture.log", out / "capture.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
