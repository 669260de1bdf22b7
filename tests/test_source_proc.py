"""The /proc source: cgroup shapes, the three MPS variables and nothing else,
start times, vanished processes."""

import pytest

from mps_exporter.sources import proc as procfs
from mps_exporter.runtime_metadata import MISS_RETRY_SECONDS, NO_NAMES, PodNameLookup
from tests.fakes.fake_procfs import BOOT_TIME, CLK_TCK, FakeProcess, write_proc
from tests.fakes.fake_runtime import write_containerd_spec

CID = "a" * 56 + "0123abcd"
POD = "1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718"


@pytest.mark.parametrize("text,expected", [
    # cgroup v2, systemd driver, containerd
    (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n", (CID, POD)),
    # cgroup v2, systemd driver, CRI-O
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice/crio-{CID}.scope\n", (CID, POD)),
    # cgroup v1, cgroupfs driver (containerd or CRI-O)
    (f"12:memory:/kubepods/burstable/pod{POD}/{CID}\n11:cpu,cpuacct:/kubepods/burstable/pod{POD}/{CID}\n", (CID, POD)),
    # Docker, v2 systemd and v1 cgroupfs
    (f"0::/system.slice/docker-{CID}.scope\n", (CID, "")),
    (f"4:devices:/docker/{CID}\n", (CID, "")),
    # a process on the host
    ("0::/user.slice/user-1000.slice/session-3.scope\n", ("", "")),
    ("", ("", "")),
    ("garbage without colons\n", ("", "")),
])
def test_parse_cgroup(text, expected):
    assert procfs.parse_cgroup(text) == expected


def test_parse_environ_keeps_only_the_mps_variables():
    block = (b"PATH=/bin\0CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25\0AWS_SECRET=x\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G,1=512M\0"
             b"CUDA_MPS_PIPE_DIRECTORY=/p\0CUDA_VISIBLE_DEVICES=GPU-4b5da867\0\xff\xfe=\x00")
    env = procfs.parse_environ(block)
    assert env == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G,1=512M",
                   "CUDA_VISIBLE_DEVICES": "GPU-4b5da867", "CUDA_MPS_PIPE_DIRECTORY": "/p"}


def test_a_client_s_pipe_directory_is_looked_at_through_its_own_root(tmp_path):
    """A container's /tmp/nvidia-mps is the host's daemon directory mounted there: compared
    by device and inode through /proc/PID/root (issue 38: whose unlisted client it is)."""
    pipe = tmp_path / "host" / "run" / "mps-gpu1" / "pipe"
    pipe.mkdir(parents=True)
    rootfs = tmp_path / "container"
    (rootfs / "tmp").mkdir(parents=True)
    (rootfs / "tmp" / "nvidia-mps").symlink_to(pipe)  # the pod's mount of the host directory
    root = write_proc(tmp_path / "proc", [FakeProcess(10), FakeProcess(11, environ={"CUDA_MPS_PIPE_DIRECTORY": "/p"})])
    for pid in (10, 11):
        (root / str(pid) / "root").symlink_to(rootfs)
    facts = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK).read([10, 11])
    st = pipe.stat()
    assert facts[10].mps_pipe == (st.st_dev, st.st_ino)  # unset: MPS's /tmp/nvidia-mps
    assert facts[11].mps_pipe is None  # /p is no directory in its root
    assert procfs.parse_environ(b"CUDA_VISIBLE_DEVICES=" + b"0," * 5000) == {
        "CUDA_VISIBLE_DEVICES": "0," * (procfs.MAX_ENV_VALUE // 2)}


def test_parse_stat_with_awkward_comm():
    text = "123 (my (odd) prog) S " + " ".join(["0"] * 18 + ["4242"] + ["0"] * 30)
    assert procfs.parse_stat_start_ticks(text) == 4242


def test_read_processes(tmp_path):
    root = write_proc(tmp_path / "proc", [
        FakeProcess(1589, uid=0, comm="nvidia-cuda-mps", start_ticks=500),
        FakeProcess(1647, uid=1500, start_ticks=12345,
                    cgroup=f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
                    environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25.0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G",
                             "CUDA_MPS_CLIENT_PRIORITY": "1"}),
    ])
    src = procfs.ProcClient(root=str(root), user_name=lambda uid: {0: "root"}.get(uid, str(uid)), clock_ticks=CLK_TCK)
    facts = src.read([1589, 1647, 99999])  # 99999 does not exist: skipped
    assert sorted(facts) == [1589, 1647]
    server, client = facts[1589], facts[1647]
    assert (server.uid, server.user, server.command) == (0, "root", "nvidia-cuda-mps")
    assert server.start_time_seconds == BOOT_TIME + 5.0
    assert (client.uid, client.user, client.container_id, client.pod_uid) == (1500, "1500", CID, POD)
    assert client.environ == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25.0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=2G",
                              "CUDA_MPS_CLIENT_PRIORITY": "1"}
    assert server.environ == {}
    # Nothing but the kept variables survives anywhere in the facts.
    assert "do-not-export" not in repr(facts) and "PATH" not in repr(facts)


