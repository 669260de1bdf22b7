"""An example source module, as a contributor would add it to exporter/sources/: two
metrics of its own, one flag (tests/test_example_source.py puts it into a copy of the
repository and runs the suite there)."""

MODULE = '''"""Fans by name: an example source with its own metrics and flag."""

from __future__ import annotations

from typing import Dict, Optional

from ..config import Config
from ..contract import FIXED, Label, counter, gauge, table
from ..families import FamilyBuilder
from ..model import Snapshot
from .base import Backends, Flag, ReadContext, Reader, Source

FAN = Label("fan", FIXED, "the example's fans", "front, back")
FAN_METRICS = table(
    "Fans",
    gauge("mps_fan_speed_rpm", "Speed of the fan.", FAN),
    counter("mps_fan_stalls_total", "Times the fan stalled.", FAN),
)


class FansSourceSpec(Source[Dict[str, float]]):
    name = "fans"
    help = "fan speeds (an example)"
    reading_type = Dict[str, float]
    flags = (Flag("--fans.rpm", "fans_rpm", "the speed the front fan reports (default %(default)s)",
                  refuses=("abc",), type=float, default=1200.0),)
    metrics = FAN_METRICS

    def build(self, cfg: Config, backends: Backends) -> Optional[Reader[Dict[str, float]]]:
        rpm = float(self.setting(cfg, "fans_rpm"))

        def read(ctx: ReadContext) -> Dict[str, float]:
            return {"front": rpm, "back": rpm / 2}

        return Reader(read)

    def render(self, out: FamilyBuilder, snap: Snapshot) -> None:
        for fan, rpm in sorted((self.reading(snap) or {}).items()):
            out.add("mps_fan_speed_rpm", rpm, fan=fan)
            out.add("mps_fan_stalls_total", 0, fan=fan)


SOURCE = FansSourceSpec()
'''
