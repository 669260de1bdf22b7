"""Exporter health: is every collector answering, how long do scrapes take."""

from alerts import config as C
from dashboards.common import build, m, row, row_query, source_panels, table, target, timeseries

dashboard = build(
    title="MPS / Exporter health",
    uid="mps-exporter-health",
    description="The mps-exporter itself: targets, collectors, scrape cost, MPS log parsing and control commands.",
    panels=[
        row("Targets and collectors"),
        timeseries("Target up", "1 when Prometheus scraped the exporter successfully.", "none",
                   [target(m("up"), "{{instance}}")], w=8, max_one=True),
        timeseries("Collector success", "1 when the collector's source answered in the scrape.", "none",
                   [target(m("mps_exporter_collector_success"), "{{instance}} {{collector}}")], w=8, max_one=True),
        timeseries("Collector duration", "Time each collector took in the scrape.", "s",
                   [target(m("mps_exporter_collector_duration_seconds"), "{{instance}} {{collector}}")], w=8),
        timeseries("Age of the served reading",
                   "Age of each source's reading when the scrape served it: under one refresh interval "
                   "(--collector.refresh-interval, NVML and DCGM) or about 0 (read in the scrape). Grows while a "
                   "source fails or is late (past --scrape.max-duration or Prometheus' scrape timeout): its series "
                   f"are then its last complete reading, or absent. 'stale above': where MpsExporterReadingsStale "
                   f"begins ({C.READINGS_STALE_INTERVALS} intervals + {C.READINGS_STALE_SLACK_SECONDS} s).", "s",
                   [target(f"timestamp({m('mps_exporter_collector_last_success_timestamp_seconds')}) - "
                           f"{m('mps_exporter_collector_last_success_timestamp_seconds')}", "{{instance}} {{collector}}"),
                    target(f"{C.READINGS_STALE_INTERVALS} * {m('mps_exporter_collector_refresh_interval_seconds')} "
                           f"+ {C.READINGS_STALE_SLACK_SECONDS}",
                           "{{instance}} {{collector}} stale above")], w=8),
        timeseries("Source read time p99", "99th percentile of each source's read time, late reads included.", "s",
                   [target("histogram_quantile(0.99, sum by (instance, collector, le) (rate("
                           f"{m('mps_exporter_collector_read_duration_seconds', '_bucket')}[$__rate_interval])))",
                           "{{instance}} {{collector}}")], w=8),
        timeseries("Scrape duration", "How long Prometheus took to scrape each exporter.", "s",
                   [target(m("scrape_duration_seconds"), "{{instance}}")], w=8),
        timeseries("Samples per scrape", "Samples Prometheus took from each scrape.", "none",
                   [target(m("scrape_samples_scraped"), "{{instance}}")], w=8),
        timeseries("Sources answering", "Watched control daemons and GPUs that answered in the scrape.", "none",
                   [target(m("mps_control_daemon_up"), "{{instance}} daemon {{daemon}}"),
                    target(m("mps_gpu_up"), "{{instance}} GPU {{gpu}}")], w=8, max_one=True),
        row("MPS logs and control commands"),
        timeseries("Log lines read", "MPS log lines read per second, by file (control or server).", "cps",
                   [target(f"rate({m('mps_log_lines_total')}[$__rate_interval])", "{{instance}} {{daemon}} {{file}}")],
                   w=8),
        timeseries("Log lines not understood",
                   "Lines no parsing rule matched, and lines cut at the line cap, per second: a new MPS version "
                   "may log differently. Read errors: a log file that began to fail (missing or unreadable "
                   "directory, not a regular file, permission denied), by reason. Rotation gaps: a copytruncate "
                   "rotation whose copy was compressed or removed before the unread part was read. State file "
                   "errors: a saved state not trusted (the logs were read from their start) or not written.",
                   "cps", [target(f"rate({m('mps_log_unrecognized_lines_total')}[$__rate_interval])",
                                  "unrecognized {{instance}} {{daemon}} {{file}}"),
                           target(f"rate({m('mps_log_truncated_lines_total')}[$__rate_interval])",
                                  "truncated {{instance}} {{daemon}} {{file}}"),
                           target(f"rate({m('mps_log_read_errors_total')}[$__rate_interval])",
                                  "read errors {{instance}} {{daemon}} {{file}} {{reason}}"),
                           target(f"rate({m('mps_log_rotation_gaps_total')}[$__rate_interval])",
                                  "rotation gaps {{instance}} {{daemon}} {{file}}"),
                           target(f"rate({m('mps_exporter_state_file_errors_total')}[$__rate_interval])",
                                  "state file {{instance}} {{reason}}")], w=8),
        timeseries("Log silence", "Seconds since the time written on the newest line of each log file. "
                   "control.log also logs the exporter's own commands; a server.log that stops moving while "
                   "clients come and go is worth a look.", "s",
                   [target(f"time() - {m('mps_log_last_line_timestamp_seconds')}", "{{instance}} {{daemon}} {{file}}")],
                   w=8),
        timeseries("Control commands", "Commands the control daemon received per second, by verb (the exporter's "
                   "own included), and the exporter's own: MPS echoes each into control.log, which it never "
                   "rotates; at a steady state the exporter sends get_server_list alone. Unknown to the daemon: "
                   "commands an older driver does not know (each costs its field, not the daemon).", "cps",
                   [target(f"sum by (instance, daemon, command) (rate({m('mps_control_commands_total')}"
                           f"[$__rate_interval]))", "{{instance}} {{daemon}} {{command}}"),
                    target(f"sum by (instance, daemon, command) (rate({m('mps_exporter_control_commands_total')}"
                           f"[$__rate_interval]))", "exporter {{instance}} {{daemon}} {{command}}"),
                    target(f"sum by (instance, daemon, command) "
                           f"(rate({m('mps_exporter_control_commands_unknown_total')}[$__rate_interval]))",
                           "unknown to the daemon {{instance}} {{daemon}} {{command}}")], w=8),
        table("Exporter versions", "Version of each exporter and the Python it runs on.",
              [row_query(m("mps_exporter_build_info"))],
              units={"Value": "none"}, rename={}, hide=["Value"], h=6),
        *source_panels(),
    ],
)
