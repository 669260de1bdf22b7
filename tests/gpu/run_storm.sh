#!/bin/bash
# On the lent GPU machine, from the repository root (issue 29):
#   bash tests/gpu/run_storm.sh [CLIENTS] [BUSY] [TRUTH_PHASES]
# 1. the client storm (storm.py): mps-exporter with the default background refresh and a
#    twin with --collector.refresh-interval 0, beside nvitop-exporter (wheels from .whl/);
# 2. the truth check's phases (run_device.sh) with the exporter's defaults;
# 3. the scrape benchmark on this machine's CPUs.
# Packs $OUT/storm.tgz, $OUT/results.tgz (run_device.sh) and $OUT/bench.txt. The storm's
# MPS daemon is told to quit whatever happens (storm.py), the truth check's by run_device.sh.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CLIENTS=${1:-52}; BUSY=${2:-13}; PHASES=${3:-idle,mixed,many,queue,limits,fault,refusals,limitchange,kill,quit}
S=/tmp/storm; rm -rf $S; mkdir -p $S
pack_storm() {
  echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-storm/pipe timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
  cp -r /tmp/mps-storm/log $S/mps-log 2>/dev/null
  rm -f $S/calls.json
  tar czf ${OUT:-/tmp}/storm.tgz -C /tmp storm
}
trap pack_storm EXIT
. $REPO/tests/gpu/device_env.sh
export PYTHONPATH=$PYTHONPATH:$REPO
uptime > $S/load-before.txt
timeout -s INT ${STORM_SECONDS:-200} python3 $REPO/tests/gpu/storm.py --work /tmp/mps-storm --out $S \
  --clients "$CLIENTS" --busy "$BUSY" --name storm-refresh 2>&1 | tee $S/storm.out
pack_storm
TRUTH_SECONDS=${TRUTH_SECONDS:-260} bash $REPO/tests/gpu/run_device.sh truth-refresh-default \
  "Truth check with the default --collector.refresh-interval (1 s)" "" "$PHASES" > /tmp/truth.out 2>&1
tail -5 /tmp/truth.out
{ nproc; uptime; timeout ${BENCH_SECONDS:-90} python3 $REPO/bench/scrape_bench.py --scrapes 100 --storm-seconds 10; } \
  > ${OUT:-/tmp}/bench.txt 2>&1
tail -22 ${OUT:-/tmp}/bench.txt
