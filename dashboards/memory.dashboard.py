"""Memory and OOM risk: GPUs filling up, clients near their pinned limits."""

from dashboards.common import CLIENT_INFO_JOIN, build, m, row, target, timeseries

GPU_LEGEND = "{{instance}} GPU {{gpu}}"
CLIENT_LEGEND = "{{instance}} GPU {{gpu}} pid {{pid}} {{command}} ({{user}})"

dashboard = build(
    title="MPS / Memory and OOM risk",
    uid="mps-memory",
    description="GPU memory use and its trend, and each MPS client's memory against its pinned device memory limit.",
    panels=[
        row("GPUs"),
        timeseries("GPU memory in use", "Used over total device memory per GPU.", "percentunit",
                   [target(f"{m('mps_gpu_memory_used_bytes')} / {m('mps_gpu_memory_total_bytes')}", GPU_LEGEND)],
                   max_one=True),
        timeseries("GPU memory in 4 hours",
                   "Used memory predicted 4 hours ahead from the trend of the last 30 minutes, against the total "
                   "(the MpsGpuMemoryFillingUp alert).",
                   "bytes", [target(f"predict_linear({m('mps_gpu_memory_used_bytes')}[30m], 4 * 3600)",
                                    "predicted " + GPU_LEGEND),
                             target(m("mps_gpu_memory_total_bytes"), "total " + GPU_LEGEND)]),
        row("Clients"),
        timeseries("Client memory against its limit",
                   "Each client's device memory over the pinned limit that applies to it; allocations beyond 100 % "
                   "fail with out-of-memory.",
                   "percentunit", [target(f"({m('mps_client_memory_used_bytes')} / on(job, instance, daemon, pid, gpu) "
                                          f"group_left {m('mps_client_pinned_memory_limit_bytes')}) {CLIENT_INFO_JOIN}",
                                          CLIENT_LEGEND)], max_one=True),
        timeseries("Largest clients", "The ten MPS clients holding the most device memory.", "bytes",
                   [target(f"topk(10, {m('mps_client_memory_used_bytes')} {CLIENT_INFO_JOIN})", CLIENT_LEGEND)]),
        timeseries("Server memory", "Device memory of the MPS server processes themselves.", "bytes",
                   [target(m("mps_server_memory_used_bytes"), "{{instance}} GPU {{gpu}} server {{server_pid}}")]),
        timeseries("Pinned memory limits",
                   "Limits in force: per client, per server, and the daemon default for new servers.",
                   "bytes", [target(m("mps_client_pinned_memory_limit_bytes"), "client {{pid}} GPU {{gpu}}"),
                             target(m("mps_server_pinned_memory_limit_bytes"), "server {{server_pid}} GPU {{gpu}}"),
                             target(m("mps_default_pinned_memory_limit_bytes"), "default {{daemon}} GPU {{gpu}}")]),
    ],
)
