"""Source readings as JSON and back, for capture bundles (docs/capture-format.md).

`decode()` rebuilds the model dataclasses (model.py) from their own type hints,
so the bundle format follows model.py without a second schema to keep in sync.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Union


class RecordedFailure(Exception):
    """The source raised this error at this moment of the capture."""


def encode(value: Any) -> Any:
    """A source's result as JSON-ready data (int dict keys become strings, as JSON wants)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


_hints: Dict[type, Dict[str, Any]] = {}


def decode(tp: Any, value: Any) -> Any:
    """JSON data back into `tp` (a model dataclass, Optional, List, Dict or a scalar).

    Unknown keys are ignored (a newer exporter may add fields); a missing
    required field or a wrong type raises ValueError."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = _hints.get(tp)
        if hints is None:
            hints = _hints[tp] = typing.get_type_hints(tp)
        obj = expect(value, dict, tp.__name__)
        try:
            return tp(**{k: decode(hints[k], v) for k, v in obj.items() if k in hints})
        except TypeError as e:  # a required field is missing
            raise ValueError(f"{tp.__name__}: {e}") from e
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        return decode(next(a for a in args if a is not type(None)), value)
    if origin is list:
        return [decode(args[0], v) for v in expect(value, list, "list")]
    if origin is tuple:
        items = expect(value, list, "list")
        if len(items) != len(args):
            raise ValueError(f"expected {len(args)} items, got {len(items)}")
        return tuple(decode(a, v) for a, v in zip(args, items))
    if origin is dict:
        return {decode(args[0], k): decode(args[1], v) for k, v in expect(value, dict, "object").items()}
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)  # dict keys arrive as strings
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if tp in (str, bool) and not isinstance(value, tp):
        raise ValueError(f"expected {tp.__name__}, got {value!r}")
    return value


def expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"expected {what}, got {type(value).__name__}")
    return value


def recorded(entry: Any, tp: Any, what: str) -> Any:
    """One recorded `{"value": ...}` or `{"error": "..."}` entry: the value, or a RecordedFailure."""
    entry = expect(entry, dict, f"{what} entry")
    if "error" in entry:
        return RecordedFailure(str(entry["error"]))
    if "value" not in entry:
        raise ValueError(f"{what} entry has neither 'value' nor 'error'")
    return decode(tp, entry["value"])
