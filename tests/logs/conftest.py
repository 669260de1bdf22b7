"""Shared fixtures of the log pipeline tests.

The real capture lives in tests/data/captures/ (tests/support/data.py); a test
that needs it fails when it is missing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.data import CAPTURE

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def capture_dir() -> Path:
    for name in ("control.log", "server.log"):
        assert (CAPTURE / name).is_file(), f"recorded MPS log {CAPTURE / name} is missing from the checkout"
    return CAPTURE


@pytest.fixture(scope="session")
def capture_lines(capture_dir: Path) -> dict:
    """{"control": [lines], "server": [lines]} without newlines, bytes decoded as UTF-8."""
    return {f: (capture_dir / f"{f}.log").read_text(encoding="utf-8").splitlines() for f in ("control", "server")}
