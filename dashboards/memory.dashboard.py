"""Memory and OOM risk: GPUs filling up, clients near their pinned limits."""

from alerts import config as C
from alerts.expressions import client_memory_ratio, gpu_memory_ratio, memory_fill_prediction
from dashboards.common import CLIENT_INFO_JOIN, build, m, row, target, timeseries

GPU_LEGEND = "{{instance}} GPU {{gpu}}"
CLIENT_LEGEND = "{{instance}} GPU {{gpu}} pid {{pid}} {{command}} ({{user}})"
HORIZON = f"{C.MEMORY_FILL_HORIZON_SECONDS // 3600} hours"

dashboard = build(
    title="MPS / Memory and OOM risk",
    uid="mps-memory",
    description="GPU memory use and its trend, and each MPS client's memory against its pinned device memory limit.",
    panels=[
        row("GPUs"),
        timeseries("GPU memory in use", "Used over total device memory per GPU.", "percentunit",
                   [target(gpu_memory_ratio(m), GPU_LEGEND)],
                   max_one=True),
        timeseries(f"GPU memory in {HORIZON}",
                   f"Used memory predicted {HORIZON} ahead from the trend of the last {C.MEMORY_FILL_WINDOW}, "
                   f"against the total (the MpsGpuMemoryFillingUp alert).",
                   "bytes", [target(memory_fill_prediction(m), "predicted " + GPU_LEGEND),
                             target(m("mps_gpu_memory_total_bytes"), "total " + GPU_LEGEND)]),
        row("Clients"),
        # The ratio the MpsClientNearMemoryLimit alert reads, as the exporter serves it: the panel
        # shows what the alert sees, a selection of one series per client, not a join of three
        # at query time (the slowest panel of the per-node dashboards before, issue 19).
        timeseries("Client memory against its limit",
                   "Each client's device memory over the pinned limit that applies to it; allocations beyond 100 % "
                   "fail with out-of-memory. Served by the exporter (mps_client_pinned_memory_usage_ratio), "
                   "the series the MpsClientNearMemoryLimit alert reads; from exporters with "
                   "--mps.client-granularity pod, one line per server, pod and GPU (their summed memory over "
                   "their summed limits).",
                   "percentunit", [target(client_memory_ratio(m),
                                          "{{instance}} GPU {{gpu}} pid {{pid}} {{namespace}} {{pod}}")],
                   max_one=True),
        # topk before the join: the join then matches ten clients, not all of the node's.
        timeseries("Largest clients", "The ten MPS clients holding the most device memory.", "bytes",
                   [target(f"topk(10, {m('mps_client_memory_used_bytes')}) {CLIENT_INFO_JOIN}", CLIENT_LEGEND)]),
        timeseries("Exits at the memory edge",
                   "MPS clients that exited while a memory reading of their last 30 s was within "
                   "--mps.oom-margin-ratio of their pinned limit (client_limit) or their GPU was at least "
                   "--mps.device-full-ratio full (device_full), by the kernel's outcome: failed (non-zero status or "
                   "a signal: most likely out-of-memory, MPS logs none), clean, unknown (no proc connector). "
                   "The MpsClientExitedAtMemoryLimit alert; `mps-exporter status` lists them with their last reading.",
                   "none", [target(f"sum by (instance, gpu, reason, outcome) "
                                   f"(increase({m('mps_client_exits_at_memory_limit_total')}[$__rate_interval]))",
                                   "{{instance}} GPU {{gpu}} {{reason}} {{outcome}}")], stacked=True),
        timeseries("Server memory", "Device memory of the MPS server processes themselves.", "bytes",
                   [target(m("mps_server_memory_used_bytes"), "{{instance}} GPU {{gpu}} server {{server_pid}}")]),
        timeseries("Pinned memory limits",
                   "Limits in force: per client, per server, and the daemon default for new servers.",
                   "bytes", [target(m("mps_client_pinned_memory_limit_bytes"), "client {{pid}} GPU {{gpu}}"),
                             target(m("mps_server_pinned_memory_limit_bytes"), "server {{server_pid}} GPU {{gpu}}"),
                             target(m("mps_default_pinned_memory_limit_bytes"), "default {{daemon}} GPU {{gpu}}")]),
    ],
)
