from __future__ import annotations

from typing import List

import pytest

from tests.deploy.helpers import render


@pytest.fixture(scope="session")
def default_objects() -> List[dict]:
    return render(None)
