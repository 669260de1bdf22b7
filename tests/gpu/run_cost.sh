#!/bin/bash
# On the lent GPU machine, from the repository root (issue 44):
#   [CLIENTS=8 BUSY=4] [OLD=.old] bash tests/gpu/run_cost.sh [OLD_NAME]
# node_cost.py: this tree's exporter and $OLD/exporter (OLD_NAME's tree, from
# `git archive OLD_NAME exporter | tar x -C .old`) side by side on one MPS daemon, beside
# .bin/node_exporter. Packs $OUT/cost.tgz. The MPS daemon is told to quit whatever happens.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
C=/tmp/cost; rm -rf $C; mkdir -p $C
pack() {
  echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-cost/pipe timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
  cp -r /tmp/mps-cost/log $C/mps-log 2>/dev/null
  tar czf ${OUT:-/tmp}/cost.tgz -C /tmp cost
}
trap pack EXIT
. $REPO/tests/gpu/device_env.sh
mkdir -p /tmp/pkgold && ln -sfn $REPO/${OLD:-.old}/exporter /tmp/pkgold/mps_exporter
{ nproc; uptime; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > $C/env.txt 2>&1
timeout -s INT 520 python3 $REPO/tests/gpu/node_cost.py --work /tmp/mps-cost --out $C --old-package /tmp/pkgold \
  --old-name "${1:-c5fc7fc}" --node-exporter $REPO/.bin/node_exporter --clients ${CLIENTS:-8} --busy ${BUSY:-4} \
  2>&1 | tee $C/node_cost.out
cat $C/node_cost.md 2>/dev/null
