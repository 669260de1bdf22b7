#!/bin/bash
# On the lent GPU machine: the open flags of the MPS daemon's and server's log files
# (docs/logs.md: a collapse needs MPS to write with O_APPEND, 02000 in fdinfo's octal
# flags). Its own pipe and log directories under /tmp; ends with `quit`.
set -u
W=/tmp/mps-openmode; rm -rf $W; mkdir -p $W/pipe $W/log
export CUDA_MPS_PIPE_DIRECTORY=$W/pipe CUDA_MPS_LOG_DIRECTORY=$W/log
nvidia-cuda-mps-control -d
sleep 1
python3 -c 'import time, torch; torch.zeros(1, device="cuda"); time.sleep(8)' &
CLIENT=$!
sleep 6
for p in $(pgrep -f nvidia-cuda-mps); do
  for fd in /proc/$p/fd/*; do
    target=$(readlink "$fd")
    case $target in
      $W/log/*) echo "pid $p $(cat /proc/$p/comm) fd ${fd##*/} $target $(grep '^flags' /proc/$p/fdinfo/${fd##*/})";;
    esac
  done
done
wait $CLIENT
echo quit | nvidia-cuda-mps-control
sleep 1
