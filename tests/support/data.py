"""Where the recorded data the tests, fakes and benchmarks rely on lives: inside the repository.

A missing file here is a broken checkout, so tests that need it fail (they never skip).
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
# The real MPS session recorded on an H200 (driver 580, CUDA 13); its README says what happened when.
CAPTURE = DATA / "captures" / "h200-driver580-a"
# The first H100 run of issue 11 (tests/gpu/reports/h100-edges-run1.md): 52 clients (4 refused at
# MPS's client limit of 48), a server limit changed under a connected client, a server
# SIGKILLed under its client; whole control.log and server.log, and client outputs.
EDGES = DATA / "captures" / "h100-edges"
