"""The limit model of exporter/limits.py against what MPS enforced (issue 24, H100, driver
580.159.04, MPS 13000): each client held 0.5 GiB and asked for 2 GiB more; a 2 GiB limit
made that fail."""

import pytest

from mps_exporter import limits as lim
from mps_exporter.limits import Limits, VisibleDevice, client_limits, own_limits, pinned_from_env, visible_devices

UUID0 = "GPU-4b5da867-9d06-5e2c-8dea-18b8dab8a008"  # the H100 of the shipped session
UUID1 = "GPU-a20825ef-ef8f-4f37-8e21-502c5b706a70"
ONE_GPU = [(0, UUID0)]
TWO_GPUS = [(0, UUID0), (1, UUID1)]
G2 = 2 << 30


@pytest.mark.parametrize("value, pinned, ignored", [
    # the table, one GPU visible
    ("0=2G", {0: G2}, None),
    ("0=2048M", {0: G2}, None),
    (f"{UUID0}=2G", {0: G2}, None),
    ("GPU-4b5da867=2G", {0: G2}, None),
    ("0=2G,1=4G", {}, lim.INVISIBLE_DEVICE),  # MPS enforced no limit at all
    ("2G", {}, lim.NO_DEVICE),
    # and around it
    ("", {}, None),
    ("GPU-ffffffff=2G", {}, lim.INVISIBLE_DEVICE),
    ("0=lots", {}, lim.MALFORMED),
    ("disk0=2G", {}, lim.MALFORMED),
])
def test_pinned_limit_forms_on_one_visible_gpu(value, pinned, ignored):
    own = own_limits({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": value}, ONE_GPU)
    assert own.limits.pinned_bytes == pinned
    assert own.ignored.get(lim.PINNED_MEMORY) == ignored


def test_ordinals_count_the_clients_visible_devices_not_the_nodes():
    # CUDA_VISIBLE_DEVICES=1: the client's device 0 is the node's GPU 1.
    env = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G"}
    assert own_limits(env, TWO_GPUS).limits.pinned_bytes == {1: G2}
    # ... and its device 1 does not exist: every entry is dropped.
    env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = "0=2G,1=4G"
    assert own_limits(env, TWO_GPUS).ignored == {lim.PINNED_MEMORY: lim.INVISIBLE_DEVICE}
    # Both visible, in the client's order.
    env = {"CUDA_VISIBLE_DEVICES": f"{UUID1},0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G,1=4G"}
    assert own_limits(env, TWO_GPUS).limits.pinned_bytes == {1: G2, 0: 4 << 30}
    # A UUID key names the device whatever the ordinals.
    env = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "GPU-a20825ef=2G"}
    assert own_limits(env, TWO_GPUS).limits.pinned_bytes == {1: G2}
    env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = "GPU-4b5da867=2G"  # the node's GPU 0, not visible
    assert own_limits(env, TWO_GPUS).ignored == {lim.PINNED_MEMORY: lim.INVISIBLE_DEVICE}


def test_visible_devices_as_cuda_reads_them():
    assert visible_devices(None, TWO_GPUS) == [VisibleDevice(0, UUID0), VisibleDevice(1, UUID1)]
    assert visible_devices("", TWO_GPUS) == []
    assert visible_devices("1,0,1", TWO_GPUS) == [VisibleDevice(1, UUID1), VisibleDevice(0, UUID0)]
    assert visible_devices("0,7,1", TWO_GPUS) == [VisibleDevice(0, UUID0)]  # stops at the first it cannot find
    assert visible_devices("GPU-a2,0", TWO_GPUS) == [VisibleDevice(1, UUID1), VisibleDevice(0, UUID0)]
    mig = "MIG-5c89dc2a-6d9a-5b9e-a4f6-0d0ac1b1a0c3"
    assert visible_devices(mig, TWO_GPUS) == [VisibleDevice(None, mig)]
    # A limit on a MIG instance is in force there but has no GPU series: nothing to publish, nothing ignored.
    assert pinned_from_env("0=2G", visible_devices(mig, TWO_GPUS)) == ({}, None)


@pytest.mark.parametrize("value, share, ignored", [
    ("25", 25.0, None), ("100", 100.0, None), ("abc", None, lim.NOT_A_NUMBER), ("150", None, lim.OUT_OF_RANGE),
    ("0", None, lim.OUT_OF_RANGE), ("nan", None, lim.OUT_OF_RANGE), ("", None, None),
])
def test_thread_percentage_values(value, share, ignored):
    own = own_limits({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": value}, ONE_GPU)
    assert own.limits.thread_percentage == share and own.ignored.get(lim.ACTIVE_THREADS) == ignored


def test_priority_values():
    assert own_limits({"CUDA_MPS_CLIENT_PRIORITY": "1"}, ONE_GPU).priority == 1
    assert own_limits({"CUDA_MPS_CLIENT_PRIORITY": "7"}, ONE_GPU).ignored == {lim.PRIORITY: lim.OUT_OF_RANGE}
    assert own_limits({"CUDA_MPS_CLIENT_PRIORITY": "high"}, ONE_GPU).ignored == {lim.PRIORITY: lim.NOT_A_NUMBER}


def test_in_force_and_where_it_came_from():
    server, default = Limits(50.0, {0: 8 << 30}), Limits(100.0, {0: 4 << 30})
    # own pinned limit, the server's share when it connected
    f = client_limits(Limits(None, {0: G2}), server, default, at_connect=Limits(30.0, {0: 3 << 30}))
    assert f.limits == Limits(30.0, {0: G2})
    assert f.sources == {lim.PINNED_MEMORY: lim.CLIENT, lim.ACTIVE_THREADS: lim.SERVER_AT_CONNECT}
    # the smaller share wins: the client's own 20 under the server's 50 now
    f = client_limits(Limits(20.0, {}), server, default)
    assert f.limits == Limits(20.0, {0: 8 << 30})
    assert f.sources == {lim.PINNED_MEMORY: lim.SERVER_NOW, lim.ACTIVE_THREADS: lim.CLIENT}
    # no server known: the daemon default; nothing anywhere: none
    assert client_limits(Limits(), None, default).sources[lim.PINNED_MEMORY] == lim.DAEMON_DEFAULT
    assert client_limits(Limits(), None, Limits()).sources == {lim.PINNED_MEMORY: lim.NONE, lim.ACTIVE_THREADS: lim.NONE}


@pytest.mark.parametrize("answer,unit", [("1G", 1 << 30), ("2G", 1 << 30), ("1536M", 1 << 20), ("512M", 1 << 20),
                                         ("3K", 1 << 10), ("1T", 1 << 40), ("1023", 1), ("0x60000000", 1 << 20)])
def test_the_unit_an_answer_was_printed_in(answer, unit):
    from mps_exporter.units import parse_size, printed_unit
    assert printed_unit(parse_size(answer)) == unit


@pytest.mark.parametrize("logged,served", [
    (1536 << 20, 1536 << 20),  # 1536M answered `1G`: the log's bytes
    ((2 << 30) - 1, (2 << 30) - 1),  # the last byte `1G` stands for
    (1 << 30, 1 << 30),
    (2 << 30, 1 << 30),  # `1G` is no rounding of 2G: the answer
    (512 << 20, 1 << 30),
    (None, 1 << 30),  # nothing logged for this GPU
])
def test_a_servers_answered_limit_takes_the_logged_bytes_it_is_the_rounding_of(logged, served):
    logged_limits = {} if logged is None else {3: logged}
    assert lim.exact_pinned({3: 1 << 30, 5: 2 << 30}, {**logged_limits, 5: 3 << 30}) == {3: served, 5: 2 << 30}
