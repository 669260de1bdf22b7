"""Namespace, pod and container names of a container id, from the node itself.

The /proc source reads each client's container id from its cgroup; this module
turns it into the names Kubernetes users know, without the Kubernetes API:

1. the container runtime's own files: each container's OCI bundle (`config.json`)
   carries the names as annotations. containerd's CRI plugin writes
   `io.kubernetes.cri.sandbox-namespace`, `...sandbox-name`, `...container-name`
   into `/run/containerd/io.containerd.runtime.v2.task/k8s.io/<id>/config.json`;
   CRI-O writes `io.kubernetes.pod.namespace`, `io.kubernetes.pod.name`,
   `io.kubernetes.container.name` into
   `/run/containers/storage/overlay-containers/<id>/userdata/config.json`. No
   network, no credentials: a read-only mount of those directories. A spec is read
   only in the format of the runtime whose root it lies in (a root is one runtime's:
   its layout says which): CRI-O copies a pod's own annotations into its specs, so a
   tenant's `io.kubernetes.cri.*` annotation there names nothing.
2. the kubelet's `/pods` (its PodList as JSON, each container status with
   `containerID: "<runtime>://<id>"`), where those files are not visible. It needs
   the service account's token and the `nodes/pods` permission (kubelets with
   fine-grained authorization; older ones ask for `nodes/proxy`, which the chart
   never grants by default). Asked at most once per KUBELET_MIN_INTERVAL, and only
   when a container id is not known yet.

Why not the Kubernetes API's pod watch: every node's exporter would hold a watch
on the API server (load from every node), and it would need read access to every
pod of the cluster. The node already knows its own containers.

3. Docker's own state, outside Kubernetes: `/var/lib/docker/containers/<id>/config.v2.json`
   (`ID`, `Name`, `Config.Labels`, `State.Pid`), read-only, no socket. A plain Docker
   container is named by its Docker name; an Amazon ECS task's container by the labels the
   ECS agent writes last, over any of the task definition's (`com.amazonaws.ecs.cluster`,
   `...task-arn`, `...container-name`). Such names go to a process only where its
   container cgroup is the one the daemon's recorded init process (`State.Pid`) is in
   (proc.py checks): a cgroup a tenant names after another container is not that one.
   A cri-dockerd pod's container (its `io.kubernetes.*` labels) is confirmed by pod uid
   like containerd's and CRI-O's.

Names are cached per container id (a container's names never change), up to
MAX_ENTRIES ids, least recently used first out. An id found nowhere is asked again
after MISS_RETRY_SECONDS (the kubelet reports a new container a few seconds late).
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Set, Tuple, TypeVar

from .config import DEFAULT_RUNTIME_ROOTS, SERVICE_ACCOUNT
from .contract import CUT, FIXED, INPUT, Label

log = logging.getLogger(__name__)
V = TypeVar("V")


# Who runs a client: ProcessFacts.owner, the `owner` label of mps_client_info ("": nobody
# the exporter can name). Slurm's jobs are read from the cgroup path alone (sources/proc.py).
KUBERNETES, ECS, DOCKER, SLURM = "kubernetes", "ecs", "docker", "slurm"
OWNERS = (KUBERNETES, ECS, DOCKER, SLURM)
# The names' columns, on every client series (docs/labels.md#owners says what each owner puts there).
NAMES_SOURCE = ("annotations of the container runtime's OCI spec (containerd, CRI-O), else the kubelet's /pods; "
                "Docker's config.v2.json (Docker, ECS); the Slurm job's cgroup")
NAMESPACE = Label("namespace", INPUT, NAMES_SOURCE, f"one per running client's pod or ECS cluster, `docker`, `slurm` "
                  f"(empty for no owner); {CUT}")
POD = Label("pod", INPUT, NAMES_SOURCE, f"one per running client's pod, ECS task, Docker container or Slurm job "
            f"(empty for no owner); {CUT}")
CONTAINER = Label("container", INPUT, NAMES_SOURCE, f"one per running client's container or Slurm step (empty for no "
                  f"owner); {CUT}")
OWNER = Label("owner", FIXED, "who names the client's namespace, pod and container: the container runtime's files, "
              "the kubelet, Docker's state, Slurm's cgroup (docs/labels.md#owners)", ", ".join(OWNERS) + " or empty")


@dataclass(frozen=True)
class PodNames:
    """A container's names in the namespace/pod/container columns: Kubernetes' own; an ECS
    task's cluster, task id and container name; `docker` and a Docker container's name."""

    namespace: str = ""
    pod: str = ""
    container: str = ""
    # The pod the runtime (or the kubelet) puts the container in: what the cgroup's pod
    # uid must equal for these names to be a process's (`confirms`); an ECS task's id,
    # which becomes the process's pod_uid. Not compared: the names are the value.
    pod_uid: str = field(default="", compare=False)
    owner: str = field(default="", compare=False)
    # Docker and ECS: the host PID the Docker daemon records for the container's init
    # (`State.Pid`), whose container cgroup the process's must be (proc.py checks).
    init_pid: int = field(default=0, compare=False)

    def confirms(self, pod_uid: str) -> bool:
        """Whether these names may go to a process whose cgroup says `pod_uid`: in the pod
        the runtime says (Kubernetes); in no pod (Docker, ECS: the init's cgroup decides)."""
        if self.owner in (DOCKER, ECS):
            return not pod_uid and self.init_pid > 0
        return bool(self.pod_uid) and self.pod_uid == pod_uid


NO_NAMES = PodNames()

# (namespace, pod, container) annotation keys of each runtime's OCI spec.
CONTAINERD_KEYS = ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name",
                   "io.kubernetes.cri.container-name")
