"""The fast text encoder must write exactly what client_python writes."""

from prometheus_client.exposition import generate_latest

from mps_exporter.collector import build_registry
from mps_exporter.exposition import generate_text
from mps_exporter.families import FamilyBuilder
from tests.support import scenarios


class Frozen:
    """One collection, served twice (durations differ between collections)."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def test_identical_to_client_python_on_48_clients(tmp_path):
    registry = build_registry(scenarios.synthetic(tmp_path, gpus=8, clients_per_gpu=6).collector())
    frozen = Frozen(list(registry.collect()))
    assert generate_text(frozen) == generate_latest(frozen)


def test_identical_with_awkward_label_values_counters_and_histograms():
    class Fixed:
        def collect(self):
            out = FamilyBuilder()
            out.add("mps_client_info", 1, daemon="d", server_pid="1", pid="2", uid="0", user='we"ird\\user',
                    command="a\nb", namespace="", container_id="", pod_uid="")
            out.add("mps_server_starts_total", 3, daemon="d")
            out.add_histogram("mps_client_queue_wait_seconds", [(0.05, 0), (1, 2), (float("inf"), 3)], 12.9,
                              daemon="d", reason="user_switch")
            out.add("mps_gpu_power_watts", float("inf"), gpu="0", uuid="u")
            return out.families()

    assert generate_text(Fixed()) == generate_latest(Fixed())
