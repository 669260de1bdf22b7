"""GPU overview: how each GPU is shared, how busy its SMs are, memory, power."""

from dashboards.common import build, m, row, row_query, table, target, timeseries

GPU_LEGEND = "{{instance}} GPU {{gpu}}"

dashboard = build(
    title="MPS / GPU overview",
    uid="mps-gpu-overview",
    description="Per GPU: sharing mode, SM activity and occupancy, memory, power and temperature.",
    panels=[
        row("Sharing"),
        table("GPUs",
              "One row per GPU: model, driver, compute mode, MIG mode and how it is shared now "
              "(mps, mixed, time_slicing, exclusive, mig or idle), with the number of compute processes "
              "and MPS clients.",
              [row_query(m("mps_gpu_info")),
               row_query(m("mps_gpu_sharing_mode")),
               row_query(m("mps_gpu_compute_processes")),
               row_query(m("mps_gpu_clients"))],
              units={"Value #C": "none", "Value #D": "none"},
              rename={"Value #C": "compute processes", "Value #D": "MPS clients"},
              hide=["Value #A", "Value #B"], h=7),
        timeseries("Compute processes per GPU",
                   "Compute processes NVML lists on each GPU. Under MPS this is the server plus its clients.",
                   "none", [target(m("mps_gpu_compute_processes"), GPU_LEGEND)]),
        timeseries("MPS clients per GPU",
                   "MPS client processes on each GPU (NVML's MPS process list), at every client granularity.",
                   "none", [target(m("mps_gpu_clients"), GPU_LEGEND)]),
        table("Processes outside MPS",
              "Compute processes on a GPU that MPS serves that are no MPS server or client: they run beside MPS, "
              "outside its limits (pipe directory not mounted or not set, another CUDA_MPS_PIPE_DIRECTORY). "
              "User, command, container and pod from /proc, device memory from NVML.",
              [row_query(m("mps_process_outside_mps_info")),
               row_query(m("mps_process_outside_mps_memory_used_bytes"))],
              units={"Value #B": "bytes"}, rename={"Value #B": "memory"}, hide=["Value #A"], w=12, h=8),
        timeseries("Processes outside MPS per GPU",
                   "Compute processes outside MPS on each GPU that MPS serves (0 where MPS serves none).", "none",
                   [target(m("mps_gpu_processes_outside_mps"), GPU_LEGEND)]),
        row("Activity"),
        timeseries("SM active",
                   "Share of SMs busy over the last interval (NVML GPM on Hopper and later, or DCGM). "
                   "The contention signal under MPS: near 100 % the clients compete for SMs.",
                   "percentunit", [target(m("mps_gpu_sm_active_ratio"), GPU_LEGEND)], max_one=True),
        timeseries("SM occupancy",
                   "Resident warps against the SMs' maximum (NVML GPM or DCGM): low occupancy with high SM "
                   "activity means small kernels.",
                   "percentunit", [target(m("mps_gpu_sm_occupancy_ratio"), GPU_LEGEND)], max_one=True),
        timeseries("Tensor and DRAM activity",
                   "Tensor pipe activity and DRAM bandwidth use (NVML GPM or DCGM).",
                   "percentunit", [target(m("mps_gpu_tensor_active_ratio"), "tensor " + GPU_LEGEND),
                                   target(m("mps_gpu_dram_active_ratio"), "DRAM " + GPU_LEGEND)], max_one=True),
        timeseries("NVML utilization",
                   "NVML 'GPU utilization' (share of time any kernel ran) and memory controller busy ratio. "
                   "One tiny kernel stream saturates the first: it is no contention signal under MPS.",
                   "percentunit", [target(m("mps_gpu_utilization_ratio"), "GPU " + GPU_LEGEND),
                                   target(m("mps_gpu_memory_utilization_ratio"), "memory " + GPU_LEGEND)],
                   max_one=True),
        timeseries("SM utilization by process",
                   "Per-process SM utilization: for MPS servers (NVML attributes all of their clients' SM time "
                   "to the server) and for processes on GPUs not under MPS.",
                   "percentunit",
                   [target(m("mps_server_sm_utilization_ratio"), GPU_LEGEND + " MPS server {{server_pid}}"),
                    target(m("mps_process_sm_utilization_ratio"), GPU_LEGEND + " pid {{pid}}")],
                   w=24, max_one=True),
        row("Xid errors"),
        timeseries("Xid errors per GPU and code",
                   "Xid errors NVML reported in each interval, by GPU and Xid code (NVML's event API, counted since "
                   "the exporter started). Codes that need a reset or service alert as MpsGpuXidCritical, "
                   "application faults as MpsGpuXidApplication (alerts/config.py lists them).", "none",
                   [target(f"increase({m('mps_gpu_xid_errors_total')}[$__rate_interval])",
                           GPU_LEGEND + " Xid {{xid}}")], w=12),
        table("Last Xid per GPU and code",
              "When the exporter last received each Xid code of each GPU (compare with the MPS logs' fatal GPU "
              "errors: mps-exporter status lists them side by side), and whether the GPU's Xid events are "
              "registered at all: 0 means NVML refused (not supported, no permission) and its Xids go uncounted.",
              [row_query(f"{m('mps_gpu_xid_last_seen_timestamp_seconds')} * 1000"),
               row_query(m("mps_gpu_xid_events_registered"))],
              units={"Value #A": "dateTimeAsIso", "Value #B": "none"},
              rename={"Value #A": "last seen", "Value #B": "events registered"}, hide=[], w=12, h=8),
        row("Memory and power"),
        timeseries("Memory used",
                   "Device memory used and total per GPU.",
                   "bytes", [target(m("mps_gpu_memory_used_bytes"), "used " + GPU_LEGEND),
                             target(m("mps_gpu_memory_total_bytes"), "total " + GPU_LEGEND)], w=8),
        timeseries("Power", "Power draw of each GPU (NVML).", "watt",
                   [target(m("mps_gpu_power_watts"), GPU_LEGEND)], w=8),
        timeseries("Temperature", "Core temperature of each GPU (NVML).", "celsius",
                   [target(m("mps_gpu_temperature_celsius"), GPU_LEGEND)], w=8),
    ],
)
