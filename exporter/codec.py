"""Source readings as JSON and back, for capture bundles (docs/capture-format.md).

`decode()` rebuilds the model dataclasses (model.py) from their own type hints,
so the bundle format follows model.py without a second schema to keep in sync.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Dict, Union


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


def decode(tp: Any, value: Any) -> Any:
    """JSON data back into `tp` (a model dataclass, Optional, List, Dict or a scalar).

    Unknown keys are ignored (a newer exporter may add fields); a missing
    required field or a wrong type raises ValueError."""
    return _decoder(tp)(value)


# Type -> the function that decodes a value of it, built once per type: a replay decodes
# its whole bundle before it serves, and working the type hints out again for every value
# was most of the time of that (the shipped session: 0.09 of 0.12 s, issue 44).
_decoders: Dict[Any, Callable[[Any], Any]] = {}


def _decoder(tp: Any) -> Callable[[Any], Any]:
    found = _decoders.get(tp)
    if found is None:
        found = _decoders[tp] = _build(tp)
    return found


def _build(tp: Any) -> Callable[[Any], Any]:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_decoder(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        optional = type(None) in args
        inner = _decoder(next(a for a in args if a is not type(None)))

        def union(value: Any) -> Any:
            return None if value is None and optional else inner(value)
        return union
    if origin is list:
        item = _decoder(args[0])
        return lambda value: [item(v) for v in expect(value, list, "list")]
    if origin is tuple:
        items = [_decoder(a) for a in args]

        def fixed(value: Any) -> Any:
            got = expect(value, list, "list")
            if len(got) != len(items):
                raise ValueError(f"expected {len(items)} items, got {len(got)}")
            return tuple(d(v) for d, v in zip(items, got))
        return fixed
    if origin is dict:
        key, val = _decoder(args[0]), _decoder(args[1])
        return lambda value: {key(k): val(v) for k, v in expect(value, dict, "object").items()}
    if tp is int:
        return _int
    if tp is float:
        return _float
    if tp in (str, bool):
        def scalar(value: Any) -> Any:
            if not isinstance(value, tp):
                raise ValueError(f"expected {tp.__name__}, got {value!r}")
            return value
        return scalar
    return lambda value: value


def _dataclass_decoder(tp: type) -> Callable[[Any], Any]:
    fields: Dict[str, Callable[[Any], Any]] = {}  # filled at the first value: a type may name itself

    def dataclass_value(value: Any) -> Any:
        if not fields:
            fields.update({k: _decoder(h) for k, h in typing.get_type_hints(tp).items()})
        obj = expect(value, dict, tp.__name__)
        try:
            return tp(**{k: fields[k](v) for k, v in obj.items() if k in fields})
        except TypeError as e:  # a required field is missing
            raise ValueError(f"{tp.__name__}: {e}") from e
    return dataclass_value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)  # dict keys arrive as strings


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    return float(value)


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
