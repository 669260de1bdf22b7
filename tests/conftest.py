"""Suite-wide fixtures."""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import pytest

from mps_exporter.logs.follower import FileFollower


@pytest.fixture(autouse=True)
def close_log_followers() -> Iterator[None]:
    """Every log follower a test makes (itself or through a pipeline) is closed after it,
    with the rotated files it still drains: unclosed, they kept ~1,400 log files open by
    the end of tests/logs alone. Held weakly: a test that checks what its followers leave
    behind once dropped (200 daemons coming and going) must see them freed."""
    made: "weakref.WeakSet[FileFollower]" = weakref.WeakSet()
    real = FileFollower.__init__

    def init(self: FileFollower, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        made.add(self)

    FileFollower.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileFollower.__init__ = real  # type: ignore[method-assign]
        for follower in list(made):
            follower.close()


@pytest.fixture(autouse=True)
def rows_are_never_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """join.rows_of hands back the last join where a snapshot holds the very readings it
    joined: readings are never changed once read. A test that changes one in place (a
    field set on a reading of a collected snapshot) would then render the old rows and
    pass whatever the code does; here each answer is checked against a join made anew."""
    from mps_exporter import join, render
    from mps_exporter.status import view

    real = join.rows_of

    def checked(snap: Any) -> Any:
        rows = real(snap)
        assert rows == join.join(snap, reuse=False), \
            "a reading was changed in place after it was joined: replace it instead"
        return rows

    for module in (join, render, view):
        monkeypatch.setattr(module, "rows_of", checked)
    monkeypatch.setattr(join, "_kept_clients", join._Kept())  # no test starts from another's clients
