"""The Helm chart: lint and render with Helm's own engine, every object against the
Kubernetes or CRD schemas, and what each values variant must change."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from tests.deploy.helpers import CHART, KUBERNETES_VERSION, ROOT, ci_values_files, find, load_yaml, one, render, validate_object

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (test extra) bundles Helm's engine")

VARIANTS = [None] + ci_values_files()


def _variant_id(path):
    return "default" if path is None else os.path.basename(path)


def _values(path):
    return None if path is None else load_yaml(path)


def _container(objects):
    return one(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]


def _daemon_config(objects):
    """The text of the exporter's --config.file (the ConfigMap that is no dashboard)."""
    (text,) = [o["data"]["config.yml"] for o in find(objects, "ConfigMap") if "config.yml" in o.get("data", {})]
    return text


def _pod(objects):
    return one(objects, "DaemonSet")["spec"]["template"]["spec"]


def _rules_source():
    path = os.path.join(ROOT, "alerts", "prometheus", "mps-exporter.rules.yml")
    return load_yaml(path) if os.path.exists(path) else None


def _chart_dashboards():
    folder = os.path.join(CHART, "files", "dashboards")
    return sorted(f for f in os.listdir(folder) if f.endswith(".json")) if os.path.isdir(folder) else []


def test_ci_variants_exist():
    names = {os.path.basename(p) for p in ci_values_files()}
    assert {"operator-values.yaml", "webconfig-values.yaml", "nonroot-values.yaml",
            "hostdriver-values.yaml", "multi-daemon-values.yaml", "kubelet-values.yaml"} <= names


@pytest.mark.parametrize("values_file", VARIANTS, ids=_variant_id)
def test_lint_is_clean(values_file):
    report = helm.lint(CHART, _values(values_file), strict=True, kube_version=f"v{KUBERNETES_VERSION}")
    # Severity 1 is "info" (e.g. "icon is recommended"); warnings and errors fail.
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert problems == []


@pytest.mark.parametrize("values_file", VARIANTS, ids=_variant_id)
def test_every_rendered_object_is_valid(values_file):
    objects = render(_values(values_file))
    assert {"DaemonSet", "ConfigMap", "ServiceAccount"} <= {o["kind"] for o in objects}
    problems = [p for obj in objects for p in validate_object(obj)]
    assert problems == []


def test_validation_catches_a_broken_object(default_objects):
    # Guards the check above: a misspelt field must not pass.
    daemonset = json.loads(json.dumps(one(default_objects, "DaemonSet")))
    daemonset["spec"]["template"]["spec"]["hostPid"] = True
    assert validate_object(daemonset)
    monitor = one(render(load_yaml(os.path.join(CHART, "ci", "operator-values.yaml"))), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    assert any("intervall" in p for p in validate_object(monitor))


def test_default_daemonset_least_privilege(default_objects):
    pod = _pod(default_objects)
    container = _container(default_objects)
    assert pod["hostPID"] is True
    assert pod.get("hostNetwork") is not True
    assert pod["automountServiceAccountToken"] is False
    assert pod["runtimeClassName"] == "nvidia"
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["privileged"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    # Issue 43: requests and a memory limit by default, and dcgm-exporter's priority class.
    assert container["resources"] == {"requests": {"cpu": "50m", "memory": "96Mi"}, "limits": {"memory": "256Mi"}}
    assert pod["priorityClassName"] == "system-node-critical"
    assert "--web.disable-exporter-metrics" not in container["args"]
    # The MPS directories are read-only; only the state and /tmp volumes are writable.
    mps_volumes = {v["name"] for v in pod["volumes"] if "hostPath" in v and v["name"] != "state"}
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert all(m.get("readOnly") for m in container["volumeMounts"] if m["name"] in mps_volumes)
    assert writable == {"/var/lib/mps-exporter", "/tmp"}


def test_default_reads_pod_names_from_the_runtimes_files_read_only(default_objects):
    """containerd's and CRI-O's OCI bundles, each mounted read-only at its own path and
    passed as --path.runtime-root; no token, no RBAC, no kubelet (issue 31)."""
    pod, container = _pod(default_objects), _container(default_objects)
    roots = ["/run/containerd/io.containerd.runtime.v2.task/k8s.io", "/run/containers/storage/overlay-containers"]
    assert [a.split("=", 1)[1] for a in container["args"] if a.startswith("--path.runtime-root=")] == roots
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for root in roots:
        assert mounts[root]["readOnly"] is True and "mountPropagation" not in mounts[root]
        assert volumes[mounts[root]["name"]]["hostPath"]["path"] == root
    assert not any(a.startswith("--kubelet.") for a in container["args"])
    assert not find(default_objects, "ClusterRole") and pod["automountServiceAccountToken"] is False


def test_servicemonitor_honours_the_exporters_pod_labels():
    monitor = one(render(load_yaml(os.path.join(CHART, "ci", "operator-values.yaml"))), "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


def test_kubelet_variant_asks_for_nodes_pods_only():
    objects = render(load_yaml(os.path.join(CHART, "ci", "kubelet-values.yaml")))
    pod, container = _pod(objects), _container(objects)
    assert pod["automountServiceAccountToken"] is True
    assert "--kubelet.url=https://$(NODE_IP):10250" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    (role,) = find(objects, "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes/pods"], "verbs": ["get"]}]
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]


