#!/bin/bash
# On the lent GPU machine, from the repository root:
#   bash tests/gpu/run_device.sh NAME "TITLE" [bundle] [PHASES]
# Runs the truth check (its PHASES, comma-separated, or all; with "bundle", records
# the replay bundle after it),
# then packs everything into $OUT/results.tgz (one file: at most 8 come back).
# Whatever happens, every MPS control daemon this script started is told to quit.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
NAME=${1:-single-h200}; TITLE=${2:-Truth check on one NVIDIA H200}; BUNDLE=${3:-}; PHASES=${4:-}
R=/tmp/results; rm -rf $R; mkdir -p $R
quit_all() {
  for d in /tmp/mps-truth/pipe /tmp/mps-bundle/pipe $(find /tmp/mpsd -type d -name pipe 2>/dev/null); do
    [ -d $d ] && echo quit | CUDA_MPS_PIPE_DIRECTORY=$d timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
    # A daemon that did not answer quit (one hung in phase queuedeath): kill it and its
    # servers, found by their pipe directory, so that none outlives this run.
    for p in $(pgrep -f nvidia-cuda-mps); do
      tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "CUDA_MPS_PIPE_DIRECTORY=$d" && kill -9 $p
    done
  done
  for w in /tmp/mps-truth /tmp/mps-bundle; do
    [ -d $w ] && mkdir -p $R/$(basename $w) && cp -r $w/log $w/clients $w/*.log $w/discovery-logs $R/$(basename $w)/ 2>/dev/null
  done
  tar czf ${OUT:-/tmp}/results.tgz -C /tmp results
}
trap quit_all EXIT
. $REPO/tests/gpu/device_env.sh
id mpsuser >/dev/null 2>&1 || useradd -M -u 1500 mpsuser
{ nvidia-smi; nvidia-smi -q -d COMPUTE | grep -i mode; python3 -c 'import sys, pynvml, prometheus_client, yaml, bcrypt, torch; print(sys.version, pynvml.__file__, torch.__version__)'; } > $R/env.txt 2>&1
cat $R/env.txt
# SIGINT at the time limits: Python runs its finally blocks (report written, MPS told to quit)
timeout -s INT ${TRUTH_SECONDS:-900} python3 $REPO/tests/gpu/truth_check.py --work /tmp/mps-truth --report-dir $R/reports --name "$NAME" --title "$TITLE" \
  ${PHASES:+--phases "$PHASES"} 2>&1 | tee $R/truth_check.out
if [ "$BUNDLE" = bundle ]; then
  timeout -s INT ${BUNDLE_SECONDS:-600} python3 $REPO/tests/gpu/record_bundle.py --work /tmp/mps-bundle --out $R/bundle 2>&1 | tee $R/bundle.out
  ls -la $R/bundle
fi
