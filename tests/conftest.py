"""Suite-wide fixtures."""

from __future__ import annotations

from typing import Any, Iterator, List

import pytest

from mps_exporter.logs.follower import FileFollower


@pytest.fixture(autouse=True)
def close_log_followers() -> Iterator[None]:
    """Every log follower a test makes (itself or through a pipeline) is closed after it,
    with the rotated files it still drains: unclosed, they kept ~1,400 log files open by
    the end of tests/logs alone."""
    made: List[FileFollower] = []
    real = FileFollower.__init__

    def init(self: FileFollower, *args: Any, **kwargs: Any) -> None:
        real(self, *args, **kwargs)
        made.append(self)

    FileFollower.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileFollower.__init__ = real  # type: ignore[method-assign]
        for follower in made:
            follower.close()