def test_default_keeps_the_state_file_on_the_node(default_objects):
    """A pod re-created on the node (upgrade, drain, reboot) finds the state file of the
    one before it: the state volume is a host directory of this release, not an emptyDir."""
    pod, container = _pod(default_objects), _container(default_objects)
    state = next(v for v in pod["volumes"] if v["name"] == "state")
    assert state == {"name": "state", "hostPath": {"path": "/var/lib/mps-exporter/mps-exporter",
                                                     "type": "DirectoryOrCreate"}}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "state")
    assert mount["mountPath"] == "/var/lib/mps-exporter" and not mount.get("readOnly")
    assert "--mps.state-file=/var/lib/mps-exporter/state.json" in container["args"]
    # Another release on the same node keeps its own file.
    other = generator_render({}, release="mps-exporter-b")
    other_state = next(v for v in _pod(other)["volumes"] if v["name"] == "state")
    assert other_state["hostPath"]["path"] == "/var/lib/mps-exporter/mps-exporter-b"
    # And the plain manifests are the chart's default.
    manifests = load_yaml_all(os.path.join(ROOT, "deploy", "kubernetes", "mps-exporter.yaml"))
    daemonset = next(o for o in manifests if o["kind"] == "DaemonSet")
    assert next(v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == "state") == state


def test_state_on_an_emptydir_where_asked():
    objects = render({"state": {"hostPath": ""}})
    assert next(v for v in _pod(objects)["volumes"] if v["name"] == "state") == {"name": "state", "emptyDir": {}}
    nonroot = render(load_yaml(os.path.join(CHART, "ci", "nonroot-values.yaml")))
    assert next(v for v in _pod(nonroot)["volumes"] if v["name"] == "state") == {"name": "state", "emptyDir": {}}


def generator_render(values, release):
    from tests.deploy.helpers import generator

    gen = generator()
    return gen.objects(gen.render_chart(values, release=release, namespace="monitoring"))


def load_yaml_all(path):
    import yaml

    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def test_default_watches_the_device_plugin_layout(default_objects):
    config = load_yaml_text(_daemon_config(default_objects))
    assert config == {"daemons": [{
        "name": "nvidia.com/gpu",
        "pipe_directory": "/run/nvidia/mps/nvidia.com/gpu/pipe",
        "log_directory": "/run/nvidia/mps/nvidia.com/gpu/log",
    }]}
    pod = _pod(default_objects)
    host_paths = [v["hostPath"]["path"] for v in pod["volumes"] if v["name"].startswith("mps-")]
    assert host_paths == ["/run/nvidia/mps"]
    assert pod["nodeSelector"] == {"nvidia.com/mps.capable": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def load_yaml_text(text):
    import yaml

    return yaml.safe_load(text)


@pytest.mark.parametrize("values_file", VARIANTS, ids=_variant_id)
def test_exporter_accepts_the_rendered_flags_and_config(values_file, tmp_path):
    """The container's args and config file go through the exporter's own parser."""
    from mps_exporter import cli as exporter_config

    objects = render(_values(values_file))
    config_file = tmp_path / "config.yml"
    config_file.write_text(_daemon_config(objects))
    args = []
    for arg in _container(objects)["args"]:
        if arg.startswith("--config.file="):
            arg = f"--config.file={config_file}"
        if arg.startswith("--web.config.file="):
            continue  # its Secret is checked in test_web_config_variant
        args.append(arg)
    command, cfg = exporter_config.parse_args(args)
    assert command == "serve"
    assert cfg.listen_address == ":10138"
    assert cfg.state_file == "/var/lib/mps-exporter/state.json"
    daemons = load_yaml_text(config_file.read_text())["daemons"]
    assert [d.name for d in cfg.daemons] == [d["name"] for d in daemons]


@pytest.mark.parametrize("values, resources, priority", [
    ({"resources": None, "priorityClassName": ""}, None, None),
    ({"resources": {"limits": None}}, {"requests": {"cpu": "50m", "memory": "96Mi"}}, "system-node-critical"),
    ({"resources": {"requests": {"memory": "128Mi"}, "limits": {"memory": "512Mi", "cpu": 1}}},
     {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "512Mi", "cpu": 1}}, "system-node-critical"),
    ({"priorityClassName": "gpu-monitoring"}, {"requests": {"cpu": "50m", "memory": "96Mi"},
                                               "limits": {"memory": "256Mi"}}, "gpu-monitoring"),
])
def test_resources_and_priority_class_are_overridable(values, resources, priority):
    objects = render(values)
    assert _container(objects).get("resources") == resources
    assert _pod(objects).get("priorityClassName") == priority


