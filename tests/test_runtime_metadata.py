"""Pod names from the node: containerd's and CRI-O's OCI specs (real format,
tests/data/runtime), the kubelet's /pods as the fallback, the cache and its bounds;
and the names on every client series of a containerd and a CRI-O client."""

import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mps_exporter import runtime_metadata as rm
from tests.fakes.fake_procfs import FakeProcess, write_proc
from tests.fakes.fake_runtime import (CONTAINERD_ID, CONTAINERD_ROOT, CONTAINERD_SANDBOX_ID, CRIO_ID, CRIO_ROOT,
                                      RUNTIME_DATA)
from tests.support import scenarios

TRAINER = rm.PodNames("ml-team", "trainer-7d9c6b5f4-x2k8p", "trainer")
SERVER = rm.PodNames("serving", "inference-0", "server")
KUBELET_PODS = (RUNTIME_DATA / "kubelet-pods.json").read_text()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_containerd_spec_names_pod_and_container():
    assert rm.parse_oci_spec((CONTAINERD_ROOT / CONTAINERD_ID / "config.json").read_text()) == TRAINER


def test_crio_spec_names_pod_and_container():
    assert rm.parse_oci_spec((CRIO_ROOT / CRIO_ID / "userdata" / "config.json").read_text()) == SERVER


def test_a_sandbox_spec_names_the_pod_but_no_container():
    assert rm.parse_oci_spec((CONTAINERD_ROOT / CONTAINERD_SANDBOX_ID / "config.json").read_text()) == rm.PodNames(
        "ml-team", "trainer-7d9c6b5f4-x2k8p", "")


@pytest.mark.parametrize("text", ["", "[1, 2]", "{not json", '"a string"'])
def test_a_spec_that_is_not_one_is_an_error(text):
    with pytest.raises(ValueError):
        rm.parse_oci_spec(text)


def test_a_spec_without_kubernetes_annotations_names_nothing():
    assert rm.parse_oci_spec('{"ociVersion": "1.1.0", "annotations": {"org.opencontainers.image.ref.name": "x"}}') \
        == rm.NO_NAMES
    assert rm.parse_oci_spec('{"ociVersion": "1.1.0"}') == rm.NO_NAMES


def test_kubelet_pods_name_every_container_by_bare_id():
    names = rm.parse_kubelet_pods(KUBELET_PODS)
    assert names[CONTAINERD_ID] == TRAINER
    assert names[CRIO_ID] == SERVER
    assert names["2e4a6c8b0d1f3a5c7e9b1d3f5a7c9e1b3d5f7a9c1e3b5d7f9a1c3e5b7d9f1a3c"] == rm.PodNames(
        "ml-team", "trainer-7d9c6b5f4-x2k8p", "fetch-weights")  # an init container
    assert len(names) == 4  # the pending pod's container has no id yet


@pytest.mark.parametrize("text", ['{"kind": "Status"}', "[]", "<html>"])
def test_kubelet_answer_that_is_no_podlist_is_an_error(text):
    with pytest.raises(ValueError):
        rm.parse_kubelet_pods(text)


def test_lookup_reads_both_runtimes_once_per_container(tmp_path):
    roots = [tmp_path / "containerd", tmp_path / "crio"]
    shutil.copytree(CONTAINERD_ROOT, roots[0])
    shutil.copytree(CRIO_ROOT, roots[1])
    lookup = rm.PodNameLookup(roots=[str(r) for r in roots])
    assert lookup.names(CONTAINERD_ID) == TRAINER
    assert lookup.names(CRIO_ID) == SERVER
    shutil.rmtree(roots[0])
    shutil.rmtree(roots[1])
    assert (lookup.names(CONTAINERD_ID), lookup.names(CRIO_ID)) == (TRAINER, SERVER)  # cached: no file read
    assert lookup.cached() == (2, 0)


def test_lookup_is_bounded_least_recently_used_first_out(tmp_path):
    from tests.fakes.fake_runtime import write_containerd_spec
    ids = [f"{i:064x}" for i in range(5)]
    for i, cid in enumerate(ids):
        write_containerd_spec(tmp_path, cid, "ns", f"pod-{i}", "c")
    lookup = rm.PodNameLookup(roots=[str(tmp_path)], max_entries=3)
    for cid in ids:
        lookup.names(cid)
    assert lookup.cached() == (3, 0)
    for cid in ids:
        lookup.names(f"{int(cid, 16) + 100:064x}")  # unknown ids: misses are bounded too
    assert lookup.cached() == (3, 3)


def test_ids_that_could_name_a_path_are_never_looked_up(tmp_path):
    lookup = rm.PodNameLookup(roots=[str(tmp_path)])
    for bad in ("../../etc", "", "A" * 64, "/" + "a" * 63):
        assert lookup.names(bad) == rm.NO_NAMES
    assert lookup.cached() == (0, 0)


def test_a_broken_spec_is_logged_once_and_costs_nothing_else(tmp_path, caplog):
    for cid in ("a" * 64, "b" * 64):
        (tmp_path / cid).mkdir()
        (tmp_path / cid / "config.json").write_text("{truncated")
    lookup = rm.PodNameLookup(roots=[str(tmp_path)])
    assert lookup.names("a" * 64) == lookup.names("b" * 64) == rm.NO_NAMES
    assert len([r for r in caplog.records if "cannot read container names" in r.message]) == 1


