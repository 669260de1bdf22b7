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
"""
import argparse
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
with open(a.ready, "w") as f:
    f.write(f"{os.getpid()} {time.time():.3f} {torch.cuda.get_device_properties(dev).multi_processor_count}\n")
iters = 0
t_ready = time.time()
held = [hold]
step = 0


def try_grow(total_gib: float) -> str:
    have = sum(t.numel() * 4 for t in held if t is not None)
    try:
        held.append(torch.empty(max(0, int(total_gib * 2**30) - have) // 4, dtype=torch.float32, device=dev))
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