def test_disable_exporter_metrics_value_passes_the_flag():
    assert "--web.disable-exporter-metrics" in _container(render({"disableExporterMetrics": True}))["args"]


def test_multi_daemon_variant_mounts_each_outside_directory():
    values = load_yaml(os.path.join(CHART, "ci", "multi-daemon-values.yaml"))
    objects = render(values)
    daemons = load_yaml_text(_daemon_config(objects))["daemons"]
    assert [d["name"] for d in daemons] == ["nvidia.com/gpu", "nvidia.com/gpu.shared", "batch"]
    assert daemons[1]["pipe_directory"] == "/run/nvidia/mps/nvidia.com/gpu.shared/pipe"
    pod, container = _pod(objects), _container(objects)
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    # The root covers both device-plugin daemons; the manual one needs two mounts.
    assert sorted(p for n, p in host.items() if n.startswith("mps-")) == sorted(
        ["/run/nvidia/mps", "/var/run/mps-batch/pipe", "/var/log/mps-batch"])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    for name, path in host.items():
        if name.startswith("mps-"):
            assert mounts[name]["mountPath"] == path and mounts[name]["readOnly"] is True
    assert host["state"] == "/var/lib/mps-exporter/mps-exporter"
    assert container["image"].endswith("@" + values["image"]["digest"])
    assert "--no-collector.dcgm" in container["args"] and "--collector.logs" in container["args"]
    assert "--mps.command-timeout=3" in container["args"]
    assert container["resources"] == values["resources"]