CRIO_KEYS = ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.container.name")
# The labels the ECS agent sets on every task container, after the task definition's own
# dockerLabels, so that they win over any of the same name (amazon-ecs-agent,
# agent/engine/docker_task_engine.go createContainer).
ECS_CLUSTER, ECS_TASK_ARN, ECS_CONTAINER = ("com.amazonaws.ecs.cluster", "com.amazonaws.ecs.task-arn",
                                            "com.amazonaws.ecs.container-name")


@dataclass(frozen=True)
class Runtime:
    """One runtime's layout and annotation format."""

    name: str
    spec: str  # the spec's path inside `<root>/<id>/`
    keys: Tuple[str, str, str]  # namespace, pod, container
    pod_uid_key: str
    id_key: str = ""  # where the spec records its own container id ("": nowhere)
    docker: bool = False  # Docker's config.v2.json (its labels in `keys`), not an OCI spec


CONTAINERD = Runtime("containerd", "config.json", CONTAINERD_KEYS, "io.kubernetes.cri.sandbox-uid")
CRIO = Runtime("cri-o", "userdata/config.json", CRIO_KEYS, "io.kubernetes.pod.uid", "io.kubernetes.cri-o.ContainerID")
# cri-dockerd (and dockershim before it) label a pod's containers as the kubelet names them.
DOCKER_RUNTIME = Runtime("docker", "config.v2.json", CRIO_KEYS, "io.kubernetes.pod.uid", docker=True)
RUNTIMES = (CONTAINERD, CRIO, DOCKER_RUNTIME)
# The default roots' runtimes (config.DEFAULT_RUNTIME_ROOTS); another root is the runtime
# whose layout is found there first.
DEFAULT_ROOT_RUNTIMES = dict(zip(DEFAULT_RUNTIME_ROOTS, RUNTIMES))

SPEC_FILES = tuple(r.spec for r in RUNTIMES)  # containerd, CRI-O, Docker

MAX_ENTRIES = 4096  # container ids remembered: 8 GPUs x 48 clients is 384 at most at once
MISS_RETRY_SECONDS = 30.0
KUBELET_MIN_INTERVAL = 30.0
KUBELET_TIMEOUT = 5.0
MAX_SPEC_BYTES = 4 << 20  # an OCI spec is tens of KB; more is not one
MAX_PODS_BYTES = 64 << 20  # the kubelet's PodList of a full node (110 pods) is a few MB

_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")


# ------------------------------------------------------------------ parsers
def parse_oci_spec(text: str, runtime: Optional[Runtime] = None, container_id: str = "") -> PodNames:
    """The names in an OCI runtime spec's annotations, in `runtime`'s format only (None:
    the one runtime whose keys it holds; a spec holding both names nothing); NO_NAMES
    where it has none (a pod's sandbox, a container outside Kubernetes), or where the
    spec records another container id than `container_id`. ValueError where the text
    is not a JSON object."""
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError("an OCI spec is a JSON object")
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict):
        return NO_NAMES
    if runtime is None:
        found = [names for names in (_annotated(annotations, r, container_id) for r in (CONTAINERD, CRIO))
                 if names != NO_NAMES]
        return found[0] if len(found) == 1 else NO_NAMES
    return _annotated(annotations, runtime, container_id)


