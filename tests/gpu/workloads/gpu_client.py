"""A CUDA client for the truth check (after the client that recorded tests/data/captures/h200-driver580-a).

gpu_client.py MEM_GIB --ready FILE --stop FILE [--device K] [--n N] [--max-seconds S]

Holds MEM_GIB of device memory and multiplies N x N matrices until FILE --stop
exists (or S seconds pass). After one warm-up product, so that its memory no
longer moves, it writes its PID into the --ready file: the driver compares
memory only once every client said ready. An allocation that fails (a pinned
memory limit, out of memory) prints ALLOC_FAIL and exits 3.
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
    f.write(f"{os.getpid()} {time.time():.3f}\n")
iters = 0
t_ready = time.time()
while not os.path.exists(a.stop) and time.time() - t_ready < a.max_seconds:
    if a.idle:
        time.sleep(0.05)
        continue
    torch.matmul(x, x, out=y)  # out=: no new allocation, the memory stays put
    iters += 1
    if iters % 20 == 0:
        torch.cuda.synchronize(dev)
torch.cuda.synchronize(dev)
print(f"{tag} pid={os.getpid()} uid={os.getuid()} dev={a.device} init={t_ready - t0:.2f}s iters={iters}", flush=True)
