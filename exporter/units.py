"""Numbers as MPS and its clients write them, parsed so that any text is either a value
or refused (None): memory sizes ("2G", "512M", "0x80000000 bytes", "1073741824"),
digit strings and decimals.

Much of this text comes from processes anyone can start (a client's environment, its
command name in `ps`), so the parsers take ASCII digits only (`str.isdigit()` accepts
"²", which `int()` refuses, and `\\d` matches "٣", which CUDA would not read) and bound
their length and value (a 400-digit size is refused, never overflowed)."""

from __future__ import annotations

import re
from typing import Optional

# MPS sizes are binary: "2G" is 2 GiB (the capture: `set_default_device_pinned_mem_limit
# 0 2G` makes the next server log "0x80000000 bytes").
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_UNITS_LARGEST_FIRST = sorted(set(_UNITS.values()), reverse=True)
# re.ASCII: \s is ASCII whitespace; the digits are spelled [0-9] (never \d). At most 20
# digits before the point (2**64 has 20) and 20 after; at most 16 hex digits.
_SIZE = re.compile(r"^\s*([0-9]{1,20})(?:\.([0-9]{1,20}))?\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE | re.ASCII)
_HEX = re.compile(r"^\s*0x([0-9a-fA-F]{1,16})(?:\s*bytes)?\s*$", re.ASCII)
MAX_SIZE_BYTES = (1 << 64) - 1  # a size_t: no device limit is larger
MAX_DIGITS = 20  # the longest digit string taken for a number (2**64 has 20 digits)
MAX_DECIMAL_CHARS = 64  # the longest text taken for a decimal
_DIGITS = re.compile(r"[0-9]+", re.ASCII)


def parse_size(text: str) -> Optional[int]:
    """Bytes for an MPS size string, or None if it is not one (or is over MAX_SIZE_BYTES)."""
    m = _HEX.match(text)
    if m:
        return int(m.group(1), 16)
    m = _SIZE.match(text)
    if not m:
        return None
    whole, fraction, unit = m.group(1), m.group(2), _UNITS[m.group(3).upper()]
    # A whole number is exact; a fraction as it always was (through a float).
    size = int(whole) * unit if fraction is None else int(float(f"{whole}.{fraction}") * unit)
    return size if size <= MAX_SIZE_BYTES else None


def printed_unit(size: int) -> int:
    """The unit MPS's control program printed `size` in: the largest of _UNITS it reaches
    that divides it. It prints a limit rounded down to whole units of the largest unit
    the limit reaches: 1536M as `1G` (H200, driver 580;
    tests/gpu/reports/2026-11-29-h200-pinned-1536M), so an answer of `size` stands for
    any limit from `size` up to `size + printed_unit(size)`."""
    for unit in _UNITS_LARGEST_FIRST:
        if size >= unit and size % unit == 0:
            return unit
    return 1


def ascii_digits(text: str, max_digits: int = MAX_DIGITS) -> bool:
    """Whether `text` is 1 to `max_digits` ASCII digits and nothing else: what `int(text)`
    may be called on. `str.isdigit()` is no such check ("²".isdigit(), int("²") fails)."""
    return len(text) <= max_digits and _DIGITS.fullmatch(text) is not None


def parse_uint(text: str, max_digits: int = MAX_DIGITS) -> Optional[int]:
    """A non-negative integer written in 1 to `max_digits` ASCII digits (surrounding
    whitespace allowed); None for anything else."""
    text = text.strip()
    return int(text) if ascii_digits(text, max_digits) else None


def parse_decimal(text: str) -> Optional[float]:
    """A number as `float()` reads it, from ASCII text of at most MAX_DECIMAL_CHARS
    characters (surrounding whitespace allowed); None for anything else. NaN and the
    infinities ("1e999" too) are numbers here: the caller's range check refuses them."""
    text = text.strip()
    if not text or len(text) > MAX_DECIMAL_CHARS or not text.isascii() or "_" in text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value
