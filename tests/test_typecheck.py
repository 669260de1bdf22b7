"""`mypy --strict exporter alerts dashboards` (make lint) checks the generators' use of the
package against its real types: mypy finds `mps_exporter` (typecheck/ links it to exporter/),
and no override turns its names into `Any`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_mypy_resolves_mps_exporter_to_the_package_and_ignores_none_of_it():
    import tomllib

    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    link = ROOT / mypy["mypy_path"] / "mps_exporter"
    assert link.resolve() == (ROOT / "exporter").resolve()
    for override in mypy.get("overrides", []):
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        assert not any(m.split(".")[0] == "mps_exporter" for m in modules), override
