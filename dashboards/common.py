"""Shared defaults for the mps-exporter dashboards: the data source and the
job/node/GPU/daemon variables, selectors built from the metric contract, panel
helpers that insist on a description and a unit, and a flowing grid layout.

A dashboard module builds its panels with these helpers and ends with
`dashboard = build(title=..., uid=..., description=..., panels=[...])`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import attr
from grafanalib.core import (
    Dashboard,
    GridPos,
    RowPanel,
    Stat,
    Table,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

from alerts import config as C
from alerts.expressions import client_info_join, matchers, server_info_join
from alerts.recordings import POD_MEMORY, RECORDINGS
from mps_exporter.catalog import METRICS
from mps_exporter.contract import COUNTER, HISTOGRAM
from mps_exporter.sources.registry import SOURCES

# Grafana's schema version of the JSON model these dashboards are written for
# (Grafana 10.4 / 11); older Grafana versions refuse newer schemas, newer ones migrate.
SCHEMA_VERSION = 39
TAGS = ["mps", "nvidia", "gpu", "mps-exporter"]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24

# Label -> dashboard variable. The node variable picks config.NODE_LABEL
# (`instance` unless relabeling adds a node name; the exporter adds no host label).
VARIABLE_OF_LABEL = {"job": "job", C.NODE_LABEL: "node", "gpu": "gpu", "daemon": "daemon"}
SCRAPE_SERIES = ("up", "scrape_duration_seconds", "scrape_samples_scraped")
RECORDED = {r.record for r in RECORDINGS}


def _query_variable(name: str, label: str, query: str, all_by_default: bool = True) -> Template:
    """A multi-value variable; by default "All" ("$__all" is Grafana's value of it).
    Without all_by_default there is no All option: Grafana selects the first value."""
    return Template(name=name, label=label, query=query, dataSource=DATASOURCE,
                    default="$__all" if all_by_default else None, includeAll=all_by_default, multi=True,
                    allValue=".*" if all_by_default else None, refresh=2, sort=1)


def _datasource_variable() -> Template:
    # No default: Grafana picks the default Prometheus data source.
    return Template(name="datasource", label="Data source", query="prometheus", type="datasource")


def node_variables() -> List[Template]:
    """The per-node dashboards' variables: job, node (one by default), GPU, daemon."""
    node = f'{C.NODE_LABEL}=~"$node"'
    return [
        _query_variable("job", "Job", f"label_values(mps_exporter_build_info{{{C.JOB_SELECTOR}}}, job)"),
        # One node by default: "All" over a fleet makes every panel read every node.
        _query_variable("node", "Node", f'label_values(mps_exporter_build_info{{job=~"$job"}}, {C.NODE_LABEL})',
                        all_by_default=False),
        _query_variable("gpu", "GPU", f'label_values(mps_gpu_info{{job=~"$job", {node}}}, gpu)'),
        _query_variable("daemon", "MPS daemon",
                        f'label_values(mps_control_daemon_up{{job=~"$job", {node}}}, daemon)'),
    ]


def kubernetes_variables() -> List[Template]:
    """Namespace (the first one by default) and pod (All of it), from the recorded memory of
    the pods with MPS clients (per client, or summed per pod by the exporter)."""
    return [
        # ECS clusters, `docker` and `slurm` are namespaces too, tasks, containers and jobs pods
        # (docs/labels.md#owners).
        _query_variable("namespace", "Namespace / cluster", f"label_values({POD_MEMORY}, namespace)",
                        all_by_default=False),
        _query_variable("pod", "Pod / task / job", f'label_values({POD_MEMORY}{{namespace=~"$namespace"}}, pod)'),
    ]


def rec(record: str, **variables: str) -> str:
    """A recorded series selected by dashboard variables: rec(X, namespace="namespace")
    -> X{namespace=~"$namespace"}; without variables just the name."""
    if record not in RECORDED:
        raise KeyError(f"{record} is not one of our recording rules")
    parts = [f'{label}=~"${var}"' for label, var in variables.items()]
    return f"{record}{{{', '.join(parts)}}}" if parts else record


def node_rec(record: str, *labels: str) -> str:
    """A recorded series on a per-node dashboard: selected by the job and node
    variables and by those of `labels` (gpu, daemon) the record keeps."""
    return rec(record, job="job", **{C.NODE_LABEL: "node"}, **{label: VARIABLE_OF_LABEL[label] for label in labels})


def m(name: str, suffix: str = "", **extra: str) -> str:
    """A selector for a contract metric with the dashboard variables that apply
    to its labels, e.g. m("mps_gpu_power_watts") ->
    mps_gpu_power_watts{job=~"$job", instance=~"$node", gpu=~"$gpu"};
    `extra` as in alerts.expressions.matchers. The dashboards' alerts.expressions.Selector."""
    if name not in METRICS and name not in SCRAPE_SERIES:
        raise KeyError(f"{name} is not in the metric contract")
    labels = dict.fromkeys(C.TARGET_LABELS + (C.NODE_LABEL,) + (METRICS[name].labels if name in METRICS else ()))
    parts = [f'{label}=~"${VARIABLE_OF_LABEL[label]}"' for label in labels if label in VARIABLE_OF_LABEL]
    return f"{name}{suffix}{{{', '.join(parts + matchers(**extra))}}}"


# Joins a per-client series with the client's user and command, a per-server one with its user.
CLIENT_INFO_JOIN = client_info_join(m, "user, command, server_pid")
SERVER_INFO_JOIN = server_info_join(m, "user")


def target(expr: str, legend: str = "", instant: bool = False, table: bool = False) -> Target:
    return Target(expr=expr, legendFormat=legend, instant=instant, datasource=DATASOURCE,
                  format="table" if table else "time_series")


def row_query(expr: str) -> Target:
    """An instant query in table format: one table row per series."""
    return target(expr, instant=True, table=True)


def _with_ref_ids(targets: Sequence[Target]) -> List[Target]:
    return [attr.evolve(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)]


def timeseries(title: str, description: str, unit: str, targets: Sequence[Target],
               w: int = 12, h: int = 8, stacked: bool = False, max_one: bool = False) -> TimeSeries:
    return TimeSeries(
        title=title, description=description, unit=unit, dataSource=DATASOURCE,
        targets=_with_ref_ids(targets), gridPos=GridPos(h=h, w=w, x=0, y=0),
        stacking={"mode": "normal", "group": "A"} if stacked else {},
        fillOpacity=20 if stacked else 10, legendDisplayMode="table", legendPlacement="bottom",
        legendCalcs=["lastNotNull", "max"], tooltipMode="multi", valueMin=0,
        valueMax=1 if max_one else None,
    )


# Stat colours: a count that is trouble from `bad_from` on turns red (or orange for what
# needs a look, not a page); one that is trouble below `good_from` is red until it is
# reached; a plain count (clients, servers) is in the text colour, neither good nor bad.
NEUTRAL, GOOD, WARN, BAD = "text", "green", "orange", "red"


def stat(title: str, description: str, unit: str, targets: Sequence[Target], w: int = 6, h: int = 4,
         bad_from: Optional[float] = None, warn_from: Optional[float] = None,
         good_from: Optional[float] = None) -> Stat:
    # grafanalib's default is "", not a list of steps; null = from -Infinity.
    if good_from is not None:
        steps = [{"color": BAD, "value": None}, {"color": GOOD, "value": good_from}]
    elif bad_from is not None or warn_from is not None:
        steps = [{"color": GOOD, "value": None}]
        steps += [{"color": WARN, "value": warn_from}] if warn_from is not None else []
        steps += [{"color": BAD, "value": bad_from}] if bad_from is not None else []
    else:
        steps = [{"color": NEUTRAL, "value": None}]
    return Stat(title=title, description=description, format=unit, dataSource=DATASOURCE,
                targets=_with_ref_ids(targets), gridPos=GridPos(h=h, w=w, x=0, y=0),
                reduceCalc="lastNotNull", graphMode="none", noValue="0", thresholds=steps)


def table(title: str, description: str, targets: Sequence[Target], units: Dict[str, str],
          rename: Dict[str, str], hide: Sequence[str] = (), w: int = 24, h: int = 9) -> Table:
    """Instant queries in table format, merged on their common labels into one
    row per entity. units/rename: per value column ("Value #B") its unit and title."""
    hidden = {"Time": True, "__name__": True, "job": True, **{k: True for k in hide}}
    overrides = [{"matcher": {"id": "byName", "options": col},
                  "properties": [{"id": "unit", "value": unit}]} for col, unit in units.items()]
    return Table(
        title=title, description=description, dataSource=DATASOURCE, unit="none",
        targets=_with_ref_ids(targets), gridPos=GridPos(h=h, w=w, x=0, y=0),
        overrides=overrides, filterable=True,
        transformations=[
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": hidden, "renameByName": rename}},
        ],
    )


def source_panels() -> List[Any]:
    """A row per source that renders metrics of its own (Source.metrics), one panel per
    metric: counters as rates, histograms as their p99, gauges as they are. A new
    source's metrics show on the exporter dashboard without a dashboard edit; one that
    deserves more moves to a dashboard of its own."""
    panels: List[Any] = []
    for source in SOURCES.values():
        if not source.metrics:
            continue
        panels.append(row(f"Collector {source.name}: {source.help}"))
        for spec in source.metrics:
            legend = " ".join(["{{instance}}", *("{{%s}}" % label for label in spec.labels)])
            if spec.type == COUNTER:
                expr, unit = f"rate({m(spec.name)}[$__rate_interval])", "cps"
            elif spec.type == HISTOGRAM:
                by = ", ".join(["instance", *spec.labels, "le"])
                expr = f"histogram_quantile(0.99, sum by ({by}) (rate({m(spec.name, '_bucket')}[$__rate_interval])))"
                unit = "none"
            else:
                expr, unit = m(spec.name), "none"
            description = f"{spec.help} ({spec.type} of the {source.name} collector, from its declaration)"
            panels.append(timeseries(spec.name, description, unit, [target(expr, legend)], w=8))
    return panels


def row(title: str) -> RowPanel:
    return RowPanel(title=title, gridPos=GridPos(h=1, w=GRID_WIDTH, x=0, y=0))


def _layout(panels: Sequence[Any]) -> List[Any]:
    """Flow panels left to right, top to bottom; a row always starts a new line."""
    x, y, line_height = 0, 0, 0
    for panel in panels:
        w, h = panel.gridPos.w, panel.gridPos.h
        if x + w > GRID_WIDTH or isinstance(panel, RowPanel) and x > 0:
            x, y, line_height = 0, y + line_height, 0
        panel.gridPos = GridPos(h=h, w=w, x=x, y=y)
        x, line_height = x + w, max(line_height, h)
        if isinstance(panel, RowPanel):
            x, y, line_height = 0, y + h, 0
    return list(panels)


DEFAULT_RANGE = "now-15m"


def build(title: str, uid: str, description: str, panels: Sequence[Any],
          variables: Optional[List[Template]] = None) -> Dashboard:
    """A dashboard with the data source variable and `variables` (default: node_variables())."""
    variables = node_variables() if variables is None else variables
    return Dashboard(
        title=title, uid=uid, description=description, tags=TAGS, timezone="browser",
        templating=Templating(list=[_datasource_variable(), *variables]), panels=_layout(panels),
        schemaVersion=SCHEMA_VERSION,
        # 15 minutes: a node (or the demo) that started minutes ago fills the panels, not a
        # sliver at their right edge; zoom out for history.
        time=Time(DEFAULT_RANGE, "now"), refresh="30s", editable=True,
        links=[{"type": "dashboards", "tags": ["mps-exporter"], "asDropdown": True, "title": "MPS dashboards",
                "icon": "external link", "tooltip": "", "url": "", "targetBlank": False,
                "includeVars": True, "keepTime": True}],
    ).auto_panel_ids()
