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

log = logging.getLogger(__name__)
V = TypeVar("V")


@dataclass(frozen=True)
class PodNames:
    namespace: str = ""
    pod: str = ""
    container: str = ""
    # The pod the runtime (or the kubelet) puts the container in: what the cgroup's pod
    # uid must equal for these names to be a process's (`confirms`). Not compared: the
    # names are the value.
    pod_uid: str = field(default="", compare=False)

    def confirms(self, pod_uid: str) -> bool:
        """Whether these names may go to a process whose cgroup says `pod_uid`."""
        return bool(self.pod_uid) and self.pod_uid == pod_uid


NO_NAMES = PodNames()

# (namespace, pod, container) annotation keys of each runtime's OCI spec.
CONTAINERD_KEYS = ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name",
                   "io.kubernetes.cri.container-name")
CRIO_KEYS = ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.container.name")


@dataclass(frozen=True)
class Runtime:
    """One runtime's layout and annotation format."""

    name: str
    spec: str  # the spec's path inside `<root>/<id>/`
    keys: Tuple[str, str, str]  # namespace, pod, container
    pod_uid_key: str
    id_key: str = ""  # where the spec records its own container id ("": nowhere)


CONTAINERD = Runtime("containerd", "config.json", CONTAINERD_KEYS, "io.kubernetes.cri.sandbox-uid")
CRIO = Runtime("cri-o", "userdata/config.json", CRIO_KEYS, "io.kubernetes.pod.uid", "io.kubernetes.cri-o.ContainerID")
RUNTIMES = (CONTAINERD, CRIO)
# The default roots' runtimes (config.DEFAULT_RUNTIME_ROOTS); another root is the runtime
# whose layout is found there first.
DEFAULT_ROOT_RUNTIMES = dict(zip(DEFAULT_RUNTIME_ROOTS, RUNTIMES))

SPEC_FILES = tuple(r.spec for r in RUNTIMES)  # containerd, CRI-O

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
        found = [names for names in (_annotated(annotations, r, container_id) for r in RUNTIMES) if names != NO_NAMES]
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
                    uid if isinstance(uid, str) else "")


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
                    names[bare] = PodNames(namespace, name, str(c.get("name", "")), uid)
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
                    names = parse_oci_spec(text, runtime, container_id)
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
