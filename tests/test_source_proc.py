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
    # seen from the exporter's own cgroup namespace (cgroup v2's default for a pod)
    (f"0::/../../kubepods-besteffort-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n", (CID, POD)),
    # a node in a container (kind): the node's own container cgroup above the pod's
    (f"0::/system.slice/docker-{'b' * 64}.scope/kubelet.slice/kubelet-kubepods.slice/"
     f"kubelet-kubepods-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n", (CID, POD)),
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


class Exits:
    """The kernel's exits as the test says them: a watched PID (every PID where `watched` is
    None) is vouched for unless it exited; each exit moves the clock, as ExitWatcher's."""

    def __init__(self, watched=None) -> None:
        self.exited: set = set()
        self.watched = watched
        self.clock = 0
        self.asked: list = []  # the PIDs of each unexited_since

    def exit(self, pid: int) -> None:
        self.exited.add(pid)
        self.clock += 1

    def mark(self) -> int:
        return self.clock

    def unexited_since(self, marks):
        self.asked.append(sorted(marks))
        return {pid for pid in marks if pid not in self.exited and (self.watched is None or pid in self.watched)}

    def quiet_since(self, mark: int) -> bool:
        return self.clock == mark


def stats_of_processes(monkeypatch, root) -> list:
    """The /proc/PID directories stat()ed from now on, in order (a list the test may clear)."""
    looked = []
    real_stat = procfs.os.stat

    def stat(path, *args, **kwargs):
        if str(path).count("/") == str(root).count("/") + 1:  # a process's directory
            looked.append(str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(procfs.os, "stat", stat)
    return looked


def test_a_process_the_kernel_vouches_has_not_exited_is_not_looked_at_again(tmp_path, monkeypatch):
    root = write_proc(tmp_path / "proc", [FakeProcess(10, uid=0), FakeProcess(11, uid=0)])
    src = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK, exits=Exits())
    looked = stats_of_processes(monkeypatch, root)
    first = src.read([10, 11])
    assert sorted(looked) == [f"{root}/10", f"{root}/11"]  # new: looked at
    looked.clear()
    assert src.read([10, 11]) == first and looked == []  # vouched for: no stat()
    assert src.cached([10, 11]) == first and looked == []
    # PID 10 exits and a new process gets the PID: the kernel said so, so it is looked at
    src.exits.exit(10)
    write_proc(root, [FakeProcess(10, uid=1500, start_ticks=99999)])
    assert src.read([10, 11])[10].uid == 1500 and set(looked) == {f"{root}/10"}
    # without the kernel's word, a stat() each, as before
    src.exits = None
    looked.clear()
    assert set(src.read([10, 11])) == {10, 11} and sorted(looked) == [f"{root}/10", f"{root}/11"]


def test_the_same_pids_again_while_the_kernel_is_quiet_look_only_at_those_it_did_not_vouch_for(tmp_path, monkeypatch):
    # 12 is not watched (a server): looked at every time; 10 and 11 are not even asked about.
    root = write_proc(tmp_path / "proc", [FakeProcess(10, uid=0), FakeProcess(11, uid=0), FakeProcess(12, uid=0)])
    exits = Exits(watched={10, 11})
    src = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK, exits=exits)
    looked = stats_of_processes(monkeypatch, root)
    pids = {10, 11, 12}
    first = src.read(pids)
    assert src.read(pids) == first  # 10 and 11 vouched for from here
    looked.clear()
    exits.asked.clear()
    assert src.read(pids) == first and src.cached(pids) == first
    assert looked == [f"{root}/12"] * 2 and exits.asked == [[12], [12]]
    assert src.read({10, 11, 12}) == first and exits.asked[-1] == [10, 11, 12]  # other PIDs: all asked
    # PID 10 exits and a new process gets the PID: the clock moved, so all are asked again
    src.read(pids)
    exits.exit(10)
    write_proc(root, [FakeProcess(10, uid=1500, start_ticks=99999)])
    looked.clear()
    assert src.read(pids)[10].uid == 1500 and sorted(looked) == [f"{root}/10", f"{root}/12"]
    # 12 exits for good: gone from the answer, and from what is known
    (root / "12" / "stat").unlink()
    for name in list((root / "12").iterdir()):
        name.unlink()
    (root / "12").rmdir()
    src.read(pids)
    assert set(src.read(pids)) == {10, 11} and 12 not in src._known


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
    write_containerd_spec(tmp_path / "runtime", CID, "ml-team", "trainer-0", "trainer", POD)
    assert src.read([10])[10].pod == "trainer-0"
    assert src.cached([10])[10].pod == "trainer-0"
    assert lookup.known("not-a-container-id") == NO_NAMES


# ------------------------------------------------ attribution a tenant cannot forge (issue 42)
# The victim: containerd's fixture container (ml-team/trainer-7d9c6b5f4-x2k8p/trainer) in its pod.
# The forger: a privileged pod of another tenant on the same node, with its own container.
VICTIM_POD = "1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718"
FORGER_POD = "0a0b0c0d-1e1f-4a2b-8c3d-4e5f60718293"
FORGER_ID = "f0" * 32
VICTIM_NAMES = ("ml-team", "trainer-7d9c6b5f4-x2k8p", "trainer")
FORGER_NAMES = ("tenant-b", "miner-0", "miner")


