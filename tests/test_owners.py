"""Owners outside Kubernetes (issue 41): plain Docker containers and ECS tasks from Docker's
own state files, Slurm jobs from slurmstepd's cgroups; each in the namespace/pod/container
columns with `owner` saying whose, and none of them claimable by a tenant's cgroup."""

import shutil

import pytest

from mps_exporter import runtime_metadata as rm
from mps_exporter.runtime_metadata import PodNameLookup
from mps_exporter.sources import proc as procfs
from tests.fakes.fake_procfs import CLK_TCK, FakeProcess, write_proc
from tests.fakes.fake_runtime import (DOCKER_ID, DOCKER_INIT, DOCKER_ROOT, ECS_ID, ECS_INIT, ECS_TASK, SLURM_CGROUPS,
                                      write_docker_config)
from tests.support import scenarios

# (namespace, pod, container, pod_uid, owner) of the fixtures' containers
DOCKER_NAMES = ("docker", "trainer", "trainer", DOCKER_ID, "docker")
ECS_NAMES = ("gpu-cluster", ECS_TASK, "trainer", ECS_TASK, "ecs")
NOTHING = ("", "", "", "", "")
USER_SLICE = "/user.slice/user-1000.slice/user@1000.service/app.slice"  # a user's own systemd manager may make cgroups here


def _v2(container_id: str, parent: str = "/system.slice") -> str:
    return f"0::{parent}/docker-{container_id}.scope\n"


def _v1(container_id: str, parent: str = "/docker") -> str:
    return "".join(f"{n}:{c}:{parent}/{container_id}\n" for n, c in ((12, "memory"), (11, "cpu,cpuacct"), (4, "devices"),
                                                                       (1, "name=systemd")))


# ------------------------------------------------------------------ the parser
def test_docker_config_names_a_plain_container_and_its_init():
    names = rm.parse_docker_config((DOCKER_ROOT / DOCKER_ID / "config.v2.json").read_text(), DOCKER_ID)
    assert (names.namespace, names.pod, names.container, names.pod_uid, names.owner) == DOCKER_NAMES
    assert names.init_pid == DOCKER_INIT


def test_docker_config_of_an_ecs_task_names_cluster_task_and_container():
    names = rm.parse_docker_config((DOCKER_ROOT / ECS_ID / "config.v2.json").read_text(), ECS_ID)
    assert (names.namespace, names.pod, names.container, names.pod_uid, names.owner) == ECS_NAMES
    assert names.init_pid == ECS_INIT


@pytest.mark.parametrize("arn,cluster,task", [
    ("arn:aws:ecs:us-east-1:123456789012:task/3b9f1d2c-6a4e-4c1b-9f8e-7d6c5b4a3f21",  # the old ARN format
     "default", "3b9f1d2c-6a4e-4c1b-9f8e-7d6c5b4a3f21"),
    (f"arn:aws:ecs:us-west-2:123456789012:task/gpu-cluster/{ECS_TASK}",
     "arn:aws:ecs:us-west-2:123456789012:cluster/gpu-cluster", ECS_TASK),  # ECS_CLUSTER given as an ARN
])
def test_ecs_task_arn_formats(tmp_path, arn, cluster, task):
    path = write_docker_config(tmp_path, ECS_ID, pid=7, like=ECS_ID,
                               labels={rm.ECS_TASK_ARN: arn, rm.ECS_CLUSTER: cluster})
    names = rm.parse_docker_config(path.read_text(), ECS_ID)
    assert (names.namespace, names.pod, names.pod_uid) == (cluster.rpartition("cluster/")[2], task, task)


def test_a_stopped_container_or_one_recording_another_id_names_nothing(tmp_path):
    stopped = write_docker_config(tmp_path, DOCKER_ID, running=False)
    assert rm.parse_docker_config(stopped.read_text(), DOCKER_ID) == rm.NO_NAMES
    assert rm.parse_docker_config((DOCKER_ROOT / DOCKER_ID / "config.v2.json").read_text(), "ab" * 32) == rm.NO_NAMES


@pytest.mark.parametrize("text", ["[]", "{", '"x"'])
def test_a_docker_config_that_is_not_one_is_an_error(text):
    with pytest.raises(ValueError):
        rm.parse_docker_config(text)


