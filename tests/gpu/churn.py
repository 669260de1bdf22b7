"""Churn on a node with two GPUs (issue 38): clients coming and going for ten minutes under
one exporter discovering two per-GPU daemons, longer than one command on the lent machine.

    setsid nohup python3 tests/gpu/churn.py --seconds 600 --out /tmp/churn.json > /tmp/churn.log 2>&1 &

- two control daemons in the device plugin's layout (<root>/nvidia.com/mps-gpu<i>/{pipe,log},
  CUDA_VISIBLE_DEVICES=<i>), the root short (/tmp/mpsd/churn: a UNIX socket path must fit
  107 bytes); one exporter (`python3 -X faulthandler`) discovering them; restarted if it
  dies, each death recorded with its return code and the last 40 lines of its stderr;
- about every second a client (workloads/gpu_client.py through truth_check.Session) on a
  random GPU holding 0.25-1 GiB for 5-30 s once ready, a quarter of them multiplying
  matrices, at most --max-live per GPU;
- /metrics scraped every second: answered / failed, p50 / p99 ms;
- --out: the JSON result (written every 30 s with "state": "running", then "finished",
  then "torn_down" once both daemons were told to quit). The daemons are told to quit
  whatever happens: SIGTERM / SIGINT end the run early through the same finally block.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import node_phases  # noqa: E402  (the environment of a client of a per-GPU daemon)

STDERR_LINES = 40


# ====================================================================== pure helpers (CI)
def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1)))))]


def scrape_summary(scrapes: List[Dict[str, Any]]) -> Dict[str, Any]:
    """scrapes: {"t", "ms", "status"} each; status 200 is answered."""
    ok = [x["ms"] for x in scrapes if x["status"] == 200]
    p50, p99 = percentile(ok, 50), percentile(ok, 99)
    return {"scrapes_ok": len(ok), "scrapes_failed": len(scrapes) - len(ok),
            "p50_ms": None if p50 is None else round(p50, 2), "p99_ms": None if p99 is None else round(p99, 2),
            "max_ms": round(max(ok), 2) if ok else None}


def death(rc: int, stderr_text: str, at: float) -> Dict[str, Any]:
    """An exporter that exited before being stopped: return code (negative: the signal)."""
    sig = None
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = f"signal {-rc}"
    return {"rc": rc, "signal": sig, "at_seconds": round(at, 1), "stderr_tail": stderr_text.splitlines()[-STDERR_LINES:]}


def pick_gpu(rng: random.Random, live: Dict[int, int], max_live: int) -> Optional[int]:
    """A random GPU with fewer than max_live clients; None when every GPU is full."""
    room = [g for g, n in sorted(live.items()) if n < max_live]
    return rng.choice(room) if room else None


def client_plan(rng: random.Random) -> Dict[str, Any]:
    """GiB held, seconds held once ready, busy or idle."""
    return {"mem_gib": round(rng.uniform(0.25, 1.0), 2), "hold_seconds": round(rng.uniform(5, 30), 1),
            "busy": rng.random() < 0.25}


def verdict(result: Dict[str, Any]) -> Dict[str, Any]:
    """What the lead reads first: deaths, failed scrapes, clients started."""
    return {"exporter_deaths": len(result.get("exporter_deaths", [])),
            "scrapes_ok": result.get("scrapes", {}).get("scrapes_ok", 0),
            "scrapes_failed": result.get("scrapes", {}).get("scrapes_failed", 0),
            "clients_started": result.get("clients_started", 0),
            "passed": not result.get("exporter_deaths") and result.get("scrapes", {}).get("scrapes_failed", 1) == 0
            and result.get("clients_started", 0) > 0}


# ====================================================================== the run
class Stop(Exception):
    pass


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


class Churn:
    def __init__(self, args: argparse.Namespace) -> None:
        from discovery_phase import Daemon
        from truth_check import Session, free_port
        self.args = args
        self.root, self.work = Path(args.root), Path(args.work)
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.gpus = args.gpus or gpu_count()
        self.session = Session(self.work, self.gpus)  # clients only: its own pipe is never used
        self.daemons = []
        for g in range(self.gpus):
            d = Daemon(f"nvidia.com/mps-gpu{g}", self.root / "nvidia.com" / f"mps-gpu{g}")
            d.env["CUDA_VISIBLE_DEVICES"] = str(g)
            self.daemons.append(d)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.exporter: Optional[subprocess.Popen] = None
        self.exporter_err: Optional[Path] = None
        self.exporter_starts = 0
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.scrapes: List[Dict[str, Any]] = []
        self.result: Dict[str, Any] = {"state": "starting", "seconds_asked": args.seconds, "exporter_deaths": [],
                                       "clients_started": 0, "clients_per_gpu": {str(g): 0 for g in range(self.gpus)},
                                       "client_exits": {}, "client_failures": [], "never_ready": 0,
                                       "max_live": {str(g): 0 for g in range(self.gpus)}, "daemons": {}}

    # ------------------------------------------------------------ exporter
    def start_exporter(self) -> None:
        import discovery_phase as dp
        self.exporter_starts += 1
        n = self.exporter_starts
        self.exporter_err = self.work / f"exporter-{n}.err"
        argv = [sys.executable, "-X", "faulthandler", *dp.exporter_args(self.work / "state.json", self.root,
                                                                         self.root / "no-dra", self.port)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        with open(self.work / f"exporter-{n}.out", "w") as out, open(self.exporter_err, "w") as err:
            self.exporter = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd="/tmp")

    def check_exporter(self) -> None:
        rc = self.exporter.poll() if self.exporter is not None else None
        if rc is not None:
            text = self.exporter_err.read_text(errors="replace") if self.exporter_err else ""
            self.result["exporter_deaths"].append(death(rc, text, time.monotonic() - self.t0))
            print(f"exporter died: rc={rc}", flush=True)
            self.start_exporter()

    def scrape_loop(self) -> None:
        tick = time.monotonic()
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=10) as resp:
                    resp.read()
                    status = resp.status
            except Exception as e:  # refused, reset, timeout: a failed scrape
                status = repr(e)[:80]
            self.scrapes.append({"t": round(start - self.t0, 2), "ms": (time.monotonic() - start) * 1000,
                                 "status": status})
            tick += 1.0
            while tick <= time.monotonic():
                tick += 1.0
            self.stop.wait(tick - time.monotonic())

    # ------------------------------------------------------------ clients
    def run(self) -> None:
        args, s = self.args, self.session
        for d in self.daemons:
            self.result["daemons"][d.name] = {"start": d.start(), "socket_path_bytes": len(str(d.pipe / "control"))}
            (d.directory / ".started").touch()
        self.start_exporter()
        deadline = time.time() + 60
        while time.time() < deadline and not self.stop.is_set():
            try:
                urllib.request.urlopen(self.url, timeout=5).read()
                break
            except Exception:
                self.check_exporter()
                time.sleep(0.5)
        scraper = threading.Thread(target=self.scrape_loop, daemon=True)
        scraper.start()
        self.result["state"] = "running"
        rng = random.Random(args.seed)
        live: Dict[str, Dict[str, Any]] = {}  # tag -> {"client", "gpu", "hold", "ready_at", "started", "stopped"}
        began, next_start, next_write, n = time.monotonic(), time.monotonic(), time.monotonic() + 30, 0
        while time.monotonic() - began < args.seconds and not self.stop.is_set():
            now = time.monotonic()
            for tag, info in list(live.items()):
                c = info["client"]
                rc = c.proc.poll()
                if rc is not None:
                    self.result["client_exits"][str(rc)] = self.result["client_exits"].get(str(rc), 0) + 1
                    if rc != 0 and len(self.result["client_failures"]) < 20:
                        self.result["client_failures"].append({"tag": tag, "rc": rc, "output": c.text().strip()[-300:]})
                    del live[tag]
                elif info["stopped"] is not None:
                    if now - info["stopped"] > 30:  # told to stop and still there
                        c.proc.kill()
                elif info["ready_at"] is None and c.is_ready():
                    info["ready_at"] = now
                elif info["ready_at"] is not None and now - info["ready_at"] >= info["hold"]:
                    c.stop.touch()
                    info["stopped"] = now
                elif info["ready_at"] is None and now - info["started"] > 90:
                    self.result["never_ready"] += 1
                    c.proc.kill()
                    info["stopped"] = now
            per_gpu = {g: sum(1 for i in live.values() if i["gpu"] == g) for g in range(self.gpus)}
            for g in range(self.gpus):
                self.result["max_live"][str(g)] = max(self.result["max_live"][str(g)], per_gpu[g])
            if now >= next_start:
                g = pick_gpu(rng, per_gpu, args.max_live)
                if g is not None:
                    plan = client_plan(rng)
                    d = self.daemons[g]
                    c = s.client(f"ch{g}_{n}", plan["mem_gib"], device=0, idle=not plan["busy"],
                                 n=2048 if plan["busy"] else 64,
                                 env=node_phases.daemon_env(d))
                    live[c.tag] = {"client": c, "gpu": g, "hold": plan["hold_seconds"], "ready_at": None,
                                   "started": now, "stopped": None}
                    n += 1
                    self.result["clients_started"] = n
                    self.result["clients_per_gpu"][str(g)] += 1
                next_start = now + rng.uniform(0.5, 1.5)
            self.check_exporter()
            if now >= next_write:
                self.write("running")
                next_write = now + 30
            self.stop.wait(0.2)
        self.result["seconds_run"] = round(time.monotonic() - began, 1)

    def write(self, state: str) -> None:
        self.result["state"] = state
        self.result["scrapes"] = scrape_summary(list(self.scrapes))
        self.result["exporter_starts"] = self.exporter_starts
        self.result["verdict"] = verdict(self.result)
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(out)

    def tear_down(self) -> None:
        """Clients stopped, the exporter stopped, both daemons told to quit (killed if they do not answer)."""
        self.stop.set()
        s = self.session
        for c in s.clients:
            c.stop.touch()
        deadline = time.time() + 10
        for c in s.clients:
            try:
                c.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
        if self.exporter is not None and self.exporter.poll() is None:
            self.exporter.terminate()
            try:
                self.exporter.wait(10)
            except subprocess.TimeoutExpired:
                self.exporter.kill()
        for d in self.daemons:
            info = self.result["daemons"].setdefault(d.name, {})
            try:
                info["quit"] = d.ctl("quit", timeout=10) if d.pipe.exists() else "(no pipe)"
            except subprocess.TimeoutExpired:
                info["quit"] = "(no answer)"
            deadline = time.time() + 10
            while node_phases.control_daemon_pids(d.pipe) and time.time() < deadline:
                time.sleep(0.2)
            if node_phases.control_daemon_pids(d.pipe):
                info["killed"] = d.kill_daemon()
            if d.log.is_dir():
                shutil.copytree(d.log, self.work / "mps-logs" / d.name.replace("/", "_"), dirs_exist_ok=True)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--out", required=True)
    ap.add_argument("--root", default="/tmp/mpsd/churn", help="the device-plugin root of the two daemons")
    ap.add_argument("--work", default="/tmp/churn-work", help="clients' files, exporter logs, the daemons' logs")
    ap.add_argument("--max-live", type=int, default=20, help="clients per GPU at most")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs, a daemon each (0: every GPU nvidia-smi lists)")
    ap.add_argument("--seed", type=int, default=38)
    args = ap.parse_args(argv)
    churn = Churn(args)

    def on_signal(signum: int, _frame: Any) -> None:
        churn.result["signal"] = signal.Signals(signum).name
        churn.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        churn.run()
    except Exception as e:  # the result says why; the daemons still quit
        import traceback
        traceback.print_exc()
        churn.result["error"] = f"{type(e).__name__}: {e}"
    finally:
        churn.stop.set()
        churn.write("finished")
        try:
            churn.tear_down()
        finally:
            churn.write("torn_down")
    print(json.dumps(churn.result["verdict"]), flush=True)
    return 0 if churn.result["verdict"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
