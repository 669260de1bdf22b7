"""A CUDA client for the truth check (after the client that recorded tests/data/captures/h200-driver580-a).

gpu_client.py MEM_GIB --ready FILE --stop FILE [--device K] [--n N] [--max-seconds S] [--grow GIB ...]

Holds MEM_GIB of device memory and multiplies N x N matrices until FILE --stop
exists (or S seconds pass). After one warm-up product, so that its memory no
longer moves, it writes its PID, the time and the SM count CUDA gives it (under
MPS: what its active thread percentage leaves) into the --ready file: the driver
compares memory only once every client said ready. An allocation that fails (a
pinned memory limit, out of memory; a refusal at MPS's client limit) prints
ALLOC_FAIL and exits 3. Each --grow G (in order) waits for the file STOP.growI
(I = 0, 1, ...), then tries to hold G GiB in all and writes OK or FAIL <error>
into READY.growI: what MPS enforces on this client, as its allocations see it.
With --grow-relative each G is GiB more than it holds then; with --exit-on-fail a grow
that fails prints ALLOC_FAIL with CUDA's error and exits 3 (issue 40: a client dying of
out of memory), else it goes on holding what it had.

--fill-self-mib M / --fill-gpu-ratio R (issue 40), after the warm-up and before READY:
take more memory in chunks until NVML's reading of this process is at least M MiB (what
the exporter reads for the client), or until the GPU's used memory (NVML v2, as
nvidia-smi) is at least R of its total; an allocation refused halves the chunk (down
to 12 MiB: torch rounds 1-10 MiB requests up to 20 MiB segments). What it reached goes
into READY.fill (JSON) and a FILL line.
"""
import argparse
import json
import os
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("mem_gib", type=float)
p.add_argument("--ready", required=True)
p.add_argument("--stop", required=True)
p.add_argument("--device", type=int, default=0)
p.add_argument("--n", type=int, default=2048)
p.add_argument("--max-seconds", type=float, default=300)
p.add_argument("--idle", action="store_true", help="hold the memory without running kernels")
p.add_argument("--grow", type=float, action="append", default=[], help="GiB to hold in all, on STOP.growI")
p.add_argument("--grow-relative", action="store_true", help="each --grow is GiB more than held then")
p.add_argument("--exit-on-fail", action="store_true", help="a failed grow prints ALLOC_FAIL and exits 3")
p.add_argument("--fill-self-mib", type=float, default=0.0, help="fill until NVML shows this process at M MiB")
p.add_argument("--fill-gpu-ratio", type=float, default=0.0, help="fill until the GPU's used memory is R of its total")
a = p.parse_args()
tag = os.environ.get("TAG", "c")
dev = torch.device("cuda", a.device)
t0 = time.time()
try:
    hold = torch.empty(int(a.mem_gib * 2**30) // 4, dtype=torch.float32, device=dev) if a.mem_gib > 0 else None
    x = torch.randn(a.n, a.n, device=dev)
    y = x @ x
    torch.cuda.synchronize(dev)
except RuntimeError as e:
    print(f"{tag} pid={os.getpid()} uid={os.getuid()} ALLOC_FAIL {str(e)[:300]}", flush=True)
    sys.exit(3)
held = [hold]
MIB = 2**20
FILL_MIN_CHUNK_MIB = 12


def held_bytes() -> int:
    return sum(t.numel() * 4 for t in held if t is not None)


def nvml_device():
    """pynvml and the handle of this client's GPU (by the UUID CUDA gives), or (None, why)."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception as e:  # no pynvml, no NVML
        return None, None, f"NVML: {e}"
    want = str(getattr(torch.cuda.get_device_properties(dev), "uuid", "")).lower()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    for h in handles:
        uuid = pynvml.nvmlDeviceGetUUID(h)
        uuid = (uuid.decode() if isinstance(uuid, bytes) else uuid).lower()
        if want and want in uuid:
            return pynvml, h, ""
    if len(handles) == 1:
        return pynvml, handles[0], ""
    return pynvml, handles[min(a.device, len(handles) - 1)], f"no NVML GPU with CUDA's UUID {want!r}: index {a.device}"


def nvml_self_mib(pynvml, h):
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
        try:
            for proc in getattr(pynvml, getter)(h):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    return proc.usedGpuMemory / MIB
        except Exception:
            continue
    return None


def nvml_gpu_mib(pynvml, h):
    """(used, total) MiB: NVML's v2 memory call, as nvidia-smi; v1 where v2 is missing."""
    try:
        m = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    except Exception:
        m = pynvml.nvmlDeviceGetMemoryInfo(h)
    return m.used / MIB, m.total / MIB


def fill() -> dict:
    """Take memory until the --fill-* target is met, or the GPU (or the limit) refuses 12 MiB."""
    pynvml, h, why = nvml_device()
    out = {"target": "self" if a.fill_self_mib else "gpu", "why": why, "steps": 0, "refused": 0}
    if pynvml is None:
        out["stopped"] = "no NVML"
        return out
    if a.fill_self_mib:
        target, measure = a.fill_self_mib, lambda: nvml_self_mib(pynvml, h)
    else:
        total = nvml_gpu_mib(pynvml, h)[1]
        target, measure = a.fill_gpu_ratio * total, lambda: nvml_gpu_mib(pynvml, h)[0]
    out["target_mib"] = round(target, 1)
    cap = float("inf")
    out["stopped"] = "steps"
    for _ in range(80):
        now = measure()
        if now is None:
            out["stopped"] = "NVML has no reading of this process"
            break
        if now >= target:
            out["stopped"] = "target"
            break
        size = min(cap, max(FILL_MIN_CHUNK_MIB, target - now + 2))
        size = int(-(-size // 2) * 2)  # whole 2 MiB
        try:
            held.append(torch.empty(size * MIB // 4, dtype=torch.float32, device=dev))
            torch.cuda.synchronize(dev)
            out["steps"] += 1
        except RuntimeError as e:  # out of memory: the GPU or the pinned limit
            out["refused"] += 1
            out["last_refusal"] = str(e).splitlines()[0][:300]
            cap = size / 2
            if cap < FILL_MIN_CHUNK_MIB:
                out["stopped"] = "brim"
                break
    out["reached_mib"] = None if measure() is None else round(measure(), 1)
    out["self_mib"] = nvml_self_mib(pynvml, h)
    out["gpu_used_mib"], out["gpu_total_mib"] = [round(x, 1) for x in nvml_gpu_mib(pynvml, h)]
    free, total = torch.cuda.mem_get_info(dev)  # under a pinned limit: the limit less what is used
    out.update(held_mib=round(held_bytes() / MIB, 1), cuda_free_mib=round(free / MIB, 1),
               cuda_total_mib=round(total / MIB, 1), torch_reserved_mib=round(torch.cuda.memory_reserved(dev) / MIB, 1))
    try:
        pynvml.nvmlShutdown()
    except Exception:
        pass
    return out


if a.fill_self_mib or a.fill_gpu_ratio:
    filled = fill()
    print(f"{tag} pid={os.getpid()} FILL {json.dumps(filled)}", flush=True)
    with open(f"{a.ready}.fill", "w") as f:
        json.dump(filled, f)
with open(a.ready, "w") as f:
    f.write(f"{os.getpid()} {time.time():.3f} {torch.cuda.get_device_properties(dev).multi_processor_count}\n")
iters = 0
t_ready = time.time()
step = 0


def try_grow(gib: float) -> str:
    more = int(gib * 2**30) if a.grow_relative else max(0, int(gib * 2**30) - held_bytes())
    try:
        held.append(torch.empty(more // 4, dtype=torch.float32, device=dev))
        torch.cuda.synchronize(dev)
        return "OK"
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError under a pinned limit
        return "FAIL " + str(e).splitlines()[0][:300]


while not os.path.exists(a.stop) and time.time() - t_ready < a.max_seconds:
    if step < len(a.grow) and os.path.exists(f"{a.stop}.grow{step}"):
        result = try_grow(a.grow[step])
        print(f"{tag} pid={os.getpid()} grow to {a.grow[step]} GiB: {result}", flush=True)
        with open(f"{a.ready}.grow{step}", "w") as f:
            f.write(result + "\n")
        step += 1
        if a.exit_on_fail and result.startswith("FAIL"):
            print(f"{tag} pid={os.getpid()} uid={os.getuid()} ALLOC_FAIL {result[5:]}", flush=True)
            sys.exit(3)
    if a.idle:
        time.sleep(0.05)
        continue
    torch.matmul(x, x, out=y)  # out=: no new allocation, the memory stays put
    iters += 1
    if iters % 20 == 0:
        torch.cuda.synchronize(dev)
torch.cuda.synchronize(dev)
print(f"{tag} pid={os.getpid()} uid={os.getuid()} dev={a.device} init={t_ready - t0:.2f}s iters={iters} "
      f"busy={time.time() - t_ready:.2f}", flush=True)