def test_cri_dockerd_containers_are_kubernetes_names_confirmed_by_pod_uid(tmp_path):
    pod_uid = "1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718"
    path = write_docker_config(tmp_path, DOCKER_ID, pid=9, labels={
        "io.kubernetes.pod.namespace": "ml-team", "io.kubernetes.pod.name": "trainer-0",
        "io.kubernetes.container.name": "trainer", "io.kubernetes.pod.uid": pod_uid})
    names = rm.parse_docker_config(path.read_text(), DOCKER_ID)
    assert (names.namespace, names.pod, names.container, names.owner) == ("ml-team", "trainer-0", "trainer", "kubernetes")
    assert names.confirms(pod_uid) and not names.confirms("")


@pytest.mark.parametrize("fixture,expected", [
    ("v2-jobid.cgroup", ("4242", "0")),
    ("v2-sluid.cgroup", ("sEKNKTV3WPV500", "batch")),  # Slurm 26.05's default job directory
    ("v1-jobid.cgroup", ("4242", "0")),
])
def test_slurm_cgroups_name_job_and_step(fixture, expected):
    text = (SLURM_CGROUPS / fixture).read_text()
    assert procfs.parse_slurm_cgroup(text) == expected
    assert procfs.parse_cgroup(text) == ("", "")  # no container


@pytest.mark.parametrize("path,expected", [
    ("/system.slice/node7_slurmstepd.scope/job_17/step_extern/slurm", ("17", "extern")),  # several slurmd per host
    ("/../../system.slice/slurmstepd.scope/job_17/step_interactive/user/task_0", ("17", "interactive")),  # own cgroupns
    ("/system.slice/slurmstepd.scope/job_17", ("17", "")),
    ("/slurm_node7/uid_0/job_17/step_batch", ("17", "batch")),
    ("/system.slice/slurmstepd.scope/system", ("", "")),  # slurmstepd's own
    ("/system.slice/slurmd.service", ("", "")),
    ("/system.slice/slurmstepd.scope/slowercase000/step_0", ("", "")),
])
def test_slurm_cgroup_paths(path, expected):
    assert procfs.parse_slurm_cgroup(f"0::{path}\n") == expected


# ------------------------------------------------------------------ through /proc
def _attributed(tmp_path, cgroup: str, extra=(), docker_root=DOCKER_ROOT):
    """(namespace, pod, container, pod_uid, owner) the /proc source gives PID 20 (cgroup
    `cgroup`), beside the Docker fixture containers' inits (in their own cgroups, v2 systemd
    driver) and whatever `extra` processes."""
    processes = [FakeProcess(DOCKER_INIT, cgroup=_v2(DOCKER_ID)),
                 FakeProcess(ECS_INIT, cgroup=_v2(ECS_ID, f"/ecstasks.slice/ecstasks-{ECS_TASK}.slice")),
                 FakeProcess(20, cgroup=cgroup), *extra]
    root = write_proc(tmp_path / "proc", processes)
    lookup = PodNameLookup(roots=(str(docker_root),))
    f = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK, pod_names=lookup).read([20])[20]
    return f.namespace, f.pod, f.container, f.pod_uid, f.owner


def test_a_docker_client_is_named_by_its_container(tmp_path):
    """cgroup v2, the systemd driver (`docker-<id>.scope` in system.slice)."""
    assert _attributed(tmp_path, _v2(DOCKER_ID)) == DOCKER_NAMES


def test_a_docker_client_under_the_cgroupfs_driver(tmp_path):
    """cgroup v1 (Amazon Linux 2's ECS AMI), `/docker/<id>` in every hierarchy, init likewise."""
    init = FakeProcess(DOCKER_INIT, cgroup=_v1(DOCKER_ID))
    assert _attributed(tmp_path, _v1(DOCKER_ID), extra=[init]) == DOCKER_NAMES


def test_a_process_in_a_sub_cgroup_of_its_container_keeps_its_container(tmp_path):
    """Docker-in-Docker, systemd in a container: below the container's cgroup is still its own."""
    assert _attributed(tmp_path, f"0::/system.slice/docker-{DOCKER_ID}.scope/init.scope\n") == DOCKER_NAMES


