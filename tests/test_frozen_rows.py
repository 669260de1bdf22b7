"""join.frozen_row: the rows' own `__init__` (fields written to `__dict__` at once) builds
what `dataclass(frozen=True)` builds, and the rows stay frozen."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import pytest

from mps_exporter import join
from mps_exporter.join import ClientRow, frozen_row

ROWS = [join.OutsideProcessRow, join.GpuRow, join.ServerRow, join.ClientRow, join.DaemonRow, join.Rows,
        join.ClientMemory]


@frozen_row
class Example:
    name: str
    count: int = 3
    by_gpu: Dict[int, int] = dataclasses.field(default_factory=dict)
    note: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Reference:
    name: str
    count: int = 3
    by_gpu: Dict[int, int] = dataclasses.field(default_factory=dict)
    note: Optional[str] = None


@pytest.mark.parametrize("args, kwargs", [(("a",), {}), (("a", 5), {}), (("a",), {"note": "n", "by_gpu": {0: 1}}),
                                          ((), {"name": "b", "count": 0})])
def test_a_row_is_what_a_frozen_dataclass_builds(args, kwargs):
    assert dataclasses.asdict(Example(*args, **kwargs)) == dataclasses.asdict(Reference(*args, **kwargs))


def test_defaults_made_by_a_factory_are_each_rows_own():
    one, two = Example("a"), Example("b")
    assert one.by_gpu == {} and one.by_gpu is not two.by_gpu


def test_rows_refuse_assignment_and_missing_fields():
    row = Example("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.count = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        Example()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Example("a", unknown=1)  # type: ignore[call-arg]


def test_every_row_class_builds_through_it_and_compares_by_value():
    # frozen_row's __init__ (its `_d`, the instance's __dict__), not dataclass' own
    assert [cls.__name__ for cls in ROWS if "_d" not in cls.__init__.__code__.co_varnames] == []
    fields = {f.name: f for f in dataclasses.fields(ClientRow)}
    values = {name: (f.default if f.default is not dataclasses.MISSING else
                     f.default_factory() if f.default_factory is not dataclasses.MISSING else f"v-{name}")
              for name, f in fields.items()}
    row = ClientRow(**values)
    assert vars(row) == values and row == ClientRow(**values)
    assert row != dataclasses.replace(row, pid=7)
