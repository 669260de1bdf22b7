#!/bin/bash
# Does a pinned limit set by ordinal answer to a get by UUID, and the reverse? (read then quit)
set -u
export CUDA_MPS_PIPE_DIRECTORY=/tmp/uuidprobe/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/uuidprobe/log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0)
nvidia-smi --query-gpu=driver_version,name --format=csv,noheader -i 0
c() { printf '%s\n' "$*" | timeout 10 nvidia-cuda-mps-control; echo "  [rc=$?] <- $*"; }
ask() { echo "--- $1"; c get_default_device_pinned_mem_limit 0; c get_default_device_pinned_mem_limit $UUID; }
run_daemon() { nvidia-cuda-mps-control -d; sleep 1; }
run_daemon
ask "fresh daemon"
c set_default_device_pinned_mem_limit 0 2048M
ask "after set by ordinal 0 2048M"
c set_default_device_pinned_mem_limit $UUID 4096M
ask "after also set by UUID 4096M"
# a server: a client that holds a context for a few seconds
python3 -c "import torch,time; x=torch.zeros(1,device='cuda'); time.sleep(12)" &
CL=$!
sleep 8
c get_server_list
SRV=$(printf 'get_server_list\n' | nvidia-cuda-mps-control | head -1)
echo "server $SRV"
c get_device_pinned_mem_limit $SRV 0
c get_device_pinned_mem_limit $SRV $UUID
c set_device_pinned_mem_limit $SRV 0 1024M
c get_device_pinned_mem_limit $SRV 0
c get_device_pinned_mem_limit $SRV $UUID
wait $CL
c quit
sleep 2
run_daemon
ask "restarted daemon"
c set_default_device_pinned_mem_limit $UUID 3072M
ask "after set by UUID only 3072M"
python3 -c "import torch,time; x=torch.zeros(1,device='cuda'); time.sleep(10)" &
CL=$!
sleep 7
SRV=$(printf 'get_server_list\n' | nvidia-cuda-mps-control | head -1)
echo "server $SRV"
c get_device_pinned_mem_limit $SRV 0
c get_device_pinned_mem_limit $SRV $UUID
c set_device_pinned_mem_limit $SRV $UUID 1536M
c get_device_pinned_mem_limit $SRV 0
c get_device_pinned_mem_limit $SRV $UUID
wait $CL
c quit
sleep 1
echo "=== control.log"; cat $CUDA_MPS_LOG_DIRECTORY/control.log | tail -80
mkdir -p $OUT/uuidprobe && cp -r $CUDA_MPS_LOG_DIRECTORY $OUT/uuidprobe/