@pytest.mark.parametrize("cgroup", [
    _v2(ECS_ID, f"/ecstasks.slice/ecstasks-{ECS_TASK}.slice"),  # Amazon Linux 2023, cgroup v2
])
def test_an_ecs_client_is_named_by_its_task(tmp_path, cgroup):
    assert _attributed(tmp_path, cgroup) == ECS_NAMES


def test_an_ecs_client_under_cgroup_v1_task_cgroups(tmp_path):
    """Amazon Linux 2: the agent's task cgroup `/ecs/<task>/<container id>` (cgroupfs)."""
    cgroup = _v1(ECS_ID, f"/ecs/{ECS_TASK}")
    init = FakeProcess(ECS_INIT, cgroup=cgroup)
    assert _attributed(tmp_path, cgroup, extra=[init]) == ECS_NAMES


@pytest.mark.parametrize("fixture,expected", [
    ("v2-jobid.cgroup", ("slurm", "4242", "0", "4242", "slurm")),
    ("v2-sluid.cgroup", ("slurm", "sEKNKTV3WPV500", "batch", "sEKNKTV3WPV500", "slurm")),
    ("v1-jobid.cgroup", ("slurm", "4242", "0", "4242", "slurm")),
])
def test_a_slurm_client_is_named_by_its_job_and_step(tmp_path, fixture, expected):
    assert _attributed(tmp_path, (SLURM_CGROUPS / fixture).read_text()) == expected


# ------------------------------------------------ forgeries: a tenant names a cgroup after a victim
@pytest.mark.parametrize("cgroup", [
    _v2(DOCKER_ID, USER_SLICE),  # `systemd-run --user --scope --unit=docker-<victim>`
    _v2(DOCKER_ID, "/system.slice/docker-" + "f0" * 32 + ".scope/x"),  # below another container: see below
    _v1(DOCKER_ID, "/user/docker"),
    f"0::/system.slice/docker-{DOCKER_ID}.scope\n1:name=systemd:/user.slice/docker-{DOCKER_ID}.scope\n",
])
def test_a_cgroup_named_after_a_victim_docker_container_gets_nothing(tmp_path, cgroup):
    """The victim's container is where Docker's recorded init is: any other cgroup with its
    id gets no names (and no container id), however it is shaped."""
    got = _attributed(tmp_path, cgroup)
    assert got[:3] != DOCKER_NAMES[:3] and got[4] != "docker"


@pytest.mark.parametrize("below", ["docker-{victim}.scope", "{victim}", "x/docker-{victim}.scope"])
def test_a_sub_cgroup_of_the_tenant_s_own_container_keeps_the_tenant_s_names(tmp_path, below):
    forger = "f0" * 32
    docker = tmp_path / "docker"
    shutil.copytree(DOCKER_ROOT, docker)
    write_docker_config(docker, forger, name="/miner", pid=777)
    cgroup = f"0::/system.slice/docker-{forger}.scope/" + below.format(victim=DOCKER_ID) + "\n"
    init = FakeProcess(777, cgroup=_v2(forger))
    assert _attributed(tmp_path, cgroup, extra=[init], docker_root=docker) == ("docker", "miner", "miner", forger, "docker")


def test_a_cgroup_named_after_a_victim_ecs_task_container_gets_nothing(tmp_path):
    assert _attributed(tmp_path, _v2(ECS_ID, USER_SLICE + f"/ecstasks-{ECS_TASK}.slice")) == NOTHING


def test_a_forged_ecs_label_is_overwritten_by_the_agent():
    """A task definition's dockerLabels may name another task: the agent writes its own
    labels last (the fixture's config.v2.json is what Docker keeps), so what the exporter
    reads is the agent's. Here: the fixture's labels are the agent's."""
    names = rm.parse_docker_config((DOCKER_ROOT / ECS_ID / "config.v2.json").read_text(), ECS_ID)
    assert names.pod == ECS_TASK


