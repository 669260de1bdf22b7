#!/bin/bash
# Pinned limits on two GPUs, in one device call on nvidia-h200-x2 (no carry; on one GPU
# part 2 alone), from the repository root:  bash tests/gpu/pinned_limit_probe_x2.sh  (~90 s)
# 1. Does a server's limit answer alike by the daemon's ordinal and by GPU UUID on two GPUs,
#    the daemon started with and without CUDA_VISIBLE_DEVICES=1,0? (uuid_limit_probe.sh saw
#    it on one GPU: then control.py need not ask the UUID after an empty ordinal answer.)
# 2. What does a limit of 1536M bind, whose get answers 1G? Each limit in turn: a client
#    allocating 64 MiB blocks until refused, the total printed.
# Its own daemon (pipe and logs under /tmp/pinprobe), told to quit after each part; the
# control logs go to $OUT/pinprobe.tgz.
set -u
P=/tmp/pinprobe
export CUDA_MPS_PIPE_DIRECTORY=$P/pipe CUDA_MPS_LOG_DIRECTORY=$P/log
rm -rf $P && mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
trap 'echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1; tar -C /tmp -czf ${OUT:-/tmp}/pinprobe.tgz pinprobe' EXIT
U0=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | sed -n 1p)
U1=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | sed -n 2p)  # empty on one GPU
nvidia-smi --query-gpu=index,uuid,driver_version,name --format=csv,noheader
nvidia-cuda-mps-control -v | head -1
c() { local out; out=$(printf '%s\n' "$*" | timeout 10 nvidia-cuda-mps-control 2>&1 | tr '\n' ' '); echo "  [$out] <- $*"; }
server() { printf 'get_server_list\n' | timeout 10 nvidia-cuda-mps-control | head -1; }
start() {
  echo "=== daemon, CUDA_VISIBLE_DEVICES=${1:-unset}"
  if [ -n "${1:-}" ]; then CUDA_VISIBLE_DEVICES=$1 nvidia-cuda-mps-control -d; else nvidia-cuda-mps-control -d; fi
  sleep 1
}
stop() { c quit; sleep 2; }
ask() {
  echo "--- server $1: $2"
  for key in 0 1 $U0 $U1; do c get_device_pinned_mem_limit $1 $key; done
}

[ -n "$U1" ] || echo "one GPU: part 1 left out"
for cvd in ${U1:+"" "1,0"}; do
  start "$cvd"
  c set_default_device_pinned_mem_limit $U1 3072M
  for key in 0 1 $U0 $U1; do c get_default_device_pinned_mem_limit $key; done
  python3 -c "import torch,time
for i in range(torch.cuda.device_count()): torch.zeros(1, device=f'cuda:{i}')
time.sleep(12)" &
  CL=$!
  sleep 8
  S=$(server)
  ask "$S" "default set by the UUID of GPU 1 (3072M)"
  c set_device_pinned_mem_limit $S $U0 1024M
  ask "$S" "then the server's limit on GPU 0 set by UUID (1024M)"
  c set_device_pinned_mem_limit $S 1 2048M
  ask "$S" "then the server's ordinal 1 set (2048M)"
  wait $CL
  stop
done

for limit in 1024M 1536M 2048M; do
  start ""
  c set_default_device_pinned_mem_limit 0 $limit
  c get_default_device_pinned_mem_limit 0
  python3 -c "import torch
blocks = []
try:
    while len(blocks) < 128:
        blocks.append(torch.empty(64 << 20, dtype=torch.uint8, device='cuda:0'))
    torch.cuda.synchronize()
except RuntimeError as e:
    print('   refused:', str(e).splitlines()[0][:100])
print('   limit $limit: allocated', 64 * len(blocks), 'MiB in 64 MiB blocks')"
  stop
done
