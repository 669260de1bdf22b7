"""What the real GPU taught, pinned down on recorded data (runs without a GPU).

GPU memory used: NVML's v1 memory call counts memory the driver reserves; the v2
call and nvidia-smi do not. The capture holds both answers of one moment
(nvml_busy.json `mem`, `mem_v2`) and nvidia-smi's view a second later
(nvidia-smi-busy.txt: "13621MiB / 143771MiB"), so the exporter must report v2.
"""

from __future__ import annotations

import re

import pytest

from mps_exporter.sources.nvml import NvmlSource
from tests.fakes.fake_control import CAPTURE
from tests.fakes.fake_pynvml import FakeNvml, NVMLError, load_capture

MIB = 2**20
NVML_MEMORY_V2 = 0x02000028  # pynvml.nvmlMemory_v2
NVML_ERROR_FUNCTION_NOT_FOUND = 13


class NvmlWithMemoryV2(FakeNvml):
    """The capture's GPU, answering the memory call in v1 or v2 as the real one did."""

    nvmlMemory_v2 = NVML_MEMORY_V2
    NVML_ERROR_FUNCTION_NOT_FOUND = NVML_ERROR_FUNCTION_NOT_FOUND
    v2_missing = False

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        doc = load_capture("busy")
        if version is None:
            m = doc["mem"]["v"]
            return type("c_nvmlMemory_t", (), dict(total=m["total"], used=m["used"], free=m["free"]))
        if self.v2_missing:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        assert version == NVML_MEMORY_V2
        m = doc["mem_v2"]["v"]
        return type("c_nvmlMemory_v2_t", (), dict(total=m["total"], used=m["used"], free=m["free"],
                                                  reserved=m["reserved"]))


def smi_busy_used_mib() -> int:
    text = (CAPTURE / "nvidia-smi-busy.txt").read_text()
    return int(re.search(r"(\d+)MiB / \d+MiB", text).group(1))


def test_gpu_memory_used_is_what_nvidia_smi_shows():
    gpu = NvmlSource(NvmlWithMemoryV2.from_capture("busy")).read().gpus[0]
    assert gpu.memory_used_bytes / MIB == pytest.approx(smi_busy_used_mib(), abs=1)  # 13621 MiB
    v1 = load_capture("busy")["mem"]["v"]["used"]
    assert abs(v1 / MIB - smi_busy_used_mib()) > 600  # the reserved memory v1 would have added


def test_gpu_memory_falls_back_to_v1_where_v2_is_missing():
    nvml = NvmlWithMemoryV2.from_capture("busy")
    nvml.v2_missing = True
    gpu = NvmlSource(nvml).read().gpus[0]
    assert gpu.up and gpu.memory_used_bytes == load_capture("busy")["mem"]["v"]["used"]