@pytest.mark.parametrize("path", [
    f"{USER_SLICE}/slurmstepd.scope/job_4242/step_0",  # `systemd-run --user --scope --unit=slurmstepd`
    f"{USER_SLICE}/system.slice/slurmstepd.scope/job_4242/step_0",
    "/user.slice/slurm/uid_1000/job_4242/step_0",  # v1 shape, not at the root
    "/system.slice/docker-" + "f0" * 32 + ".scope/system.slice/slurmstepd.scope/job_4242/step_0",
])
def test_a_cgroup_named_after_a_victim_slurm_job_gets_nothing(tmp_path, path):
    got = _attributed(tmp_path, f"0::{path}\n")
    assert got[4] != "slurm" and "4242" not in got


def test_a_job_s_own_subtree_naming_another_job_keeps_its_own_job(tmp_path):
    """cgroup/v2 gives the job's user a subtree (`.../step_0/user/`): what it makes there is
    never read."""
    path = "/system.slice/slurmstepd.scope/job_99/step_0/user/task_0/job_4242/step_0"
    assert _attributed(tmp_path, f"0::{path}\n") == ("slurm", "99", "0", "99", "slurm")


def test_a_restarted_container_is_proven_by_its_new_init(tmp_path):
    """`docker restart` keeps the id and starts a new init: the cached proof fails once, the
    state is read again, and the new init proves it."""
    docker = tmp_path / "docker"
    write_docker_config(docker, DOCKER_ID, pid=DOCKER_INIT)
    root = write_proc(tmp_path / "proc", [FakeProcess(DOCKER_INIT, cgroup=_v2(DOCKER_ID)),
                                          FakeProcess(20, cgroup=_v2(DOCKER_ID))])
    lookup = PodNameLookup(roots=(str(docker),))
    src = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK, pod_names=lookup)
    assert src.read([20])[20].container == "trainer"
    write_docker_config(docker, DOCKER_ID, pid=600)  # restarted: PID 41876 is now someone else's
    write_proc(root, [FakeProcess(DOCKER_INIT, cgroup="0::/user.slice/user-1000.slice/session-2.scope\n"),
                      FakeProcess(600, cgroup=_v2(DOCKER_ID)), FakeProcess(21, cgroup=_v2(DOCKER_ID))])
    assert (src.read([21])[21].container, src.read([21])[21].owner) == ("trainer", "docker")


def test_a_docker_name_is_proven_on_the_source_s_thread_not_the_quick_path(tmp_path):
    """The quick path (cached) reads no init's cgroup: where names wait for their proof it
    declines, the source's thread proves them once, and the quick path answers after."""
    from mps_exporter.runtime_metadata import MISS_RETRY_SECONDS
    docker, now = tmp_path / "docker", [0.0]
    root = write_proc(tmp_path / "proc", [FakeProcess(DOCKER_INIT, cgroup=_v2(DOCKER_ID)),
                                          FakeProcess(20, cgroup=_v2(DOCKER_ID))])
    lookup = PodNameLookup(roots=(str(docker),), clock=lambda: now[0])
    src = procfs.ProcClient(root=str(root), clock_ticks=CLK_TCK, pod_names=lookup)
    assert src.read([20])[20].owner == ""  # Docker's state not there yet
    write_docker_config(docker, DOCKER_ID, pid=DOCKER_INIT)
    now[0] += MISS_RETRY_SECONDS
    lookup.names(DOCKER_ID)  # another process of the container looked it up
    assert src.cached([20]) is None
    assert src.read([20])[20].container == "trainer"
    assert src.cached([20])[20].owner == "docker"
    assert src.renamed == 1  # named in place once: the source's reading is a new mapping then


