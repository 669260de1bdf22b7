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
# A client of uid 1500 SIGKILLed while queued behind uid 0's server, on an H100
# (tests/gpu/reports/h100-queuedeath-run1.out, h100-queuedeath.md): the logs never say it left; its user's
# server then refuses its connection (`User did not send valid credentials`) and the
# control daemon stops answering.
QUEUE_DEATH = DATA / "captures" / "h100-queuedeath"
# Issue 24 on an H100 (tests/gpu/reports/h100-limits24.md): client limit forms, thread values,
# a process outside MPS, `set_default_client_priority 1` and `terminate_client`; whole logs.
LIMITS24 = DATA / "captures" / "h100-limits24"
# 2 x H200 (issue 38): 20 clients with CUDA_DEVICE_MAX_CONNECTIONS=8, 16 ACTIVE, 4 refused.
CEILING = DATA / "captures" / "h200x2-ceiling"
