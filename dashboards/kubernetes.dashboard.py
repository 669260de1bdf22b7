"""Kubernetes: MPS clients by namespace and pod (the exporter's own `namespace`, `pod` and
`container` labels; per-pod sums recorded by alerts/recordings.py)."""

from alerts import config as C
from alerts import recordings as R
from alerts.expressions import client_memory_ratio, job
from dashboards.common import build, kubernetes_variables, rec, row, row_query, table, target, timeseries

POD = {"namespace": "namespace", "pod": "pod"}
POD_LEGEND = "{{namespace}}/{{pod}} on {{instance}}"
GPU_LEGEND = POD_LEGEND + " GPU {{gpu}}"


def in_pods(name: str) -> str:
    """A series of the exporter, of the selected pods (the exporter names them)."""
    return job(name, namespace="=~$namespace", pod="=~$pod")


# The MPS clients of the selected pods.
CLIENTS = in_pods("mps_client_info")
# MPS clients of each selected pod (counted here: one series per pod is not worth recording).
POD_CLIENTS = f"count by (job, instance, namespace, pod) ({CLIENTS})"


# Headroom and suggested limit (alerts/config.py SUGGESTED_LIMIT_*): per client where the exporter
# keeps clients (--mps.client-granularity client), per server and pod where it sums them (pod).
CLIENT_KEYS = "job, instance, daemon, namespace, pod, container, pid, gpu"
POD_KEYS = "job, instance, daemon, server_pid, namespace, pod, gpu"
CLIENT_PEAK = f'max by ({CLIENT_KEYS}) ({in_pods("mps_client_memory_peak_bytes")})'
CLIENT_LIMIT = (f'max by ({CLIENT_KEYS}) '
                f'({in_pods("mps_client_pinned_memory_limit_bytes")})')
POD_PEAK = f'max by ({POD_KEYS}) ({in_pods("mps_pod_client_memory_peak_bytes")})'
POD_LIMIT = (f'max by ({POD_KEYS}) '
             f'({in_pods("mps_pod_client_pinned_memory_limit_bytes")})')


def suggested(peak: str) -> str:
    """The peak plus the margin, rounded up to a size MPS takes as written."""
    step = C.SUGGESTED_LIMIT_STEP_BYTES
    return f"ceil({peak} * {1 + C.SUGGESTED_LIMIT_MARGIN_RATIO:g} / {step}) * {step}"


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
        table("Headroom and suggested limit",
              "Per MPS client (exporters at --mps.client-granularity client) and per server and pod (at pod): the "
              "most device memory it has held since the exporter saw it start, the pinned limit in force, the "
              f"headroom left at the peak, and a suggested limit: the peak plus "
              f"{C.SUGGESTED_LIMIT_MARGIN_RATIO:.0%}, rounded up to {C.SUGGESTED_LIMIT_STEP_BYTES >> 20} MiB "
              "(alerts/config.py says why). Size from a peak that covers the job's whole run. A client that "
              "exits at its limit counts in MpsClientExitedAtMemoryLimit.",
              [row_query(CLIENT_PEAK), row_query(CLIENT_LIMIT), row_query(f"{CLIENT_LIMIT} - {CLIENT_PEAK}"),
               row_query(suggested(CLIENT_PEAK)), row_query(POD_PEAK), row_query(POD_LIMIT),
               row_query(f"{POD_LIMIT} - {POD_PEAK}"), row_query(suggested(POD_PEAK))],
              units={f"Value #{c}": "bytes" for c in "ABCDEFGH"},
              rename={"instance": "node", "Value #A": "peak", "Value #B": "limit", "Value #C": "headroom",
                      "Value #D": "suggested limit", "Value #E": "pod peak", "Value #F": "pod limits",
                      "Value #G": "pod headroom", "Value #H": "pod suggested limit"}, h=8),
        row("Memory and threads"),
        timeseries("Pod memory against its limits",
                   "Device memory of each pod's MPS clients over the sum of their pinned limits, per GPU: "
                   "allocations beyond a client's limit fail with out-of-memory.",
                   "percentunit", [target(f"{rec(R.POD_MEMORY, **POD)} / {rec(R.POD_LIMIT, **POD)}", GPU_LEGEND)],
                   max_one=True),
        timeseries("Client memory against its limit",
                   "Each MPS client of the selected pods: device memory over its own pinned limit "
                   "(the MpsClientNearMemoryLimit alert).",
                   "percentunit", [target(client_memory_ratio(in_pods),
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
