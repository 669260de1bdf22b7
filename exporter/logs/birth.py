"""When a file was created (its birth time, statx's `stx_btime`): an identity that an
inode number alone is not, and an order that mtime is not.

Rename rotation makes files in the order logrotate creates them, but a file's mtime
says when it was last written: a new log still empty has an mtime older than the last
lines written to the file before it, and on ext4 a new file may get the inode number
of a file deleted a moment ago. The birth time tells both apart. Python (before 3.15)
has no `os.statx`: glibc's `statx` through ctypes. None where it cannot be had (no
statx, a file system that does not record it): callers then keep the older rules.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any, Callable, Optional

AT_EMPTY_PATH = 0x1000
AT_SYMLINK_NOFOLLOW = 0x100
STATX_BTIME = 0x800
_STRUCT_SIZE = 256  # struct statx
_BTIME_OFFSET = 80  # stx_btime: struct statx_timestamp {s64 tv_sec; u32 tv_nsec; s32 reserved}
_MASK_OFFSET = 0


def _load() -> Optional[Callable[..., int]]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call: Any = libc.statx
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    call.restype = ctypes.c_int
    return call  # type: ignore[no-any-return]


_statx = _load()
_AT_FDCWD = -100


def _birth(dirfd: int, path: bytes, flags: int) -> Optional[int]:
    if _statx is None:
        return None
    buf = ctypes.create_string_buffer(_STRUCT_SIZE)
    if _statx(dirfd, path, flags, STATX_BTIME, buf) != 0:
        return None
    raw = buf.raw
    if not int.from_bytes(raw[_MASK_OFFSET:_MASK_OFFSET + 4], sys.byteorder) & STATX_BTIME:
        return None  # the file system does not record it
    sec = int.from_bytes(raw[_BTIME_OFFSET:_BTIME_OFFSET + 8], sys.byteorder, signed=True)
    nsec = int.from_bytes(raw[_BTIME_OFFSET + 8:_BTIME_OFFSET + 12], sys.byteorder)
    return sec * 1_000_000_000 + nsec


def path_birth_ns(path: str) -> Optional[int]:
    """The birth time of `path` itself (a symbolic link is not followed), in ns; None: unknown."""
    return _birth(_AT_FDCWD, os.fsencode(path), AT_SYMLINK_NOFOLLOW)


def fd_birth_ns(fd: int) -> Optional[int]:
    """The birth time of the open file `fd`, in ns; None: unknown."""
    return _birth(fd, b"", AT_EMPTY_PATH)
