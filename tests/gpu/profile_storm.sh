#!/bin/bash
# On the lent GPU machine, from the repository root:
#   bash tests/gpu/profile_storm.sh NAME [storm.py arguments...]
# The client storm of tests/gpu/storm.py with py-spy (from .whl/) sampling the
# mps-exporter process, non-blocking, from its start to its exit: where its CPU goes.
# PYSPY=0: no profile (the numbers as a user sees them). Results packed into $OUT/results.tgz. storm.py tells its MPS daemon to quit itself.
set -u
REPO=$(cd "$(dirname "$0")/../.." && pwd)
NAME=$1; shift
R=/tmp/results; rm -rf $R/$NAME; mkdir -p $R/$NAME
trap 'tar czf ${OUT:-/tmp}/results.tgz -C /tmp results' EXIT
. $REPO/tests/gpu/device_env.sh
python3 -c 'import sys, prometheus_client, pynvml; print(sys.version, prometheus_client.__file__)' > $R/$NAME/env.txt 2>&1
python3 -m pip list 2>/dev/null | grep -i -E "prometheus|nvidia-ml|nvitop" >> $R/$NAME/env.txt
python3 $REPO/tests/gpu/storm.py --work /tmp/mps-storm-$NAME --out $R/$NAME --name $NAME "$@" > $R/$NAME/storm.out 2>&1 &
STORM=$!
for _ in $(seq 200); do PID=$(pgrep -f "storm.py timed-serve" | head -1); [ -n "$PID" ] && break; sleep 0.1; done
if [ "${PYSPY:-1}" = 1 ] && [ -n "${PID:-}" ] && [ -x /tmp/site/bin/py-spy ]; then
  /tmp/site/bin/py-spy record --nonblocking --rate 250 --threads --format raw -p $PID -o $R/$NAME/py-spy.txt > $R/$NAME/py-spy.out 2>&1 &
fi
wait $STORM
sleep 2
tail -30 $R/$NAME/storm.out