def test_kubelet_is_asked_for_new_ids_at_most_once_per_interval():
    asked = []
    clock = Clock()

    def kubelet() -> str:
        asked.append(clock.now)
        return KUBELET_PODS

    lookup = rm.PodNameLookup(roots=(), kubelet=kubelet, clock=clock)
    assert lookup.names(CONTAINERD_ID) == TRAINER
    assert lookup.names(CRIO_ID) == SERVER  # in the same answer: not asked again
    unknown = "e" * 64
    assert lookup.names(unknown) == rm.NO_NAMES
    assert len(asked) == 1  # within KUBELET_MIN_INTERVAL of the last question
    clock.now += rm.MISS_RETRY_SECONDS - 1
    assert lookup.names(unknown) == rm.NO_NAMES and len(asked) == 1  # a miss is not retried yet
    clock.now += rm.KUBELET_MIN_INTERVAL
    assert lookup.names(unknown) == rm.NO_NAMES and len(asked) == 2


def test_a_failing_kubelet_costs_only_the_names(caplog):
    def kubelet() -> str:
        raise OSError("connection refused")

    lookup = rm.PodNameLookup(roots=(), kubelet=kubelet, clock=Clock())
    assert lookup.names(CONTAINERD_ID) == rm.NO_NAMES
    assert "connection refused" in caplog.text


def test_the_kubelet_is_asked_with_the_service_account_token(tmp_path):
    """A fake kubelet answering real-format /pods only to the right bearer token."""
    seen = []

    class Kubelet(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            seen.append((self.path, self.headers.get("Authorization")))
            ok = self.headers.get("Authorization") == "Bearer sa-token"
            body = KUBELET_PODS.encode() if ok else b'{"kind":"Status","code":403}'
            self.send_response(200 if ok else 403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Kubelet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        token = tmp_path / "token"
        token.write_text("sa-token\n")
        lookup = rm.PodNameLookup(roots=(), kubelet=rm.kubelet_fetcher(url, str(token)), clock=Clock())
        assert lookup.names(CRIO_ID) == SERVER
        token.write_text("wrong")
        denied = rm.PodNameLookup(roots=(), kubelet=rm.kubelet_fetcher(url, str(token)), clock=Clock())
        assert denied.names(CRIO_ID) == rm.NO_NAMES  # 403: logged, no names
    finally:
        server.shutdown()
        server.server_close()
    assert seen[0] == ("/pods", "Bearer sa-token")


# ------------------------------------------------------------ on the series
def test_containerd_and_crio_clients_carry_their_names_on_every_client_series(tmp_path):
    """No network, no credentials: the runtimes' files alone."""
    scen = scenarios.busy(tmp_path, logs=False)
    write_proc(scen.proc_root, [
        FakeProcess(1647, uid=0, start_ticks=2000,
                    cgroup="0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod5a6b7c8d_9e0f_4a1b_"
                           f"8c2d_3e4f5a6b7c8d.slice/crio-{CRIO_ID}.scope\n"),
    ])
    families = list(scen.collector().collect())
    client_series = [(f.name, s.labels) for f in families for s in f.samples if f.name.startswith("mps_client_")
                     and f.name != "mps_client_exits_at_memory_limit"]  # counted per daemon and GPU, no pid
    by_pid = {}
    for name, labels in client_series:
        by_pid.setdefault(labels["pid"], set()).add((name, labels["namespace"], labels["pod"], labels["container"]))
    assert {(n, p, c) for _, n, p, c in by_pid["1648"]} == {("ml-team", "trainer-7d9c6b5f4-x2k8p", "trainer")}
    assert {(n, p, c) for _, n, p, c in by_pid["1647"]} == {("serving", "inference-0", "server")}
    assert {(n, p, c) for _, n, p, c in by_pid["1649"]} == {("", "", "")}  # a process in no pod
    assert {name for name, *_ in by_pid["1648"]} >= {"mps_client_info", "mps_client_memory_used_bytes",
                                                      "mps_client_active_thread_ratio", "mps_client_start_time_seconds"}
    info = next(labels for name, labels in client_series if name == "mps_client_info" and labels["pid"] == "1648")
    assert (info["pod_uid"], info["container_id"]) == (scenarios.POD_UID, CONTAINERD_ID)


def test_pod_granularity_series_carry_namespace_and_pod(tmp_path):
    scen = scenarios.synthetic(tmp_path, gpus=2, clients_per_gpu=3, clients_per_pod=2)
    scen.cfg.client_granularity = "pod"
    families = list(scen.collector().collect())
    pods = {(s.labels["pod_uid"], s.labels["namespace"], s.labels["pod"]) for f in families for s in f.samples
            if f.name.startswith("mps_pod_")}
    uids = {uid for uid, _ in scen.pods.values()}
    assert {uid for uid, _, _ in pods} == uids | {""}
    assert ("", "", "") in pods  # the bare process
    assert {ns for uid, ns, _ in pods if uid} == {scenarios.SYNTHETIC_NAMESPACE}
    assert len({pod for uid, _, pod in pods if uid}) == len(uids)
