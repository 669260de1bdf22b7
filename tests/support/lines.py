"""Sample lines of a text exposition, picked by metric name and labels: what tests that
read `dump` or `/metrics` output ask of it."""

from __future__ import annotations

from typing import List


def series(text: str, name: str, **labels: str) -> List[str]:
    """The sample lines of `name` carrying every one of `labels`."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return [line for line in text.splitlines() if line.startswith(name + "{") and all(w in line for w in wanted)]


def value(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of `name` with `labels` (more or none fails)."""
    found = series(text, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return float(found[0].rsplit(" ", 1)[1])