def test_the_proc_reading_is_the_very_last_mapping_while_equal_and_a_new_one_after_a_naming(tmp_path):
    # The join knows a client's facts unchanged by the mapping's identity (join._clients_inputs);
    # a process named in place (ProcClient.renamed) must come in a new one.
    from mps_exporter.model import DaemonReading, PsEntry, ServerFacts, Snapshot

    docker, now = tmp_path / "docker", [0.0]
    root = write_proc(tmp_path / "proc", [FakeProcess(DOCKER_INIT, cgroup=_v2(DOCKER_ID)),
                                          FakeProcess(20, cgroup=_v2(DOCKER_ID)), FakeProcess(30)])
    cfg = scenarios.Config(procfs=str(root), runtime_roots=(str(docker),))
    reader = procfs.SOURCE.build(cfg, None)
    reader.source.pod_names.clock = lambda: now[0]
    snap = Snapshot(now=0.0, daemons=[DaemonReading("d", True, "/p", "/l", servers=[ServerFacts(30, "ACTIVE")],
                                                    clients=[PsEntry(20, 1, 30, "GPU-0", "4026531836", "python3")])])

    class Context:  # what the collector gives a read: the readings known, waited for
        def known(self, names):
            return snap

        wait = known

    first = reader.read(Context())
    assert set(first) == {20, 30} and first[20].owner == ""
    assert reader.read(Context()) is first
    write_docker_config(docker, DOCKER_ID, pid=DOCKER_INIT)
    now[0] += rm.MISS_RETRY_SECONDS
    named = reader.read(Context())
    assert named is not first and named[20].owner == "docker"
    assert reader.read(Context()) is named


# ------------------------------------------------------------------ on the series
def test_owners_reach_every_client_series_and_mps_client_info(tmp_path):
    """The busy scenario's three clients as a Docker container's, an ECS task's and a Slurm
    job's: their names on every client series, `owner` on mps_client_info."""
    scen = scenarios.busy(tmp_path, logs=False)
    scen.cfg.runtime_roots = (str(DOCKER_ROOT),)
    write_proc(scen.proc_root, [
        FakeProcess(DOCKER_INIT, cgroup=_v2(DOCKER_ID)),
        FakeProcess(ECS_INIT, cgroup=_v1(ECS_ID, f"/ecs/{ECS_TASK}")),
        FakeProcess(1647, uid=0, start_ticks=2000, cgroup=_v2(DOCKER_ID)),
        FakeProcess(1648, uid=0, start_ticks=2001, cgroup=_v1(ECS_ID, f"/ecs/{ECS_TASK}")),
        FakeProcess(1649, uid=0, start_ticks=2002, cgroup=(SLURM_CGROUPS / "v2-sluid.cgroup").read_text()),
    ])
    families = list(scen.collector().collect())
    by_pid = {}
    for f in families:
        for s in f.samples:
            if f.name.startswith("mps_client_") and "pid" in s.labels:
                by_pid.setdefault(s.labels["pid"], set()).add((s.labels["namespace"], s.labels["pod"],
                                                               s.labels["container"]))
    assert by_pid["1647"] == {("docker", "trainer", "trainer")}
    assert by_pid["1648"] == {("gpu-cluster", ECS_TASK, "trainer")}
    assert by_pid["1649"] == {("slurm", "sEKNKTV3WPV500", "batch")}
    info = {s.labels["pid"]: (s.labels["owner"], s.labels["pod_uid"]) for f in families for s in f.samples
            if f.name == "mps_client_info"}
    assert info == {"1647": ("docker", DOCKER_ID), "1648": ("ecs", ECS_TASK), "1649": ("slurm", "sEKNKTV3WPV500")}


def test_pod_granularity_groups_by_ecs_task_and_slurm_job(tmp_path):
    scen = scenarios.busy(tmp_path, logs=False)
    scen.cfg.runtime_roots = (str(DOCKER_ROOT),)
    scen.cfg.client_granularity = "pod"
    write_proc(scen.proc_root, [
        FakeProcess(ECS_INIT, cgroup=_v2(ECS_ID, f"/ecstasks.slice/ecstasks-{ECS_TASK}.slice")),
        FakeProcess(1647, uid=0, start_ticks=2000, cgroup=(SLURM_CGROUPS / "v2-jobid.cgroup").read_text()),
        FakeProcess(1648, uid=0, start_ticks=2001, cgroup=_v2(ECS_ID, f"/ecstasks.slice/ecstasks-{ECS_TASK}.slice")),
        FakeProcess(1649, uid=0, start_ticks=2002, cgroup=(SLURM_CGROUPS / "v1-jobid.cgroup").read_text()),
    ])
    families = list(scen.collector().collect())
    pods = {(s.labels["pod_uid"], s.labels["namespace"], s.labels["pod"]): s.value for f in families
            for s in f.samples if f.name == "mps_pod_clients"}
    assert pods == {("4242", "slurm", "4242"): 2, (ECS_TASK, "gpu-cluster", ECS_TASK): 1}
