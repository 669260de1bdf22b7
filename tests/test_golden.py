"""The golden writer (tests/support/golden.py, `make generate`) writes only a scrape in which
every collector answered: one that failed would drop its series from the golden file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.fake_pynvml import NVML_ERROR_GPU_IS_LOST
from tests.support import golden, scenarios


@pytest.mark.parametrize("check", [False, True])
def test_a_scenario_with_a_failed_collector_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str], check: bool):
    busy = scenarios.busy

    def nvml_failing(tmp: Path, logs: bool = True) -> scenarios.Scenario:
        scenario = busy(tmp, logs)
        scenario.nvml.errors["nvmlDeviceGetCount"] = NVML_ERROR_GPU_IS_LOST
        return scenario

    monkeypatch.setattr(scenarios, "busy", nvml_failing)
    target = tmp_path / "tests" / "golden" / "busy.prom"
    target.parent.mkdir(parents=True)
    target.write_text(golden.GOLDEN.read_text())
    assert golden.main(["--check"] if check else [], golden=target) == 1
    out, err = capsys.readouterr()
    assert "wrote" not in out and "stale" not in out
    assert "not writing busy.prom" in err
    assert "collector nvml failed: " in err and "GPU is lost" in err  # which one, and NVML's reason
    assert "collector control failed" not in err  # only the failed ones
    assert target.read_text() == golden.GOLDEN.read_text()


def test_the_committed_scenario_has_every_collector_answering():
    text = golden.busy_exposition()
    assert golden.failed_collectors(text) == []
    assert 'mps_exporter_collector_success{collector="nvml"} 1.0' in text
    assert golden.failed_collectors(text.replace('{collector="nvml"} 1.0', '{collector="nvml"} 0.0')) == ["nvml"]
