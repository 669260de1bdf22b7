"""Write dashboards/json/<name>.json (and the Helm chart's copy) from every
dashboards/<name>.dashboard.py.

    python3 -m dashboards.generate            # write
    python3 -m dashboards.generate --check    # exit 1 if a committed file is stale
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from alerts.generate import generator_main

HERE = Path(__file__).resolve().parent
JSON_DIR = "dashboards/json"
HELM_DIR = "deploy/helm/mps-exporter/files/dashboards"


def sources() -> Dict[str, Path]:
    """Dashboard name -> its .dashboard.py file."""
    return {p.name[: -len(".dashboard.py")]: p for p in sorted(HERE.glob("*.dashboard.py"))}


def load(path: Path) -> Any:
    """The `dashboard` object a .dashboard.py file defines."""
    spec = importlib.util.spec_from_file_location(f"dashboards.{path.stem.replace('.', '_').replace('-', '_')}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dashboard


def _drop_nulls(value: Any) -> Any:
    """grafanalib writes every optional field, unset ones as null; Grafana's model
    has them optional (absent = default) and not nullable. A threshold step's
    `value` stays: null there means -Infinity."""
    if isinstance(value, dict):
        step = "color" in value
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None or (step and k == "value")}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def model(path: Path) -> Dict[str, Any]:
    """The dashboard's JSON model as plain data."""
    # grafanalib's objects turn into plain data through their public to_json_data().
    data: Dict[str, Any] = _drop_nulls(json.loads(json.dumps(load(path).to_json_data(),
                                                             default=lambda o: o.to_json_data())))
    return data


def outputs() -> Dict[str, str]:
    files = {}
    for name, path in sources().items():
        text = json.dumps(model(path), sort_keys=True, indent=2) + "\n"
        files[f"{JSON_DIR}/{name}.json"] = text
        files[f"{HELM_DIR}/{name}.json"] = text
    return files


def main(argv: Optional[List[str]] = None) -> int:
    return generator_main(outputs, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
