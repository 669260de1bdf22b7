"""Fetch /metrics and look samples up by name and labels."""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from typing import Dict, List, Optional

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Sample:
    name: str
    labels: Dict[str, str]
    value: float


class Exposition:
    def __init__(self, text: str, seconds: float = 0.0, at: float = 0.0) -> None:
        self.text, self.seconds, self.at = text, seconds, at
        self.samples: List[Sample] = [Sample(s.name, dict(s.labels), s.value)
                                      for fam in text_string_to_metric_families(text) for s in fam.samples]

    def series(self, name: str, **labels: str) -> List[Sample]:
        return [s for s in self.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> Optional[float]:
        found = self.series(name, **labels)
        return found[0].value if len(found) == 1 else None

    def label_set(self, name: str, label: str, **labels: str) -> set:
        return {s.labels.get(label) for s in self.series(name, **labels)}


def scrape(url: str, timeout: float = 30.0) -> Exposition:
    start = time.perf_counter()
    at = time.time()
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read().decode()
    return Exposition(body, time.perf_counter() - start, at)
