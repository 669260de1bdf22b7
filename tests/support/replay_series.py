"""The series a Prometheus scraping `mps-exporter replay` (the shipped demo session, in a
loop, on the present clock) would store, computed without waiting: the real player,
collector and log pipeline stepped on a clock the caller sets, one exposition per
scrape. Written as `promtool test rules` input series (tests/alerts/test_replay_quiet.py)
or as a timestamped exposition for VictoriaMetrics' import API.

The replay's present is 0, the time at which promtool's rule tests start, so
`time()`, `timestamp()` and the exporter's timestamps agree there as on a live node.
"""

from __future__ import annotations

import math
import re
import tempfile
from typing import Dict, List, Optional, Tuple

from prometheus_client.parser import text_string_to_metric_families

from mps_exporter.bundle import load
from mps_exporter.config import Config
from mps_exporter.replay import Player, replay_config, shipped_bundle
from mps_exporter.wiring import build_collector, build_readers
from tests.support.golden import exposition

JOB = "mps-exporter"
INSTANCE = "demo:10138"
# Wall-clock durations of this machine's reads: not the session's, and no rule reads them
# beyond a histogram's rate; fixed so the series are the same on every run.
_DURATIONS = re.compile(r"^mps_exporter_collector(_read)?_duration_seconds")

Series = Dict[str, List[Optional[float]]]  # selector -> value per scrape (None: not scraped)


def _selector(name: str, labels: Dict[str, str]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return name + "{" + ", ".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"


def scrapes(seconds: float, interval: float, present: float = 0.0) -> Tuple[List[float], Series]:
    """(scrape times, series) of the shipped session replayed for `seconds`, scraped
    every `interval` from the replay's start at `present`."""
    bundle = load(shipped_bundle())
    times = [present + i * interval for i in range(int(seconds // interval) + 1)]
    series: Series = {}
    with tempfile.TemporaryDirectory(prefix="replay-series-") as tmp:
        position = [0.0]
        player = Player(bundle, tmp, loop=True, monotonic=lambda: position[0], present=present)
        cfg = replay_config(Config(), bundle, player.log_dirs)
        readers = player.readers_with(build_readers(cfg, player.backends(), recorded=False))
        collector = build_collector(cfg, readers, clock=player.clock)
        try:
            for i, t in enumerate(times):
                position[0] = t - present
                player.feed()
                for reader in readers.values():
                    reader.catch_up()
                text = exposition(collector)
                samples = {_selector("up", {"job": JOB, "instance": INSTANCE}): 1.0}
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        value = 0.001 if _DURATIONS.match(s.name) else float(s.value)
                        samples[_selector(s.name, {**s.labels, "job": JOB, "instance": INSTANCE})] = value
                for key, value in samples.items():
                    series.setdefault(key, [None] * len(times))[i] = value
        finally:
            for reader in readers.values():
                reader.close()
    return times, series


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Inf" if v > 0 else "-Inf"
    return repr(v)


def promtool_values(values: List[Optional[float]]) -> str:
    """promtool's values notation: `_` where a series was not scraped, `stale` where it
    went away (as Prometheus marks a series a scrape no longer has), runs as `axN`."""
    words: List[str] = []
    seen = False
    for i, v in enumerate(values):
        if v is None:
            words.append("stale" if seen and values[i - 1] is not None else "_")
        else:
            seen = True
            words.append(_number(v))
    out: List[str] = []
    i = 0
    while i < len(words):  # `v+0xN`: v, then N more of it
        j = i
        while j + 1 < len(words) and words[j + 1] == words[i] and words[i] not in ("_", "stale", "NaN", "Inf", "-Inf"):
            j += 1
        out.append(words[i] if j == i else f"{words[i]}+0x{j - i}")
        i = j + 1
    return " ".join(out)
