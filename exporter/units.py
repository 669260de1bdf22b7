"""Memory sizes as MPS writes them ("2G", "512M", "0x80000000 bytes", "1073741824")."""

from __future__ import annotations

import re
from typing import Optional

# MPS sizes are binary: "2G" is 2 GiB (the capture: `set_default_device_pinned_mem_limit
# 0 2G` makes the next server log "0x80000000 bytes").
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_HEX = re.compile(r"^\s*0x([0-9a-fA-F]+)(?:\s*bytes)?\s*$")


def parse_size(text: str) -> Optional[int]:
    """Bytes for an MPS size string, or None if it is not one."""
    m = _HEX.match(text)
    if m:
        return int(m.group(1), 16)
    m = _SIZE.match(text)
    if not m:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
