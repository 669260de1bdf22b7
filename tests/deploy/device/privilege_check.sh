#!/bin/bash
# Device check: the exporter under the privilege models
# of deploy/ against a real MPS daemon laid out as NVIDIA's device plugin does
# (/run/nvidia/mps/nvidia.com/gpu/{pipe,log}), the MPS root mounted read-only as the
# chart mounts it, one CUDA client of uid 1500 that sets its own
# CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30. Needs root, a GPU, torch (tests/gpu/workloads)
# and the bcrypt wheel in .whl/. Run from the repository root on the GPU machine;
# the expositions go to $OUT. Results of a run: privilege_check.md.
set -u
REPO=$(pwd)
mkdir -p /tmp/pkg && ln -sfn $REPO/exporter /tmp/pkg/mps_exporter
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $REPO/.whl/*.whl
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1
id mpsuser >/dev/null 2>&1 || useradd -M -u 1500 mpsuser
ROOT=/run/nvidia/mps; R=$ROOT/nvidia.com/gpu
mkdir -p $R/pipe $R/log
export CUDA_MPS_PIPE_DIRECTORY=$R/pipe CUDA_MPS_LOG_DIRECTORY=$R/log
nvidia-cuda-mps-control -d; sleep 1
W=/tmp/w; mkdir -p $W; chmod 777 $W
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30 TAG=envlimited python3 tests/gpu/workloads/runas.py 1500 \
  python3 tests/gpu/workloads/gpu_client.py 1 --ready $W/ready --stop $W/stop --max-seconds 150 > $W/client.out 2>&1 &
for i in $(seq 90); do [ -s $W/ready ] && break; sleep 1; done
echo "client ready: $(cat $W/ready 2>/dev/null)"; cat $W/client.out
printf 'daemons:\n- name: nvidia.com/gpu\n  pipe_directory: %s/pipe\n  log_directory: %s/log\n' $R $R > /tmp/config.yml
mkdir -p /tmp/st0 /tmp/stn /tmp/sta; chmod 777 /tmp/stn /tmp/sta
DUMP="python3 -m mps_exporter.cli dump --config.file=/tmp/config.yml --no-collector.dcgm --mps.log-timezone=UTC"
# The container's view: the MPS root mounted read-only at the same path.
ro() { unshare -m sh -c "mount --bind $ROOT $ROOT && mount -o remount,bind,ro $ROOT && $*"; }
run() {
  name=$1; shift
  ro "$* $DUMP --mps.state-file=/tmp/st_$name.json" > $OUT/$name.prom 2> $OUT/$name.err
  echo "== $name: rc=$? $(grep -c '^mps_' $OUT/$name.prom) samples"
  grep -E '^mps_(control_daemon_up|client_active_thread_ratio|client_info|exporter_collector_success|server_clients|gpu_up)' $OUT/$name.prom | cut -c1-200
  tail -3 $OUT/$name.err
}
run chart-default "setpriv --no-new-privs --bounding-set=-all,+sys_ptrace,+dac_read_search --inh-caps=-all"
run nonroot "setpriv --no-new-privs --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --bounding-set=-all"
run systemd-ambient "setpriv --no-new-privs --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all,+sys_ptrace,+dac_read_search --ambient-caps=-all,+sys_ptrace,+dac_read_search"
touch $W/stop; sleep 2
echo quit | nvidia-cuda-mps-control; sleep 1
tail -5 $R/log/control.log
