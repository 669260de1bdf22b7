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