def _slice(pod: str) -> str:
    return f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod.replace('-', '_')}.slice"


def _attributed(tmp_path, cgroup: str, forger_runtime: str = "containerd", forged=None):
    """(container_id, pod_uid, namespace, pod, container) the /proc source gives PID 20, whose
    cgroup is `cgroup`, and the victim's PID 10 beside it, on a node whose containerd root
    holds the victim's spec and whose `forger_runtime` root holds the forger's (with the
    `forged` annotations added: a pod's own, which CRI-O copies into the spec)."""
    import shutil
    from tests.fakes.fake_runtime import CONTAINERD_ID, CONTAINERD_ROOT, write_crio_spec
    containerd, crio = tmp_path / "containerd", tmp_path / "crio"
    shutil.copytree(CONTAINERD_ROOT, containerd)
    if forger_runtime == "containerd":
        write_containerd_spec(containerd, FORGER_ID, *FORGER_NAMES, FORGER_POD)
    else:
        write_crio_spec(crio, FORGER_ID, dict(zip(
            ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.container.name",
             "io.kubernetes.pod.uid"), (*FORGER_NAMES, FORGER_POD))) | (forged or {}))
    victim = f"0::{_slice(VICTIM_POD)}/cri-containerd-{CONTAINERD_ID}.scope\n"
    root = write_proc(tmp_path / "proc", [FakeProcess(10, cgroup=victim), FakeProcess(20, cgroup=cgroup)])
    lookup = PodNameLookup(roots=(str(containerd), str(crio)))
    facts = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK, pod_names=lookup).read([10, 20])
    assert (facts[10].container_id, facts[10].pod_uid, facts[10].namespace, facts[10].pod, facts[10].container) == (
        CONTAINERD_ID, VICTIM_POD, *VICTIM_NAMES)  # the victim keeps its own
    f = facts[20]
    return f.container_id, f.pod_uid, f.namespace, f.pod, f.container


OWN = (FORGER_ID, FORGER_POD, *FORGER_NAMES)


@pytest.mark.parametrize("below", [
    "{victim}",  # a bare 64-hex sub-cgroup (the cgroupfs driver's shape)
    "cri-containerd-{victim}.scope",  # the systemd driver's shape
    "x/y/cri-containerd-{victim}.scope",  # deeper
    f"kubepods-pod{VICTIM_POD.replace('-', '_')}.slice/cri-containerd-{{victim}}.scope",  # with the victim's pod too
])
def test_a_sub_cgroup_named_after_another_container_claims_nothing(tmp_path, below):
    """A privileged pod with a writable cgroupfs makes a cgroup below its own container's,
    named after the victim's container, and moves its process there: the id is taken right
    below the pod's segment, where the runtime writes it, so the forger keeps its own."""
    from tests.fakes.fake_runtime import CONTAINERD_ID
    cgroup = f"0::{_slice(FORGER_POD)}/cri-containerd-{FORGER_ID}.scope/" + below.format(victim=CONTAINERD_ID) + "\n"
    assert _attributed(tmp_path, cgroup) == OWN


def test_a_sub_cgroup_under_a_crio_container_claims_nothing(tmp_path):
    from tests.fakes.fake_runtime import CONTAINERD_ID
    cgroup = f"0::{_slice(FORGER_POD)}/crio-{FORGER_ID}.scope/crio-{CONTAINERD_ID}.scope\n"
    assert _attributed(tmp_path, cgroup, forger_runtime="cri-o") == OWN


def test_a_sub_cgroup_under_the_cgroupfs_driver_claims_nothing(tmp_path):
    from tests.fakes.fake_runtime import CONTAINERD_ID
    cgroup = "".join(f"{n}:{c}:/kubepods/burstable/pod{FORGER_POD}/{FORGER_ID}/{CONTAINERD_ID}\n"
                     for n, c in ((12, "memory"), (11, "cpu,cpuacct"), (3, "devices")))
    assert _attributed(tmp_path, cgroup) == OWN


def test_a_cgroup_in_its_own_pod_named_after_another_container_claims_nothing(tmp_path):
    """A sibling of its own container's cgroup, named after the victim's: the runtime puts
    that container in another pod than the cgroup's, so the forger gets no container."""
    from tests.fakes.fake_runtime import CONTAINERD_ID
    for cgroup in (f"0::{_slice(FORGER_POD)}/cri-containerd-{CONTAINERD_ID}.scope\n",
                   f"4:memory:/kubepods/burstable/pod{FORGER_POD}/{CONTAINERD_ID}\n"):
        assert _attributed(tmp_path / str(len(cgroup)), cgroup) == ("", FORGER_POD, "", "", "")


def test_v1_hierarchies_that_name_different_containers_name_none():
    from tests.fakes.fake_runtime import CONTAINERD_ID
    text = (f"12:memory:/kubepods/burstable/pod{FORGER_POD}/{FORGER_ID}\n"
            f"11:devices:/kubepods/burstable/pod{VICTIM_POD}/{CONTAINERD_ID}\n")
    assert procfs.parse_cgroup(text) == ("", "")


