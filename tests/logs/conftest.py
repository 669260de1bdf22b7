"""Shared fixtures of the log pipeline tests.

The real capture lives in shared/ beside the repository (../shared from the repo
root; CI checks it out there). Tests that need it skip with a clear reason when
it is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CAPTURE = REPO.parent / "shared" / "captures" / "h200-driver580-a"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def capture_dir() -> Path:
    if not (CAPTURE / "control.log").is_file() or not (CAPTURE / "server.log").is_file():
        pytest.skip(f"real MPS capture not found at {CAPTURE} (shared/ must sit beside the clone)")
    return CAPTURE


@pytest.fixture(scope="session")
def capture_lines(capture_dir: Path) -> dict:
    """{"control": [lines], "server": [lines]} without newlines, bytes decoded as UTF-8."""
    return {f: (capture_dir / f"{f}.log").read_text(encoding="utf-8").splitlines() for f in ("control", "server")}
