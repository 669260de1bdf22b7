"""Issue 43: CI runs the suite under Debian's own Python (/usr/bin/python3, the python3
package: 3.11.2 on Debian 12, whose ssl module refuses X25519), not whatever `python3`
comes first on PATH (a pyenv or a newer build accepts X25519 and hides the difference)."""

from __future__ import annotations

import re
from pathlib import Path

CI = Path(__file__).resolve().parents[1] / ".ci" / "run"


def test_ci_makes_its_venv_with_debians_python():
    lines = [line.strip() for line in CI.read_text().splitlines() if not line.strip().startswith("#")]
    venvs = [line for line in lines if re.search(r"-m venv\b", line)]
    assert venvs and all(line.startswith("/usr/bin/python3 -m venv") for line in venvs), venvs
    # Everything after it runs in that venv.
    activate = next(i for i, line in enumerate(lines) if line.startswith(". ") and "/.venv/bin/activate" in line)
    assert lines.index(venvs[0]) < activate < next(i for i, line in enumerate(lines) if "pytest" in line)