def test_process_vanishing_mid_read_is_skipped(tmp_path):
    root = write_proc(tmp_path / "proc", [FakeProcess(10), FakeProcess(11)])
    (root / "11" / "stat").unlink()  # exited after status was read
    facts = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK).read([10, 11])
    assert list(facts) == [10]


def test_unreadable_environ_keeps_other_facts(tmp_path, monkeypatch):
    root = write_proc(tmp_path / "proc", [FakeProcess(10, environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"})])
    real_open = open

    def deny_environ(path, *a, **k):
        if str(path).endswith("/environ"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", deny_environ)
    facts = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK).read([10])
    assert facts[10].command == "python3" and facts[10].environ == {}


def test_a_known_process_costs_one_stat_of_its_directory(tmp_path):
    root = write_proc(tmp_path / "proc", [FakeProcess(10, uid=0, start_ticks=500)])
    src = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK)
    first = src.read([10])[10]
    (root / "10" / "stat").write_text("garbage")  # in place: /proc/10 is the same directory
    assert src.read([10])[10] == first  # not read again: the directory vouches for the process


def test_known_process_is_not_reread_but_a_reused_pid_is(tmp_path):
    root = write_proc(tmp_path / "proc", [FakeProcess(10, uid=0, environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"})])
    src = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK)
    assert src.read([10])[10].environ == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}
    (root / "10" / "environ").unlink()  # a second read of environ would now fail
    assert src.read([10])[10].environ == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}
    # PID 10 exits and a new process (another start time, another user) gets the PID.
    write_proc(root, [FakeProcess(10, uid=1500, start_ticks=99999)])
    again = src.read([10])[10]
    assert again.uid == 1500 and again.environ == {}


def test_cached_answers_known_processes_with_a_stat_and_declines_anything_else(tmp_path):
    root = write_proc(tmp_path / "proc", [FakeProcess(10, uid=0, environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}),
                                          FakeProcess(11, uid=0)])
    src = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK)
    assert src.cached([10]) is None  # never read: declined, nothing read
    assert src._known == {}
    read = src.read([10, 11])
    for name in ("status", "environ", "cgroup", "comm"):
        (root / "10" / name).write_text("garbage")  # in place (same directory): never read again
    assert src.cached([10, 11]) == read
    assert src.cached([10, 11, 13]) == read  # 13 is gone (or never was): skipped, as read() does
    write_proc(root, [FakeProcess(12, uid=0)])
    assert src.cached([10, 12]) is None  # 12 is new
    assert set(src._known) == {10, 11}  # a declined answer forgets nobody
    assert src.cached([10]) == {10: read[10]} and set(src._known) == {10}  # forgets as read() does
    assert src.cached([10], keep={11}) == {10: read[10]}
    write_proc(root, [FakeProcess(10, uid=1500, start_ticks=99999)])  # PID 10 reused
    assert src.cached([10]) is None
    assert src.read([10])[10].uid == 1500


def test_cached_declines_a_process_whose_container_is_not_named_yet(tmp_path):
    cgroup = f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n"
    root = write_proc(tmp_path / "proc", [FakeProcess(10, uid=0, cgroup=cgroup)])
    now = [0.0]
    lookup = PodNameLookup(roots=(str(tmp_path / "runtime"),), clock=lambda: now[0])
    src = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK, pod_names=lookup)
    assert src.read([10])[10].pod == ""  # looked for in vain: no runtime file
    assert src.cached([10]) is not None  # a recent miss needs no lookup
    now[0] += MISS_RETRY_SECONDS
    assert src.cached([10]) is None  # the next lookup is due: the source's thread does it
    write_containerd_spec(tmp_path / "runtime", CID, "ml-team", "trainer-0", "trainer")
    assert src.read([10])[10].pod == "trainer-0"
    assert src.cached([10])[10].pod == "trainer-0"
    assert lookup.known("not-a-container-id") == NO_NAMES
