"""Kubernetes: MPS clients by namespace and pod (the exporter's own `namespace`, `pod` and
`container` labels; per-pod sums recorded by alerts/recordings.py)."""

from alerts import recordings as R
from alerts.expressions import job
from dashboards.common import build, kubernetes_variables, rec, row, row_query, table, target, timeseries

POD = {"namespace": "namespace", "pod": "pod"}
POD_LEGEND = "{{namespace}}/{{pod}} on {{instance}}"
GPU_LEGEND = POD_LEGEND + " GPU {{gpu}}"


# The MPS clients of the selected pods, named by the exporter.
CLIENTS = job("mps_client_info", namespace="=~$namespace", pod="=~$pod")
# MPS clients of each selected pod (counted here: one series per pod is not worth recording).
POD_CLIENTS = f"count by (job, instance, namespace, pod) ({CLIENTS})"


def on_pod_nodes(record: str) -> str:
    """A per-node record, only for the nodes the selected pods run on."""
    return f"{record} and on(job, instance) {rec(R.POD_MEMORY, **POD)}"


dashboard = build(
    title="MPS / Kubernetes",
    uid="mps-kubernetes",
    description="MPS clients by namespace and pod: memory against the limits in force, thread share, node and GPU, "
                "and the contention on their nodes. Pods are named by the exporter (the container runtime's files or the "
                "kubelet on each node): no kube-state-metrics.",
    variables=kubernetes_variables(),
    panels=[
        row("Pods"),
        table("MPS clients of the selected pods",
              "One row per MPS client process in a pod: its node (instance), daemon, server, container, command and "
              "user, and the pod's device memory, limits and thread share on that node.",
              [row_query(CLIENTS)],
              units={"Value": "none"}, rename={"instance": "node"},
              hide=["Value", "container_id", "pod_uid", "uid", "__name__"], h=8),
        table("Where the pods run",
              "Per pod, node and GPU: device memory of its MPS clients and the pinned limits in force for them.",
              [row_query(rec(R.POD_MEMORY, **POD)), row_query(rec(R.POD_LIMIT, **POD))],
              units={"Value #A": "bytes", "Value #B": "bytes"},
              rename={"instance": "node", "Value #A": "memory", "Value #B": "pinned limits"}, h=6),
        row("Memory and threads"),
        timeseries("Pod memory against its limits",
                   "Device memory of each pod's MPS clients over the sum of their pinned limits, per GPU: "
                   "allocations beyond a client's limit fail with out-of-memory.",
                   "percentunit", [target(f"{rec(R.POD_MEMORY, **POD)} / {rec(R.POD_LIMIT, **POD)}", GPU_LEGEND)],
                   max_one=True),
        timeseries("Client memory against its limit",
                   "Each MPS client of the selected pods: device memory over its own pinned limit "
                   "(the MpsClientNearMemoryLimit alert).",
                   "percentunit", [target(rec(R.CLIENT_MEMORY_USAGE, **POD),
                                          POD_LEGEND + " {{container}} pid {{pid}} GPU {{gpu}}")], max_one=True),
        timeseries("Pod device memory", "Device memory of each pod's MPS clients, per GPU.", "bytes",
                   [target(rec(R.POD_MEMORY, **POD), GPU_LEGEND)]),
        timeseries("Pod thread share",
                   "Sum of the active thread shares in force for each pod's MPS clients (1 = a whole GPU's SMs).",
                   "percentunit", [target(rec(R.POD_THREADS, **POD), POD_LEGEND)]),
        timeseries("MPS clients per pod", "MPS client processes of each pod.", "none",
                   [target(POD_CLIENTS, POD_LEGEND)]),
        row("Contention on the pods' nodes"),
        timeseries("Queued clients on the pods' nodes",
                   "Clients waiting on the MPS pending list of the nodes the selected pods run on: another "
                   "user's server must drain, or the pod's own server is starting.",
                   "none", [target(on_pod_nodes(R.NODE_QUEUED), "{{instance}}")]),
        timeseries("Refused clients on the pods' nodes",
                   "Client connections MPS servers refused per second on those nodes (the server's client limit "
                   "was reached): the refused process fails after about 28 s.",
                   "cps", [target(on_pod_nodes(R.NODE_REFUSALS), "{{instance}}")]),
        timeseries("Fatal GPU errors on the pods' nodes",
                   "Fatal GPU errors MPS servers handled per second on those nodes: every client of the affected "
                   "server lost its work.",
                   "cps", [target(on_pod_nodes(R.NODE_FATAL), "{{instance}}")]),
    ],
)
