"""Every source of the exporter: each module of this package that defines `SOURCE`.

Found by listing the package, so that a new source is one new module: no list
here or anywhere else to extend. Sorted by name (flag help, collector order).
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

from ..families import FamilyBuilder
from ..model import Snapshot
from .base import Source


def _discover() -> Dict[str, Source[Any]]:
    found: Dict[str, Source[Any]] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])):
        spec = getattr(importlib.import_module(f"{__package__}.{module}"), "SOURCE", None)
        if isinstance(spec, Source):
            if spec.name in found:
                raise RuntimeError(f"two sources are named {spec.name!r}")
            found[spec.name] = spec
    return dict(sorted(found.items()))


SOURCES: Dict[str, Source[Any]] = _discover()


def own_renders() -> Tuple[Callable[[FamilyBuilder, Snapshot], None], ...]:
    """What each source renders alone (Source.render), for render.render's caller: the
    pure join itself imports no source."""
    return tuple(s.render for s in SOURCES.values())
