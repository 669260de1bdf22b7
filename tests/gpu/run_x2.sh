#!/bin/bash
# Issue 38 on the lent machine with two GPUs (nvidia-h100-x2), from the repository root, in
# two device calls on the same warm machine (carry: .whl):
#   bash tests/gpu/run_x2.sh call1   # churn.py detached (600 s), then the truth check's
#                                    # phases starts,cvdlimits,killdaemon,ceiling,quit
#   bash tests/gpu/run_x2.sh call2   # remapped,percap,daemonpergpu,storm2,quit (storm2 beside
#                                    # nvitop-exporter), then churn.json; packs $OUT/results.tgz
# Estimates (wall): call1 ~ 10 s setup + starts 100 + cvdlimits 150 + killdaemon 35 +
#   ceiling 60 + quit 10 = ~370 s, cut at 470 s (SIGINT: report written, MPS told to quit);
#   call2 ~ remapped 45 + percap 100 + daemonpergpu 50 + storm2 130 + quit 10 = ~340 s, cut at
#   400 s; then the wait for churn (started ~ call1's start: done ~ 620 s later) until 490 s,
#   then churn SIGTERMed (it writes its result, quits its daemons) and everything packed.
# Whatever happens, every MPS control daemon a call started is told to quit (trap EXIT);
# churn.py's two daemons (/tmp/mpsd/churn) are its own, quit by it (call2 quits them too
# once churn has ended or was stopped).
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CALL=${1:?usage: run_x2.sh call1|call2}
R=/tmp/results-x2
C=/tmp/churn-out
quit_pipe() {  # quit one daemon by its pipe directory; kill it and its servers if it does not answer
  local d=$1
  [ -d "$d" ] || return 0
  echo quit | CUDA_MPS_PIPE_DIRECTORY=$d timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
  for p in $(pgrep -f nvidia-cuda-mps); do
    tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "CUDA_MPS_PIPE_DIRECTORY=$d" && kill -9 $p
  done
}
quit_mine() {  # every daemon of the truth check and its phases; churn's only with "all"
  for d in /tmp/mps-truth-x2/pipe $(find /tmp/mpsd -type d -name pipe 2>/dev/null); do
    case $d in /tmp/mpsd/churn/*) [ "${1:-}" = all ] || continue ;; esac
    quit_pipe $d
  done
}
keep() {  # the run's files into $R/$CALL
  mkdir -p $R/$CALL
  for x in log clients starts '*.log' '*-logs'; do
    cp -r /tmp/mps-truth-x2/$x $R/$CALL/ 2>/dev/null
  done
}
. $REPO/tests/gpu/device_env.sh
case $CALL in
call1)
  rm -rf $R $C; mkdir -p $R/call1 $C
  trap 'quit_mine; keep; tar czf ${OUT:-/tmp}/call1.tgz -C /tmp results-x2' EXIT
  { nvidia-smi; nvidia-smi -L; nvidia-smi -q -d COMPUTE | grep -i mode; nproc; free -g
    python3 -c 'import sys, pynvml, prometheus_client, torch, nvitop, nvitop_exporter; print(sys.version, torch.__version__)'
  } > $R/env.txt 2>&1
  cat $R/env.txt
  setsid nohup python3 $REPO/tests/gpu/churn.py --seconds ${CHURN_SECONDS:-600} --out $C/churn.json \
    > $C/churn.log 2>&1 < /dev/null &
  echo $! > $C/pid; date +%s > $C/started
  timeout -s INT -k 30 ${TRUTH_SECONDS:-470} python3 $REPO/tests/gpu/truth_check.py --work /tmp/mps-truth-x2 \
    --report-dir $R/reports --name x2-issue38-call1 --title "Issue 38 on two GPUs: starts, CUDA_VISIBLE_DEVICES limits, a killed daemon, the connection ceiling" \
    --phases ${PHASES:-starts,cvdlimits,killdaemon,ceiling,quit} 2>&1 | tee $R/call1/truth_check.out | grep -E "^(FAIL|###)"
  tail -3 $C/churn.log; cat $C/churn.json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin).get("verdict"))'
  ;;
call2)
  mkdir -p $R/call2 $C
  finish() {
    quit_mine
    if [ -f $C/pid ] && kill -0 $(cat $C/pid) 2>/dev/null; then kill -TERM $(cat $C/pid); fi
    for _ in $(seq 25); do [ -f $C/pid ] && kill -0 $(cat $C/pid) 2>/dev/null || break; sleep 1; done
    quit_mine all
    keep; cp -r $C $R/churn 2>/dev/null; cp -r /tmp/churn-work/mps-logs /tmp/churn-work/exporter-*.err $R/churn/ 2>/dev/null
    tar czf ${OUT:-/tmp}/results.tgz -C /tmp results-x2
  }
  trap finish EXIT
  timeout -s INT -k 30 ${TRUTH_SECONDS:-400} python3 $REPO/tests/gpu/truth_check.py --work /tmp/mps-truth-x2 \
    --report-dir $R/reports --name x2-issue38-call2 --title "Issue 38 on two GPUs: remapped limits, 48 per device, a daemon per GPU, storm beside nvitop-exporter" \
    --phases ${PHASES:-remapped,percap,daemonpergpu,storm2,quit} 2>&1 | tee $R/call2/truth_check.out | grep -E "^(FAIL|###)"
  # churn.json: wait for its teardown (state torn_down) or its end, at most until 490 s into this call
  while [ $SECONDS -lt ${CHURN_WAIT_UNTIL:-490} ]; do
    grep -q '"state": "torn_down"' $C/churn.json 2>/dev/null && break
    [ -f $C/pid ] && kill -0 $(cat $C/pid) 2>/dev/null || break
    sleep 5
  done
  echo "churn: started $(( $(date +%s) - $(cat $C/started 2>/dev/null || date +%s) )) s ago"
  tail -3 $C/churn.log 2>/dev/null
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["state"], d.get("verdict"))' $C/churn.json
  ;;
*) echo "usage: run_x2.sh call1|call2" >&2; exit 2 ;;
esac
