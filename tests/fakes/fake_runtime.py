"""Container runtime state directories (OCI bundles) for the pod-name lookup to read,
written from the real-format specs in tests/data/runtime."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

RUNTIME_DATA = Path(__file__).resolve().parents[1] / "data" / "runtime"
CONTAINERD_ROOT = RUNTIME_DATA / "containerd"
CRIO_ROOT = RUNTIME_DATA / "crio"
# The containers of those specs (and of kubelet-pods.json).
CONTAINERD_ID = "3f5b2c8e9d1a4b7c6e0f2a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d"
CONTAINERD_SANDBOX_ID = "8d2f6a1c3b5e7d9f0a2c4e6b8d0f1a3c5e7b9d1f3a5c7e9b1d3f5a7c9e1b3d5f"
CRIO_ID = "c7e1a9b3d5f7092b4d6f8a0c2e4b6d8f0a1c3e5b7d9f1a3c5e7b9d0f2a4c6e8b"


def write_containerd_spec(root: Path, container_id: str, namespace: str, pod: str, container: str,
                          pod_uid: str = "") -> Path:
    """containerd's spec of CONTAINERD_ID, renamed: `<root>/<container_id>/config.json`, in
    pod `pod_uid` ("": the fixture's pod)."""
    spec = json.loads((CONTAINERD_ROOT / CONTAINERD_ID / "config.json").read_text())
    spec["annotations"].update({"io.kubernetes.cri.sandbox-namespace": namespace,
                                "io.kubernetes.cri.sandbox-name": pod,
                                "io.kubernetes.cri.container-name": container})
    if pod_uid:
        spec["annotations"]["io.kubernetes.cri.sandbox-uid"] = pod_uid
    path = root / container_id / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return path


def write_crio_spec(root: Path, container_id: str, annotations: Dict[str, str]) -> Path:
    """CRI-O's spec of CRIO_ID with these annotations added or replaced:
    `<root>/<container_id>/userdata/config.json`."""
    spec = json.loads((CRIO_ROOT / CRIO_ID / "userdata" / "config.json").read_text())
    spec["annotations"].update({"io.kubernetes.cri-o.ContainerID": container_id, **annotations})
    path = root / container_id / "userdata" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    return path


DOCKER_ROOT = RUNTIME_DATA / "docker"
SLURM_CGROUPS = RUNTIME_DATA / "slurm"
# The containers of tests/data/runtime/docker: a plain Docker container (`/trainer`) and an
# ECS task's (cluster gpu-cluster, task 0f9a4c2b..., container trainer), and their inits.
DOCKER_ID = "4e7c2a9b1d3f5e8a0c6b2d4f7a9e1c3b5d8f0a2c4e6b9d1f3a5c7e0b2d4f6a8c"
DOCKER_INIT = 41876
ECS_ID = "9b1d3f5a7c0e2b4d6f8a1c3e5b7d9f2a4c6e8b0d1f3a5c7e9b2d4f6a8c0e1b3d"
ECS_INIT = 52311
ECS_TASK = "0f9a4c2b7d3e4e1f8a6b5c4d3e2f1a0b"


def write_docker_config(root: Path, container_id: str, name: str = "", pid: int = 0, running: bool = True,
                        labels: Optional[Dict[str, str]] = None, like: str = DOCKER_ID) -> Path:
    """Docker's config.v2.json of `like` (a fixture container) as `container_id`'s: renamed,
    its init `pid`, labels added: `<root>/<container_id>/config.v2.json`."""
    doc = json.loads((DOCKER_ROOT / like / "config.v2.json").read_text())
    doc["ID"] = container_id
    doc["Name"] = name or doc["Name"]
    doc["State"].update({"Running": running, "Pid": pid if running else 0})
    doc["Config"]["Labels"].update(labels or {})
    path = root / container_id / "config.v2.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, separators=(",", ":")))
    return path
