#!/bin/bash
# Issue 45 on a lent machine with four GPUs (nvidia-h100-x4 / nvidia-h200-x4), from the repository
# root, in two device calls on the same warm machine (carry: .whl):
#   bash tests/gpu/run_x4.sh call1   # churn.py on every GPU detached (600 s), then the truth
#                                    # check's phases starts,cvdlimits,storm2,quit over every GPU
#   bash tests/gpu/run_x4.sh call2   # waits for churn.json, packs $OUT/results.tgz
# Estimates (wall): call1 ~ starts 80 s (4 daemons, 20 starts 4 at a time) + cvdlimits 90 (GPU 2
#   by index, GPU 3 by UUID) + storm2 180 (52 clients on each of 4 GPUs beside nvitop-exporter)
#   + quit 10 = ~360 s, cut at 500 s; call2 waits until churn's 600 s are over (~250 s).
# churn.py keeps at most 10 live clients a GPU here (20 on two GPUs): beside a storm of 52 a GPU,
# an H100's 80 GB must hold both.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CALL=${1:?usage: run_x4.sh call1|call2}
R=/tmp/results-x4
C=/tmp/churn4-out
quit_all() {
  for d in /tmp/mps-truth-x4/pipe $(find /tmp/mpsd -type d -name pipe 2>/dev/null); do
    case $d in /tmp/mpsd/churn/*) [ "${1:-}" = all ] || continue ;; esac
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$d timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
    for p in $(pgrep -f nvidia-cuda-mps); do
      tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "CUDA_MPS_PIPE_DIRECTORY=$d" && kill -9 $p
    done
  done
}
. $REPO/tests/gpu/device_env.sh
case $CALL in
call1)
  rm -rf $R $C; mkdir -p $R $C
  trap 'quit_all; tar czf ${OUT:-/tmp}/call1.tgz -C /tmp results-x4' EXIT
  { nvidia-smi -L; nproc; python3 -c 'import sys, torch, nvitop_exporter; print(sys.version, torch.__version__)'; } > $R/env.txt 2>&1
  cat $R/env.txt
  if [ "${CHURN_SECONDS:-600}" != 0 ]; then  # CHURN_SECONDS=0: the truth check's phases alone
    setsid nohup python3 $REPO/tests/gpu/churn.py --seconds ${CHURN_SECONDS:-600} --max-live 10 --out $C/churn.json \
      > $C/churn.log 2>&1 < /dev/null &
    echo $! > $C/pid; date +%s > $C/started
  fi
  timeout -s INT -k 30 ${TRUTH_SECONDS:-500} python3 $REPO/tests/gpu/truth_check.py --work /tmp/mps-truth-x4 \
    --report-dir $R/reports --name x4-issue45 --title "Issue 45 on four GPUs: starts, limits on GPUs 2 and 3, storm beside nvitop-exporter" \
    --phases ${PHASES:-starts,cvdlimits,storm2,quit} 2>&1 | tee $R/truth_check.out | grep -E "^(FAIL|###)"
  cp -r /tmp/mps-truth-x4/log $R/ 2>/dev/null; cp /tmp/mps-truth-x4/py-spy-storm2.txt /tmp/mps-truth-x4/*.log $R/ 2>/dev/null
  ;;
call2)
  mkdir -p $R $C
  trap 'quit_all all; cp -r $C $R/churn 2>/dev/null; tar czf ${OUT:-/tmp}/results.tgz -C /tmp results-x4' EXIT
  while [ $SECONDS -lt ${CHURN_WAIT_UNTIL:-420} ]; do
    grep -q '"state": "torn_down"' $C/churn.json 2>/dev/null && break
    [ -f $C/pid ] && kill -0 $(cat $C/pid) 2>/dev/null || break
    sleep 5
  done
  if [ -f $C/pid ] && kill -0 $(cat $C/pid) 2>/dev/null; then kill -TERM $(cat $C/pid); sleep 20; fi
  echo "churn: started $(( $(date +%s) - $(cat $C/started 2>/dev/null || date +%s) )) s ago"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["state"], d.get("seconds_run"), d.get("verdict"))' $C/churn.json
  ;;
*) echo "usage: run_x4.sh call1|call2" >&2; exit 2 ;;
esac
