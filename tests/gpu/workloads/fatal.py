"""A client that hits a fatal GPU error: a kernel writes through a wild pointer
(illegal address), which the MPS server handles as "a fatal GPU error". (fault.py's
out-of-bounds index is only a device-side assert: MPS logs "Worker is in reset".)"""
import os

import cupy as cp

wild = cp.RawKernel(r'''extern "C" __global__ void wild(int *p) { p[threadIdx.x * 4096] = 1; }''', "wild")
cp.zeros(16, dtype=cp.int32)  # a context and a first kernel that works
cp.cuda.Device().synchronize()
try:
    wild((1,), (32,), (cp.uint64(0xDEAD00000000),))
    cp.cuda.Device().synchronize()
    print(f"fatal pid={os.getpid()} no error?", flush=True)
except Exception as e:  # cudaErrorIllegalAddress
    print(f"fatal pid={os.getpid()} err={type(e).__name__}: {str(e)[:200]}", flush=True)