def _annotated(annotations: Dict[str, object], runtime: Runtime, container_id: str) -> PodNames:
    namespace, pod, container = (annotations.get(k) for k in runtime.keys)
    if not (isinstance(namespace, str) and isinstance(pod, str) and namespace and pod):
        return NO_NAMES
    if container_id and runtime.id_key and annotations.get(runtime.id_key) not in (None, container_id):
        return NO_NAMES  # not this container's spec
    uid = annotations.get(runtime.pod_uid_key)
    return PodNames(namespace, pod, container if isinstance(container, str) else "",
                    uid if isinstance(uid, str) else "", KUBERNETES)


def parse_docker_config(text: str, container_id: str = "") -> PodNames:
    """The names of a running Docker container from the daemon's `config.v2.json`: a
    cri-dockerd pod's (its `io.kubernetes.*` labels), an ECS task's (the agent's labels:
    cluster's short name, the task ARN's last part as pod and pod uid, the task
    definition's container name) or its Docker name; with the init's PID (`State.Pid`)
    that proves a process is in it. NO_NAMES for a stopped container or one whose state
    records another id than `container_id`. ValueError where the text is not a JSON object."""
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("a Docker config.v2.json is a JSON object")
    state, config = doc.get("State"), doc.get("Config")
    if (container_id and doc.get("ID") != container_id) or not isinstance(state, dict) or state.get("Running") is not True:
        return NO_NAMES
    pid = state.get("Pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return NO_NAMES
    labels = config.get("Labels") if isinstance(config, dict) else None
    labels = labels if isinstance(labels, dict) else {}
    kubernetes = _annotated(labels, DOCKER_RUNTIME, "")
    if kubernetes != NO_NAMES:
        return kubernetes
    task_arn, cluster, ecs_name = (labels.get(k) for k in (ECS_TASK_ARN, ECS_CLUSTER, ECS_CONTAINER))
    if isinstance(task_arn, str) and task_arn.startswith("arn:") and "task/" in task_arn:
        task = task_arn.rpartition("/")[2]  # task/<id> (old) or task/<cluster>/<id>
        cluster = cluster.rpartition("cluster/")[2] if isinstance(cluster, str) else ""  # a name or its ARN
        return PodNames(cluster, task, ecs_name if isinstance(ecs_name, str) else "", task, ECS, pid)
    name = doc.get("Name")
    if not isinstance(name, str) or not name.strip("/"):
        return NO_NAMES
    # A Docker container is its own unit of scheduling: `docker` in the namespace column (so
    # that dashboards select it as any namespace), its name as pod and container, its id as pod uid.
    own_id = container_id or doc.get("ID")
    return PodNames(DOCKER, name.lstrip("/"), name.lstrip("/"), own_id if isinstance(own_id, str) else "", DOCKER, pid)


def parse_kubelet_pods(text: str) -> Dict[str, PodNames]:
    """Bare container id -> names, from the kubelet's `/pods` (a v1 PodList).
    ValueError where the text is not one."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise ValueError("the kubelet's /pods is a PodList with items")
    names: Dict[str, PodNames] = {}
    for pod in doc["items"]:
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        status = pod.get("status") if isinstance(pod, dict) else None
        if not isinstance(meta, dict) or not isinstance(status, dict):
            continue
        namespace, name, uid = str(meta.get("namespace", "")), str(meta.get("name", "")), str(meta.get("uid", ""))
        for kind in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
            for c in status.get(kind) or ():
                if isinstance(c, dict) and isinstance(c.get("containerID"), str):
                    bare = c["containerID"].rpartition("://")[2]
                    names[bare] = PodNames(namespace, name, str(c.get("name", "")), uid, KUBERNETES)
    return names


# ------------------------------------------------------------------ kubelet
def kubelet_fetcher(url: str, token_file: str, ca_file: str = "") -> Callable[[], str]:
    """A function that GETs the kubelet's /pods with the service account's token,
    checking its certificate against `ca_file` (else the service account's CA, where
    mounted, else the system's)."""
    if not ca_file and os.path.exists(SERVICE_ACCOUNT + "/ca.crt"):
        ca_file = SERVICE_ACCOUNT + "/ca.crt"
    context = ssl.create_default_context(cafile=ca_file or None) if url.startswith("https") else None
    url = url.rstrip("/") + "/pods"

    def fetch() -> str:
        headers = {"Accept": "application/json"}
        if os.path.exists(token_file):
            with open(token_file, encoding="ascii") as f:  # re-read: the token is rotated
                headers["Authorization"] = "Bearer " + f.read().strip()
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=KUBELET_TIMEOUT, context=context) as resp:
            body: bytes = resp.read(MAX_PODS_BYTES + 1)
        if len(body) > MAX_PODS_BYTES:
            raise ValueError(f"the kubelet's /pods is larger than {MAX_PODS_BYTES} bytes")
        return body.decode("utf-8")

    return fetch


# ------------------------------------------------------------------ lookup
@dataclass
class PodNameLookup:
    """Names per container id: the runtime's spec files, else the kubelet, cached."""

    roots: Sequence[str] = DEFAULT_RUNTIME_ROOTS
    kubelet: Optional[Callable[[], str]] = None
    clock: Callable[[], float] = time.monotonic
    max_entries: int = MAX_ENTRIES

    def __post_init__(self) -> None:
        self._found: "OrderedDict[str, PodNames]" = OrderedDict()
        self._missed: "OrderedDict[str, float]" = OrderedDict()  # id -> when last looked for in vain
        self._kubelet_pods: Dict[str, PodNames] = {}
        self._kubelet_asked: Optional[float] = None
        self._complained: Set[str] = set()
        self._root_runtimes: Dict[str, Runtime] = {r: DEFAULT_ROOT_RUNTIMES[r] for r in self.roots
                                                   if r in DEFAULT_ROOT_RUNTIMES}

    def known(self, container_id: str) -> Optional[PodNames]:
        """`names` where it needs no lookup (found, or looked for in vain lately); None
        where it would read the runtime's files or ask the kubelet."""
        if not _CONTAINER_ID.fullmatch(container_id):
            return NO_NAMES  # nothing that could name a path: the cgroup gives 64 hex digits
        found = self._found.get(container_id)
        if found is not None:
            self._found.move_to_end(container_id)
            return found
        missed = self._missed.get(container_id)
        return NO_NAMES if missed is not None and self.clock() - missed < MISS_RETRY_SECONDS else None

    def names(self, container_id: str) -> PodNames:
        known = self.known(container_id)
        if known is not None:
            return known
        now = self.clock()
        names = self._from_runtime(container_id) or self._from_kubelet(container_id, now)
        if names is None:
            self._remember(self._missed, container_id, now)
            return NO_NAMES
        self._missed.pop(container_id, None)
        self._remember(self._found, container_id, names)
        return names

    def forget(self, container_id: str) -> None:
        """Look this id up again next time: a restarted Docker container keeps its id but
        its init, and so its names' proof, is another."""
        self._found.pop(container_id, None)
        self._missed.pop(container_id, None)

    def _remember(self, cache: "OrderedDict[str, V]", key: str, value: V) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self.max_entries:
            cache.popitem(last=False)

    def _from_runtime(self, container_id: str) -> Optional[PodNames]:
        for root in self.roots:
            known = self._root_runtimes.get(root)
            for runtime in (known,) if known is not None else RUNTIMES:
                path = os.path.join(root, container_id, runtime.spec)
                try:
                    with open(path, encoding="utf-8", errors="replace") as f:
                        text = f.read(MAX_SPEC_BYTES)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    self._complain(f"spec:{root}", "cannot read container names from %s: %s", path, e)
                    continue
                self._root_runtimes[root] = runtime  # a root is one runtime's: the other layout is never read
                try:
                    names = (parse_docker_config(text, container_id) if runtime.docker
                             else parse_oci_spec(text, runtime, container_id))
                except ValueError as e:
                    self._complain(f"spec:{root}", "cannot read container names from %s: %s", path, e)
                    continue
                return names if names != NO_NAMES else None
        return None

    def _from_kubelet(self, container_id: str, now: float) -> Optional[PodNames]:
        if self.kubelet is None:
            return None
        if container_id not in self._kubelet_pods and (
                self._kubelet_asked is None or now - self._kubelet_asked >= KUBELET_MIN_INTERVAL):
            self._kubelet_asked = now
            try:
                self._kubelet_pods = parse_kubelet_pods(self.kubelet())
            except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
                self._complain("kubelet", "cannot read pod names from the kubelet's /pods: %s", e)
        return self._kubelet_pods.get(container_id)

    def _complain(self, what: str, message: str, *args: object) -> None:
        """Log a failure once per kind: a broken mount would otherwise log every new client."""
        if what not in self._complained:
            self._complained.add(what)
            log.warning(message, *args)

    def cached(self) -> Tuple[int, int]:
        """(ids with names, ids without), for tests and the benchmark."""
        return len(self._found), len(self._missed)
