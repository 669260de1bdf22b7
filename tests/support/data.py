"""Where the recorded data the tests, fakes and benchmarks rely on lives: inside the repository.

A missing file here is a broken checkout, so tests that need it fail (they never skip).
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
# The real MPS session recorded on an H200 (driver 580, CUDA 13); its README says what happened when.
CAPTURE = DATA / "captures" / "h200-driver580-a"