def test_nonroot_variant_has_no_capabilities():
    objects = render(load_yaml(os.path.join(CHART, "ci", "nonroot-values.yaml")))
    ctx = _container(objects)["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 65534
    assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add")
    assert "runtimeClassName" not in _pod(objects)


def test_hostdriver_variant_mounts_only_the_driver_files():
    objects = render(load_yaml(os.path.join(CHART, "ci", "hostdriver-values.yaml")))
    pod, container = _pod(objects), _container(objects)
    assert "runtimeClassName" not in pod
    files = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in pod["volumes"] if "hostPath" in v}
    assert files["/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"] == "File"
    assert files["/run/nvidia/driver/usr/bin/nvidia-cuda-mps-control"] == "File"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env == {"LD_LIBRARY_PATH": "/opt/nvidia/lib", "NVIDIA_VISIBLE_DEVICES": "void"}
    assert "--mps.control-binary=/opt/nvidia/bin/nvidia-cuda-mps-control" in container["args"]
    # Device nodes of a GPU the pod was not allocated: only a privileged container opens them.
    assert container["securityContext"]["privileged"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_web_config_variant(tmp_path):
    from mps_exporter.httpd.webconfig import parse_web_config
    from tests.support.certs import make_tls_files

    objects = render(load_yaml(os.path.join(CHART, "ci", "webconfig-values.yaml")))
    container = _container(objects)
    assert "--web.config.file=/etc/mps-exporter/web/web-config.yml" in container["args"]
    # Basic auth would fail HTTP probes with 401.
    assert "tcpSocket" in container["livenessProbe"] and "tcpSocket" in container["readinessProbe"]
    secret = one(objects, "Secret")
    web_config = load_yaml_text(secret["stringData"]["web-config.yml"])
    volumes = {v["name"]: v for v in _pod(objects)["volumes"]}
    assert volumes["web-config"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert volumes["tls"]["secret"]["secretName"] == "mps-exporter-tls"
    # The exporter accepts the configuration once the certificate files exist.
    tls = make_tls_files(str(tmp_path))
    web_config["tls_server_config"].update(cert_file=tls.server_cert, key_file=tls.server_key)
    parsed = parse_web_config(web_config, str(tmp_path))
    assert parsed.tls is not None
    endpoint = one(objects, "ServiceMonitor")["spec"]["endpoints"][0]
    assert endpoint["scheme"] == "https"
    assert endpoint["basicAuth"]["username"]["name"] == "mps-exporter-scrape"


def test_operator_variant_objects():
    values = load_yaml(os.path.join(CHART, "ci", "operator-values.yaml"))
    objects = render(values)
    namespace = one(objects, "Namespace")
    assert namespace["metadata"]["name"] == "gpu-monitoring"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert {o["metadata"]["namespace"] for o in objects if o["kind"] != "Namespace" and
            not (o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("mps-exporter-dashboard-"))} \
        == {"gpu-monitoring"}
    monitor = one(objects, "ServiceMonitor")
    service = one(objects, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The ServiceMonitor selects the Service, whose port name it scrapes.
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert [r["targetLabel"] for r in monitor["spec"]["endpoints"][0]["relabelings"][:2]] == ["node", "instance"]
    # The alert rules select job="mps-exporter": the job comes from the Service label
    # that jobLabel names.
    job_label = monitor["spec"]["jobLabel"]
    assert service["metadata"]["labels"][job_label] == "mps-exporter"
    if _rules_source() is not None:
        exprs = [r["expr"] for g in _rules_source()["groups"] for r in g["rules"]]
        assert any('job="mps-exporter"' in e for e in exprs)


def test_prometheus_rule_carries_the_generated_rules():
    source = _rules_source()
    assert source is not None, "alerts/prometheus/mps-exporter.rules.yml is missing: run make generate"
    packaged = os.path.join(CHART, "files", "rules", "mps-exporter.rules.yml")
    assert os.path.exists(packaged), "chart's files/rules/ lacks the generated rule file"
    assert load_yaml(packaged) == source, "chart's copy of the rules differs from alerts/prometheus"
    objects = render(load_yaml(os.path.join(CHART, "ci", "operator-values.yaml")))
    rule = one(objects, "PrometheusRule")
    assert rule["spec"]["groups"] == source["groups"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_prometheus_rule_off_by_default(default_objects):
    assert find(default_objects, "PrometheusRule") == []
    assert find(default_objects, "ServiceMonitor") == []


def test_dashboards_become_sidecar_configmaps():
    files = _chart_dashboards()
    assert files, "the chart's files/dashboards holds no dashboard: run make generate"
    objects = render(load_yaml(os.path.join(CHART, "ci", "operator-values.yaml")))
    maps = [o for o in find(objects, "ConfigMap") if o["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert sorted(k for m in maps for k in m["data"]) == files
    for m in maps:
        assert m["metadata"]["namespace"] == "monitoring"
        assert m["metadata"]["annotations"]["grafana_folder"] == "MPS"
        (name, text), = m["data"].items()
        with open(os.path.join(CHART, "files", "dashboards", name), encoding="utf-8") as f:
            assert json.loads(text) == json.load(f)
    source = os.path.join(ROOT, "dashboards", "json")
    if os.path.isdir(source):
        for name in files:
            with open(os.path.join(source, name), encoding="utf-8") as a, \
                    open(os.path.join(CHART, "files", "dashboards", name), encoding="utf-8") as b:
                assert json.load(a) == json.load(b), f"chart's copy of {name} differs from dashboards/json"


@pytest.mark.parametrize("values, message", [
    ({"mps": {"daemons": [{"name": "x"}]}}, "oneOf"),
    ({"mps": {"daemons": [{"name": "x", "resource": "nvidia.com/gpu", "pipeDirectory": "/p"}]}}, "oneOf"),
    ({"image": {"repository": "r", "digest": "latest"}}, "digest"),
    ({"logLevel": "verbose"}, "logLevel"),
    ({"clientGranularity": "pid"}, "clientGranularity"),
    ({"serviceMonitor": {"interval": "30 seconds"}}, "interval"),
    ({"colectors": {}}, "colectors"),
    ({"podNames": {"runtimeRoots": ["run/containerd"]}}, "runtimeRoots"),
    ({"podNames": {"kubelet": {"port": 0}}}, "port"),
    ({"resources": {"limits": {"memory": "256 MB"}}}, "memory"),
    ({"resources": {"request": {"cpu": "50m"}}}, "request"),
    ({"disableExporterMetrics": "yes"}, "disableExporterMetrics"),
])
def test_schema_rejects_bad_values(values, message):
    with pytest.raises(helm.HelmValuesError, match=message):
        render(values)


@pytest.mark.parametrize("values, message", [
    ({"serviceMonitor": {"enabled": True}, "service": {"enabled": False}}, "needs service.enabled"),
    ({"webConfig": {"enabled": True}}, "needs webConfig.config or webConfig.existingSecret"),
    ({"mps": {"root": "", "daemons": [{"name": "a", "resource": "nvidia.com/gpu"}]}}, "needs mps.root"),
])
def test_inconsistent_values_fail_with_a_message(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_existing_web_config_secret_is_used_not_created():
    objects = render({"webConfig": {"enabled": True, "existingSecret": "my-web-config"}})
    assert find(objects, "Secret") == []
    volumes = {v["name"]: v for v in _pod(objects)["volumes"]}
    assert volumes["web-config"]["secret"]["secretName"] == "my-web-config"
    # Plain HTTP (the chart cannot see inside that Secret); probes still avoid auth.
    assert "tcpSocket" in _container(objects)["livenessProbe"]


def test_args_are_single_tokens(default_objects):
    # No arg may need a shell: each is one flag=value.
    for arg in _container(default_objects)["args"]:
        assert shlex.split(arg) == [arg]


@pytest.mark.parametrize("switches, roots, mounts", [
    ({"devicePlugin": True}, [{"layout": "device-plugin", "root": "/run/nvidia/mps"}], ["/run/nvidia/mps"]),
    ({"dra": True}, [{"layout": "dra", "root": "/var/lib/kubelet/plugins"}],
     ["/run/nvidia/mps", "/var/lib/kubelet/plugins/gpu.nvidia.com/mps"]),
    ({"devicePlugin": True, "dra": True, "draPluginsDirectory": "/var/lib/k0s/kubelet/plugins"},
     [{"layout": "device-plugin", "root": "/run/nvidia/mps"}, {"layout": "dra", "root": "/var/lib/k0s/kubelet/plugins"}],
     ["/run/nvidia/mps", "/var/lib/k0s/kubelet/plugins/gpu.nvidia.com/mps"]),
])
def test_discovery_switch_per_layout(switches, roots, mounts, tmp_path):
    """Each layout's switch: its root in the config file, its host directory mounted
    read-only (the DRA one without propagation), and the exporter accepts both."""
    from mps_exporter import cli as exporter_config
    from mps_exporter.config import DiscoveryRoot

    objects = render({"mps": {"daemons": [], "discover": {**switches, "interval": 2}}})
    config = load_yaml_text(_daemon_config(objects))
    assert config == {"daemons": [], "discover": roots}
    pod, container = _pod(objects), _container(objects)
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]
            if "hostPath" in v and v["name"].startswith("mps-") and v["name"] != "mps-control-binary"}
    assert sorted(host.values()) == sorted(mounts)
    by_name = {m["name"]: m for m in container["volumeMounts"]}
    for name, path in host.items():
        assert by_name[name]["mountPath"] == path and by_name[name]["readOnly"] is True
        assert ("mountPropagation" in by_name[name]) == (not path.endswith("/gpu.nvidia.com/mps"))
    assert "--mps.discover-interval=2" in container["args"]
    for obj in objects:
        assert validate_object(obj) == [], obj["kind"]
    config_file = tmp_path / "config.yml"
    config_file.write_text(_daemon_config(objects))
    args = [f"--config.file={config_file}" if a.startswith("--config.file=") else a for a in container["args"]]
    _, cfg = exporter_config.parse_args(args)
    assert cfg.daemons == [] and cfg.discovery_interval == 2
    assert cfg.discover == [DiscoveryRoot(r["layout"], r["root"]) for r in roots]


def test_no_daemon_and_no_discovery_fails_with_a_message():
    with pytest.raises(helm.HelmError, match="mps.daemons is empty"):
        render({"mps": {"daemons": []}})
