"""Issue 30's synthetic parts: what only shows with two GPUs on one node, through the
whole collector (fakes at the library boundary: pynvml, the control subprocess, /proc,
the MPS logs) down to the exposition the dashboards and alerts read.

The live run on a machine with two GPUs (tests/gpu/multi_gpu_phase.py) checks the same
behaviour against what MPS enforces; these tests hold the exporter's side of it.
"""

from __future__ import annotations

from tests.fakes.fake_procfs import FakeProcess as ProcProcess, write_proc
from tests.fakes.fake_pynvml import FakeProcess as NvmlProcess
from tests.support import scenarios
from tests.support.golden import exposition

GIB = 1 << 30


def series(text: str, name: str, **labels: str) -> list:
    """The sample lines of `name` carrying every one of `labels`."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return [line for line in text.splitlines()
            if line.startswith(name + "{") and all(w in line for w in wanted)]


def value(text: str, name: str, **labels: str) -> float:
    (line,) = series(text, name, **labels)
    return float(line.rsplit(" ", 1)[1])


# ---------------------------------------------------------------- limits across remapped devices
def remapped_limits_scenario(tmp_path) -> scenarios.Scenario:
    """Two GPUs, one server (4000) on both, three clients per GPU (GPU 0: 10000-10002,
    GPU 1: 10003-10005), the issue's remapped settings in their environments:

    - 10000 sees both GPUs and sets `0=2G,1=4G`; it holds memory on both;
    - 10001 sees `1,0` (physical GPU 1 is its device 0), sets `0=2G`, holds memory on both;
    - 10003 sees `CUDA_VISIBLE_DEVICES=1` and sets `0=2G`;
    - 10004 sees GPU 1 by its UUID and sets `0=2G`;
    - 10005 sees only GPU 1 and sets `1=4G`: its device 1 does not exist, CUDA drops it all."""
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3)
    gpu0, gpu1 = scen.nvml.gpus
    for pid in (10000, 10001):  # on both GPUs
        gpu1.mps_processes.append(NvmlProcess(pid, 256 << 20))
        gpu1.compute_processes.append(NvmlProcess(pid, 256 << 20))
    envs = {
        10000: {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G,1=4G"},
        10001: {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"},
        10003: {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"},
        10004: {"CUDA_VISIBLE_DEVICES": gpu1.uuid, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"},
        10005: {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=4G"},
    }
    write_proc(scen.proc_root, [ProcProcess(pid, uid=1000 + pid % 7, environ=env) for pid, env in envs.items()])
    return scen


def test_a_limit_keyed_by_the_clients_device_0_binds_the_physical_gpu_it_sees(tmp_path):
    scen = remapped_limits_scenario(tmp_path)
    text = exposition(scen.collector())
    uuid1 = scen.nvml.gpus[1].uuid
    limit = "mps_client_pinned_memory_limit_bytes"
    for pid in ("10003", "10004"):  # CUDA_VISIBLE_DEVICES=1 and =GPU-<uuid of 1>: 2 GiB on GPU 1, none on 0
        assert value(text, limit, pid=pid, gpu="1") == 2 * GIB, pid
        assert series(text, limit, pid=pid, gpu="0") == [], pid
        assert value(text, "mps_client_memory_used_bytes", pid=pid, gpu="1", uuid=uuid1) > 0
        assert series(text, "mps_client_limit_source", pid=pid, pinned_memory="client") != []
    # `1,0`: its device 0 is physical GPU 1; on GPU 0 (its device 1) it set nothing.
    assert value(text, limit, pid="10001", gpu="1") == 2 * GIB
    assert series(text, limit, pid="10001", gpu="0") == []
    assert len(series(text, "mps_client_memory_used_bytes", pid="10001")) == 2


def test_a_client_seeing_both_gpus_gets_each_its_own_limit(tmp_path):
    text = exposition(remapped_limits_scenario(tmp_path).collector())
    limit = "mps_client_pinned_memory_limit_bytes"
    assert value(text, limit, pid="10000", gpu="0") == 2 * GIB
    assert value(text, limit, pid="10000", gpu="1") == 4 * GIB
    assert len(series(text, "mps_client_memory_used_bytes", pid="10000")) == 2
    assert series(text, "mps_client_limit_ignored", pid="10000") == []


def test_an_entry_naming_a_device_the_client_cannot_see_binds_no_limit(tmp_path):
    text = exposition(remapped_limits_scenario(tmp_path).collector())
    (ignored,) = series(text, "mps_client_limit_ignored", pid="10005")
    assert 'limit="pinned_memory"' in ignored and 'reason="invisible_device"' in ignored
    assert series(text, "mps_client_limit_source", pid="10005", pinned_memory="none") != []
    assert series(text, "mps_client_pinned_memory_limit_bytes", pid="10005") == []
    assert value(text, "mps_client_memory_used_bytes", pid="10005", gpu="1") > 0  # it runs, unlimited