def test_containerd_annotation_keys_in_a_crio_spec_name_nothing(tmp_path):
    """CRI-O copies a pod's own annotations into its containers' specs: a tenant who
    annotates its pod with containerd's keys and the victim's names keeps its own names."""
    cgroup = f"0::{_slice(FORGER_POD)}/crio-{FORGER_ID}.scope\n"
    forged = dict(zip(("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name",
                       "io.kubernetes.cri.container-name", "io.kubernetes.cri.sandbox-uid"),
                      (*VICTIM_NAMES, VICTIM_POD)))
    assert _attributed(tmp_path, cgroup, forger_runtime="cri-o", forged=forged) == OWN


def test_a_crio_spec_with_only_containerd_keys_names_nothing(tmp_path):
    """The tenant's keys alone (CRI-O's own removed) are never read from a CRI-O root."""
    import json
    from tests.fakes.fake_runtime import write_crio_spec
    path = write_crio_spec(tmp_path / "crio", FORGER_ID, {
        "io.kubernetes.cri.sandbox-namespace": VICTIM_NAMES[0], "io.kubernetes.cri.sandbox-name": VICTIM_NAMES[1],
        "io.kubernetes.cri.container-name": VICTIM_NAMES[2], "io.kubernetes.cri.sandbox-uid": VICTIM_POD})
    spec = json.loads(path.read_text())
    for key in ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.container.name"):
        del spec["annotations"][key]
    path.write_text(json.dumps(spec))
    assert PodNameLookup(roots=(str(tmp_path / "crio"),)).names(FORGER_ID) == NO_NAMES


def test_crio_keys_in_a_containerd_spec_name_nothing(tmp_path):
    """The other way round: containerd passes allowed pod annotations into its specs."""
    import json
    path = write_containerd_spec(tmp_path / "containerd", FORGER_ID, *FORGER_NAMES, FORGER_POD)
    spec = json.loads(path.read_text())
    spec["annotations"].update({"io.kubernetes.pod.namespace": VICTIM_NAMES[0],
                                "io.kubernetes.pod.name": VICTIM_NAMES[1],
                                "io.kubernetes.container.name": VICTIM_NAMES[2], "io.kubernetes.pod.uid": VICTIM_POD})
    path.write_text(json.dumps(spec))
    names = PodNameLookup(roots=(str(tmp_path / "containerd"),)).names(FORGER_ID)
    assert (names.namespace, names.pod, names.container, names.pod_uid) == (*FORGER_NAMES, FORGER_POD)
    for key in ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name"):
        del spec["annotations"][key]
    path.write_text(json.dumps(spec))
    assert PodNameLookup(roots=(str(tmp_path / "containerd"),)).names(FORGER_ID) == NO_NAMES


def test_a_root_is_read_in_one_runtime_s_layout_only(tmp_path):
    """A root where containerd's layout was found is containerd's: a CRI-O-layout spec
    there is not read (nor the other way round)."""
    from tests.fakes.fake_runtime import write_crio_spec
    root = tmp_path / "containerd"
    write_containerd_spec(root, FORGER_ID, *FORGER_NAMES, FORGER_POD)
    other = "e1" * 32
    write_crio_spec(root, other, {"io.kubernetes.pod.uid": VICTIM_POD})
    lookup = PodNameLookup(roots=(str(root),))
    assert lookup.names(FORGER_ID).pod == FORGER_NAMES[1]
    assert lookup.names(other) == NO_NAMES


def test_a_crio_spec_recording_another_container_id_names_nothing(tmp_path):
    from tests.fakes.fake_runtime import write_crio_spec
    path = write_crio_spec(tmp_path / "crio", FORGER_ID, {"io.kubernetes.cri-o.ContainerID": "ab" * 32})
    assert path.exists()
    assert PodNameLookup(roots=(str(tmp_path / "crio"),)).names(FORGER_ID) == NO_NAMES


def test_the_kubelet_s_pod_must_be_the_cgroup_s_too(tmp_path):
    """Names from the kubelet are confirmed the same way: its pod uid for the container."""
    from tests.fakes.fake_runtime import CONTAINERD_ID, RUNTIME_DATA
    pods = (RUNTIME_DATA / "kubelet-pods.json").read_text()
    root = write_proc(tmp_path / "proc", [
        FakeProcess(10, cgroup=f"0::{_slice(VICTIM_POD)}/cri-containerd-{CONTAINERD_ID}.scope\n"),
        FakeProcess(20, cgroup=f"0::{_slice(FORGER_POD)}/cri-containerd-{CONTAINERD_ID}.scope\n")])
    lookup = PodNameLookup(roots=(), kubelet=lambda: pods)
    facts = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK, pod_names=lookup).read([10, 20])
    assert (facts[10].container_id, facts[10].namespace, facts[10].pod) == (CONTAINERD_ID, *VICTIM_NAMES[:2])
    assert (facts[20].container_id, facts[20].pod_uid, facts[20].namespace, facts[20].pod) == (
        "", FORGER_POD, "", "")
