"""Follow one log file by name, the way `tail -F` does, and hand out complete lines.

`FileFollower.poll()` reads what was appended since the last call and returns the
complete lines; a partial last line waits for its newline. It survives:
- the file not existing yet, or disappearing with its whole directory (NVIDIA's
  device plugin deletes the MPS log directory when its daemon stops): it keeps
  reading the open file while the name is gone, and starts the new file from its
  beginning when the name comes back;
- rotation by rename: the old file is read to its end, then any rotated file created
  after it that was never read (several rotations between two polls, or a poll that
  found no file under the name while logrotate was between its rename and its create),
  then the new one from its beginning. "Created after" is the birth time (statx), not
  the mtime (a new log still empty is older by mtime than the last lines written to the
  file before it); a file read to its end is known by inode and birth time (ext4 gives a
  deleted file's inode number to the next new one); the rotated files are listed twice
  (a listing taken while logrotate renames `.N` to `.N+1` can miss one), and a file born
  before the log is never taken for its copy. The old file is read on for late lines
  (DRAIN_SECONDS after its last write): its unterminated last line waits there for its
  newline (a writer that writes a line in pieces finishes it in the old file before it
  reopens), handed out without it only once the file has been quiet that long;
- copytruncate: a file shorter than the read offset, or whose first bytes changed,
  was copied and truncated. What had not been read yet is in the copy (logrotate's
  `.1`, a dated name, any name that starts with the log's), found by content, not by
  name: the copy's first bytes and the bytes just before the read offset must be the
  ones read from the file. The copy is read to its end, then the file from its
  beginning. When no copy matches (already compressed, removed), the unread part is
  lost: `rotation_gaps` counts it and it is logged. A file with nothing read yet (offset
  0, no first bytes to compare) is a truncation when it is shorter than it was seen
  before, or when, having been seen empty, it holds bytes again and a rotated file that
  appeared meanwhile does not start as it does (the copy of what it held);
- NUL bytes (stripped: a writer that kept its offset across copytruncate leaves a
  hole of NULs), invalid UTF-8 (replaced), and lines longer than `max_line_bytes`
  (cut to the cap and counted; memory never holds more than the cap of one line);
- anything but a regular file under the name (a FIFO, a directory, a device): it is
  never opened (a FIFO would block `open()`, `/dev/zero` never ends). Files are opened
  with O_NONBLOCK and checked again with fstat (the name may change in between), and
  one poll reads a bounded amount, so `poll()` never blocks;
- a symbolic link under the name (or a rotated name): never followed (`lstat`,
  O_NOFOLLOW). The exporter reads as root, and the log directory may be writable by
  others: `control.log -> /etc/shadow` would publish that file's line count and size.
  It is a `not_regular_file` read error whose message says it is a symbolic link.

Why a file cannot be read is `error` (a `ReadError`: a reason from READ_ERROR_REASONS
and a message naming the path); `errors` counts each time it began, by reason.

`position()` / `resume()` save and restore where it stands: the offset of the first
byte not yet handed out as a complete line, plus the file's identity (device,
inode, first bytes), so a restarted exporter neither re-reads nor skips lines.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import stat
import time
from typing import AbstractSet, Any, Callable, Deque, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Tuple

# The read error reasons, declared with the other plain log data (events.py); named here too.
from .events import INTERNAL_ERROR as INTERNAL_ERROR
from .events import IO_ERROR as IO_ERROR
from .events import MISSING_DIRECTORY as MISSING_DIRECTORY
from .events import NOT_A_DIRECTORY as NOT_A_DIRECTORY
from .events import NOT_REGULAR_FILE as NOT_REGULAR_FILE
from .events import PERMISSION_DENIED as PERMISSION_DENIED
from .events import READ_ERROR_REASONS as READ_ERROR_REASONS
from ..units import ascii_digits
from . import birth

log = logging.getLogger(__name__)

DEFAULT_MAX_LINE_BYTES = 64 * 1024
READ_SIZE = 1 << 20
MAX_POLL_BYTES = 16 * READ_SIZE  # one poll reads at most this much, line or no line
HEAD_BYTES = 64  # fingerprint: the file's first bytes (MPS lines start with a ms timestamp)
TAIL_BYTES = 64  # and the bytes just before the read offset: a rotated copy must have both
# The last bytes read are kept to confirm a copy that ends before the read offset (lines
# written after logrotate's copy, read before its truncate) by its own last bytes.
RECENT_BYTES = 64 * 1024
# Rotated copies in these forms cannot be read on: their unread part counts as a gap.
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".lzma", ".Z", ".zip")
FINISHED_FILES = 64  # identities of rotated files read to their end, remembered
# A rotated file is read on for this long after the name moved on: a writer that
# reopens its log on a signal writes its last lines into the old file meanwhile.
DRAIN_SECONDS = 2.0
MAX_DRAINING = 32
MAX_FILES_PER_POLL = 16  # rotated files finished in one poll; more: `more` says to come back


class _Draining:
    """A rotated file still read for late lines: its descriptor, offset and partial line."""

    __slots__ = ("fd", "offset", "partial", "until")

    def __init__(self, fd: int, offset: int, partial: bytes, until: float) -> None:
        self.fd, self.offset, self.partial, self.until = fd, offset, partial, until
_OPEN_FLAGS = (os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
               | getattr(os, "O_NOCTTY", 0))


class NotRegularFile(OSError):
    """The path names a FIFO, directory, socket, device or symbolic link: not opened."""


def _symlink(path: str) -> NotRegularFile:
    return NotRegularFile(f"{path} is a symbolic link: not followed (log files are read as root)")


def open_regular(path: str) -> Tuple[int, os.stat_result]:
    """(fd, fstat) of `path` opened read-only, only if it is a regular file itself, not
    a symbolic link to one.

    Looks before opening (open() blocks on a FIFO and has effects on some devices),
    opens with O_NONBLOCK and O_NOFOLLOW, and checks again with fstat (the name may
    change in between). Raises NotRegularFile, or the OSError of lstat/open."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise _symlink(path)
    if not stat.S_ISREG(mode):
        raise NotRegularFile(f"{path} is not a regular file")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:  # became a symbolic link since the lstat
            raise _symlink(path) from None
        raise
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, fst


def end_position(path: str) -> Dict[str, Any]:
    """A `position()` at the end of the file's last complete line (`--mps.log-start end`:
    what it holds now is history, not news); {} where there is no regular file to read."""
    try:
        fd, fst = open_regular(path)
    except OSError:
        return {}
    try:
        tail_start = max(0, fst.st_size - DEFAULT_MAX_LINE_BYTES)
        tail = os.pread(fd, fst.st_size - tail_start, tail_start)
        head = os.pread(fd, HEAD_BYTES, 0)
    except OSError:
        return {}
    finally:
        os.close(fd)
    newline = tail.rfind(b"\n")
    # No newline in the last 64 KiB: past the cap, the rest of that line is never read whole.
    offset = tail_start + newline + 1 if newline >= 0 or tail_start == 0 else fst.st_size
    return {"dev": fst.st_dev, "ino": fst.st_ino, "offset": offset, "head": head.hex()}


class ReadError(NamedTuple):
    reason: str  # one of READ_ERROR_REASONS
    message: str  # for people: the path and what is wrong with it


def read_error(path: str, e: OSError) -> ReadError:
    """An OSError about `path` as a ReadError."""
    if e.errno in (errno.EACCES, errno.EPERM):
        directory = os.path.dirname(path) or "."
        if not os.access(directory, os.X_OK):  # one message for both files of the directory
            return ReadError(PERMISSION_DENIED, f"log directory {directory}: permission denied")
        return ReadError(PERMISSION_DENIED, f"{path}: permission denied")
    if e.errno == errno.ENOTDIR:
        return ReadError(NOT_A_DIRECTORY, f"log directory {os.path.dirname(path)} is not a directory")
    return ReadError(IO_ERROR, f"{path}: {e.strerror or e}")


def missing_file_error(path: str) -> Optional[ReadError]:
    """`path` is absent: normal (None), unless its directory is absent or unreadable too."""
    directory = os.path.dirname(path) or "."
    try:
        os.stat(directory)
    except FileNotFoundError:
        return ReadError(MISSING_DIRECTORY, f"log directory {directory} does not exist")
    except OSError as e:
        return read_error(directory, e)
    return None


class FileFollower:
    def __init__(self, path: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock  # when a rotated file read on for late lines has been quiet long enough
        self.max_line_bytes = max_line_bytes
        self._fd: Optional[int] = None
        self._identity: Optional[Tuple[int, int]] = None  # (st_dev, st_ino) of the open file
        self._head = b""
        self._offset = 0  # file position of the next read
        self._partial = b""  # bytes of the unterminated last line
        self._dropping = False  # the partial line hit the cap: drop the rest up to its newline
        self._line_start = 0  # file position where the partial line starts: what position() saves
        self._resume: Optional[Dict[str, Any]] = None
        self._problem: Optional[ReadError] = None  # found during the current poll
        self._recent = bytearray()  # up to RECENT_BYTES read last, ending at _offset (TAIL_BYTES at least)
        self._size_seen = 0  # the largest size seen of the current file: shorter later is a truncation
        # Rotated files beside the log when the current file was last seen empty with nothing
        # read (no head to compare): a copy that appears later is checked against the log.
        self._siblings_while_empty: Optional[FrozenSet[Tuple[int, int]]] = None
        self._copy_of: Optional[Tuple[int, int]] = None  # reading a rotated copy of this file (identity)
        # Rotated files read to their end: (st_dev, st_ino, birth time or None). An inode
        # number alone is no identity: ext4 gives a deleted file's inode to the next new one.
        self._finished: Deque[Tuple[int, int, Optional[int]]] = collections.deque(maxlen=FINISHED_FILES)
        self._finished_mtime = 0  # st_mtime_ns of the rotated file read to its end last
        self._finished_birth: Optional[int] = None  # and its birth time (None: unknown)
        self.rotations = 0
        self.truncations = 0
        self.rotation_gaps = 0  # rotations whose unread part was in no readable rotated file
        self._draining: List[_Draining] = []
        self.error: Optional[ReadError] = None  # why the file cannot be read now; None: fine or absent
        self.errors: Dict[str, int] = {}  # reason -> times a failure of that reason began
        self.more = False  # the last poll stopped before the end of the file: poll again
        self._chunked = False  # poll_text: _split hands a read's whole lines as one text

    # ------------------------------------------------------------ state
    def position(self) -> Dict[str, Any]:
        """Where to resume: the start of the partial line in the current file, and the
        fingerprints that confirm it (the file's first bytes, the bytes before it)."""
        if self._identity is None or self._fd is None:  # nothing open: keep what an earlier run saved
            if not self._resume:
                return {}
            return {**self._resume, "head": self._resume["head"].hex(), "tail": self._resume["tail"].hex()}
        start = max(0, self._line_start - TAIL_BYTES)
        try:
            tail = os.pread(self._fd, self._line_start - start, start)
        except OSError:
            tail = b""
        return {"dev": self._identity[0], "ino": self._identity[1], "offset": self._line_start,
                "head": self._head.hex(), "tail": tail.hex()}

    def resume(self, pos: Dict[str, Any]) -> None:
        """Use a position() saved by an earlier run (before the first poll). One that is
        not a position at all raises (KeyError, TypeError, ValueError)."""
        if not pos:
            self._resume = None
            return
        offset = int(pos["offset"])
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        self._resume = {"dev": int(pos["dev"]), "ino": int(pos["ino"]), "offset": offset,
                        "head": bytes.fromhex(str(pos["head"])), "tail": bytes.fromhex(str(pos.get("tail", "")))}

    def check_resume(self) -> Optional[str]:
        """None when the saved position can be trusted (or there is none, or its file is
        gone: a new log is read from its beginning). Otherwise why not: a file that still
        starts as the saved one did, but is shorter than the offset or holds other bytes
        before it. Reading it from its beginning would count its lines a second time."""
        saved = self._resume
        if not saved or self._saved_file(saved) is not None:
            return None
        for path in [self.path] + [p for p, _ in self._rotated_siblings()]:
            try:
                fd, _ = open_regular(path)
            except OSError:
                continue
            try:
                if saved["head"] and os.pread(fd, len(saved["head"]), 0) == saved["head"]:
                    return (f"{path} starts as the file saved at offset {saved['offset']} did, but is shorter "
                            "or holds other bytes before that offset")
            except OSError:
                continue
            finally:
                os.close(fd)
        return None

    def unread_bytes(self) -> int:
        """Bytes of the file under the name not read yet (0 where there is none): the backlog."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return 0
        if not stat.S_ISREG(st.st_mode):  # a symbolic link's target is not ours to measure
            return 0
        if self._fd is not None and (st.st_dev, st.st_ino) == self._identity:
            return max(0, st.st_size - self._offset)
        saved = self._resume
        if saved and (st.st_dev, st.st_ino) == (saved["dev"], saved["ino"]):
            return max(0, st.st_size - int(saved["offset"]))
        return st.st_size

    def close(self) -> None:
        """Close the file followed and the rotated files still read for late lines."""
        self._close_current()
        while self._draining:
            try:
                os.close(self._draining.pop().fd)
            except OSError:
                pass

    def _close_current(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self._identity = None, None

    # ------------------------------------------------------------- read
    def poll(self, max_bytes: int = READ_SIZE) -> Tuple[List[str], int]:
        """(complete lines, how many of them were cut to the cap). Reads about max_bytes
        of the current file per call (more while no complete line came out, up to
        MAX_POLL_BYTES): call again while it returns lines or `more` is set."""
        lines: List[str] = []
        truncated = 0
        self.more, self._problem = False, None
        try:
            st: Optional[os.stat_result] = os.lstat(self.path)  # a symbolic link: another file
        except OSError as e:  # the file is missing (normal before MPS starts), or worse
            st = None
            self._problem = missing_file_error(self.path) if e.errno == errno.ENOENT else read_error(self.path, e)
        if self._draining:
            self._drain(lines)
        if self._fd is None and (st is not None or self._finished):
            self._open_next()
        if self._fd is not None:
            copy = self._copied_before_first_read(st)
            if copy is not None:
                self.truncations += 1
                self._follow_copy(*copy)
            elif self._rewritten():
                self.truncations += 1
                if not self._switch_to_copy():
                    self._restart_file()
            truncated = self._read(lines, max_bytes)
            hops = 0
            while st is not None and (st.st_dev, st.st_ino) != self._identity and not self.more:
                # The name now means another file (rotation, a re-created directory, a FIFO):
                # the old one is read to its end, so its unterminated last line is complete.
                if hops == MAX_FILES_PER_POLL:  # the rest on the next poll, at once
                    self.more = True
                    break
                hops += 1
                self.rotations += 1
                collapsed = self._collapsed_successor(st)
                if collapsed is not None:  # the copy's last bytes head the log: go on after them
                    self._continue_collapsed(*collapsed)
                else:
                    chain = self._copy_of
                    left = (self._offset, self._recent, self._partial, self._dropping, self._line_start)
                    # A renamed log's unterminated last line goes on in it (its writer has not
                    # reopened yet): it waits for its newline there, never handed out cut.
                    self._finish_file(b"" if chain is not None or left[3] else left[2])
                    self._open_next()
                    if chain is not None and not self._chained_copy(chain, *left):
                        if left[2]:  # the end of a copy: the rest of the line is in no file we read
                            lines.append(self._decode(left[2]))
                            truncated += left[3]
                    elif chain is None and left[3]:  # a line cut to the cap: its rest is dropped
                        lines.append(self._decode(left[2]))
                        truncated += 1
                if self._fd is None:
                    break
                truncated += self._read(lines, max_bytes)
                try:  # several rotations between two polls: go on to the next file at once
                    st = os.lstat(self.path)
                except OSError:
                    break
        if self._fd is not None and not self._offset and not self._head and self._siblings_while_empty is None:
            self._copied_before_first_read(st)  # an empty log: note the rotated files beside it now
        self._set_error(self._problem)
        return lines, truncated

    def _set_error(self, error: Optional[ReadError]) -> None:
        if error is not None and error != self.error:
            self.errors[error.reason] = self.errors.get(error.reason, 0) + 1
        self.error = error

    def _open(self) -> None:
        saved = self._resume
        confirmed = self._saved_file(saved) if saved else None
        path = confirmed or self.path
        try:
            fd, fst = open_regular(path)
        except NotRegularFile as e:
            self._problem = ReadError(NOT_REGULAR_FILE, str(e))
            return
        except OSError as e:
            self._problem = None if e.errno == errno.ENOENT else read_error(path, e)  # ENOENT: gone again
            return
        self._resume = None
        self._fd, self._identity = fd, (fst.st_dev, fst.st_ino)
        self._offset = self._line_start = 0
        self._partial, self._dropping, self._recent = b"", False, bytearray()
        self._size_seen, self._siblings_while_empty, self._copy_of = 0, None, None
        self._head = self._read_head()
        if saved and confirmed:
            self._offset = self._line_start = saved["offset"]
            self._recent = bytearray(saved["tail"])

    def _saved_file(self, saved: Dict[str, Any]) -> Optional[str]:
        """The file a saved position belongs to, confirmed by content: its first bytes and
        the bytes before the offset are the saved ones, and it reaches the offset. The
        name itself, or after a rotation while we were down, a rotated file beside it
        (control.log.1 by rename, or a copytruncate copy), whose unread tail then comes
        before the new file. The saved inode is looked at first; it only orders the search."""
        candidates = [self.path] + [p for p, _ in self._rotated_siblings()]

        def same_inode(path: str) -> bool:
            try:
                st = os.lstat(path)
            except OSError:
                return False
            return (st.st_dev, st.st_ino) == (saved["dev"], saved["ino"])

        for path in sorted(candidates, key=lambda p: not same_inode(p)):
            if self._holds(path, saved):
                return path
        return None

    @staticmethod
    def _holds(path: str, saved: Dict[str, Any]) -> bool:
        try:
            fd, fst = open_regular(path)
        except OSError:
            return False
        try:
            offset, head, tail = saved["offset"], saved["head"], saved["tail"]
            return (fst.st_size >= offset and os.pread(fd, len(head), 0) == head
                    and (not tail or os.pread(fd, len(tail), offset - len(tail)) == tail))
        except OSError:
            return False
        finally:
            os.close(fd)

    # --------------------------------------------------------- rotation
    def _finish_file(self, partial: bytes = b"") -> None:
        """The current file is read to its end and the name means another file: it is
        read on for late lines (DRAIN_SECONDS) while the next one is followed. `partial`:
        its unterminated last line, completed by the bytes written to it later (a writer
        that writes a line in pieces finishes it in the old file before it reopens)."""
        if self._fd is not None and self._identity is not None:
            try:
                self._finished_mtime = os.fstat(self._fd).st_mtime_ns
            except OSError:
                pass
            self._finished_birth = birth.fd_birth_ns(self._fd)
            self._finished.append((*self._identity, self._finished_birth))
            if len(self._draining) >= MAX_DRAINING:
                self._end_drain(self._draining.pop(0), [])
            self._draining.append(_Draining(self._fd, self._offset, partial, self._clock() + DRAIN_SECONDS))
            self._fd = None
        self._close_current()

    def _open_next(self) -> None:
        """Open what follows the file finished last: a rotated file written after it and
        never read (rotated again before we came), else the file the name means now.
        The name is opened first: should it move on meanwhile, the file opened is one of
        the rotated candidates. It may be missing (logrotate renames the log, then
        creates the new one): the rotated files are looked at all the same."""
        self._open()
        successor = self._next_rotated() if self._finished else None
        if successor is not None:
            self._close_current()
            self._open_at(*successor)

    def _drain(self, lines: List[str]) -> None:
        """Complete lines appended to rotated files since they were left; a file quiet
        for DRAIN_SECONDS is closed, an unterminated last line handed out."""
        now = self._clock()
        for d in list(self._draining):
            try:
                data = os.pread(d.fd, READ_SIZE, d.offset)
            except OSError:
                data = b""
            if data:
                d.offset += len(data)
                d.until = now + DRAIN_SECONDS
                *complete, d.partial = (d.partial + data).split(b"\n")
                lines.extend(self._decode(line[: self.max_line_bytes]) for line in complete)
            elif now >= d.until:
                self._draining.remove(d)
                self._end_drain(d, lines)

    def _end_drain(self, d: _Draining, lines: List[str]) -> None:
        if d.partial:
            lines.append(self._decode(d.partial[: self.max_line_bytes]))
        try:
            os.close(d.fd)
        except OSError:
            pass

    def _rotated_siblings(self, listings: int = 1) -> List[Tuple[str, os.stat_result]]:
        """Regular, uncompressed files beside the log whose name starts with its name.
        A listing taken while logrotate renames `.N` to `.N+1` can miss a file (listed
        under neither name, or its name stat'ed after it moved): `listings` > 1 takes the
        union of that many listings, one file once (by inode), under its last name seen."""
        directory, base = os.path.split(self.path)
        found: Dict[Tuple[int, int], Tuple[str, os.stat_result]] = {}
        for _ in range(listings):
            try:
                with os.scandir(directory or ".") as entries:
                    for entry in entries:
                        if entry.name == base or not entry.name.startswith(base) \
                                or entry.name.endswith(COMPRESSED_SUFFIXES):
                            continue
                        try:
                            est = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if stat.S_ISREG(est.st_mode):
                            found[(est.st_dev, est.st_ino)] = (entry.path, est)
            except OSError:
                pass
        return list(found.values())

    def _next_rotated(self) -> Optional[Tuple[str, int]]:
        """(path, fd) of the oldest rotated file created after the one just finished and
        never read (rename rotation, several times between two polls); None: go on with
        the file the name means (open). That file may itself have been rotated since it
        was opened: it is then a candidate like the others, in its turn. Names shift
        while logrotate runs, so the file opened must be the one chosen (else: again)."""
        after = self._finished_birth
        finished: Dict[Tuple[int, int], List[Optional[int]]] = {}
        for dev, ino, born_then in self._finished:
            finished.setdefault((dev, ino), []).append(born_then)
        for _ in range(5):
            candidates: List[Tuple[int, int, int, str, int, Optional[int]]] = []
            for path, est in self._rotated_siblings(listings=2):
                born = birth.path_birth_ns(path) if after is not None else None
                # Read to its end already: the same inode, and the same birth time where both
                # are known (else a new file that got a deleted one's inode number).
                if any(b is None or born is None or b == born for b in finished.get((est.st_dev, est.st_ino), ())):
                    continue
                if born is not None and after is not None:
                    # Created after the file finished (logrotate creates them in turn), whatever
                    # was written when: a new log still empty is older by mtime than the last
                    # lines of the one before it.
                    if born >= after:
                        candidates.append((born, -_rotation_number(path), est.st_mtime_ns, path, est.st_ino, born))
                elif est.st_mtime_ns >= self._finished_mtime:  # no birth times here: by mtime
                    candidates.append((est.st_mtime_ns, -_rotation_number(path), 0, path, est.st_ino, born))
            if not candidates:
                return None
            *_, path, ino, born = min(candidates)
            try:
                fd, fst = open_regular(path)
            except OSError:
                continue  # renamed away meanwhile: look again
            if fst.st_ino == ino and (born is None or birth.fd_birth_ns(fd) == born):
                return path, fd
            os.close(fd)
        return None

    def _open_at(self, path: str, fd: int) -> None:
        """Follow an opened rotated file from its beginning."""
        fst = os.fstat(fd)
        self._fd, self._identity = fd, (fst.st_dev, fst.st_ino)
        self._offset = self._line_start = 0
        self._partial, self._dropping, self._recent = b"", False, bytearray()
        self._size_seen, self._siblings_while_empty, self._copy_of = 0, None, None
        self._head = self._read_head()
        log.debug("%s: reading %s, rotated before it was read", self.path, path)

    def _switch_to_copy(self) -> bool:
        """After copytruncate: go on reading from the rotated copy that holds what was
        not read yet (found by content). False: nothing was unread (the copy ends at or
        before the read offset: what was written after the copy was read before the
        truncate), or no copy holds it (counted in `rotation_gaps`)."""
        for path, fd, fst in self._open_copies():
            try:
                ours = self._is_copy(fd, fst.st_size)
            except OSError:
                ours = False
            if ours and fst.st_size <= self._offset:  # read to its end already, and past it
                try:  # collapsed in place, not truncated: go on where we were, less what was removed
                    return self._collapsed_in_place(fd, fst.st_size)
                finally:
                    os.close(fd)
            if not ours:
                os.close(fd)
                continue
            live = self._identity
            self._close_current()
            self._fd, self._identity = fd, (fst.st_dev, fst.st_ino)  # offset, partial line and head go on
            self._copy_of = live
            log.debug("%s was copied and truncated: reading the rest from %s", self.path, path)
            return True
        if max(self._offset, self._size_seen) > 0:  # bytes were there that are in no copy now
            self.rotation_gaps += 1
            log.warning("%s was truncated (copytruncate) and no rotated copy beside it holds the part not yet "
                        "read (compressed or removed already?): lines after offset %d are lost",
                        self.path, self._offset)
        return False

    def _is_copy(self, fd: int, size: int) -> bool:
        """The file `fd` (`size` bytes) is a copy of the one followed: it starts with the
        same bytes, and its bytes just before min(size, read offset) are the ones read
        there (kept for the last RECENT_BYTES; a copy ending before them is judged by its
        first bytes alone)."""
        head = self._head[:size]
        if not head or os.pread(fd, len(head), 0) != head:
            return False
        end = min(size, self._offset)
        recent_start = self._offset - len(self._recent)
        start = max(end - TAIL_BYTES, recent_start, 0)
        if start >= end:
            return True
        return os.pread(fd, end - start, start) == bytes(self._recent[start - recent_start: end - recent_start])

    def _copied_before_first_read(self, st: Optional[os.stat_result]) -> Optional[Tuple[int, os.stat_result]]:
        """A file at offset 0 with nothing read has no head to compare: a copytruncate
        before its first read would go unseen. So while it is empty the rotated files
        beside it are noted (once), and when it holds bytes again, a rotated file that
        appeared meanwhile and does not start as the log does is the copy of what it
        held: (fd, fstat) of it, to be read first. None: nothing to do (the usual case:
        one fstat). Only while the name still means the file (`st`): a file renamed away
        is followed by rotated files that are its successors, not its copies."""
        if self._fd is None or self._offset or self._head or st is None \
                or (st.st_dev, st.st_ino) != self._identity:
            return None
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return None
        if size == 0:
            if self._siblings_while_empty is None:
                self._siblings_while_empty = frozenset(self._sibling_identities())
            return None
        before, self._siblings_while_empty = self._siblings_while_empty, None
        if before is None:
            return None
        head = self._read_head()
        live_birth = birth.fd_birth_ns(self._fd)
        for path, fd, fst in self._open_copies(skip=before):
            born = birth.fd_birth_ns(fd) if live_birth is not None else None
            if born is not None and live_birth is not None and born < live_birth:
                # Older than the log: not its copy, a rotated file that a listing taken while
                # logrotate renamed files (`.N` to `.N+1`) missed when the log was seen empty.
                os.close(fd)
                continue
            try:
                first = os.pread(fd, HEAD_BYTES, 0)
            except OSError:
                first = b""
            if first and first[: len(head)] != head[: len(first)]:
                log.debug("%s was copied and truncated before its first read: reading %s first", self.path, path)
                return fd, fst
            os.close(fd)  # the log still starts with its bytes: a copy, not truncated
        return None

    def _open_copies(self, skip: AbstractSet[Tuple[int, int]] = frozenset()) -> Iterator[Tuple[str, int, os.stat_result]]:
        """The rotated files beside the log that may be a copy of it, newest first, each
        opened: (path, fd, fstat); the caller closes the fd. Not the file followed, not an
        empty one, not one in `skip` (identities)."""
        for path, est in sorted(self._rotated_siblings(), key=lambda c: -c[1].st_mtime_ns):
            identity = (est.st_dev, est.st_ino)
            if identity == self._identity or identity in skip or est.st_size == 0:
                continue
            try:
                fd, fst = open_regular(path)
            except OSError:
                continue
            yield path, fd, fst

    def _sibling_identities(self) -> List[Tuple[int, int]]:
        return [(est.st_dev, est.st_ino) for _, est in self._rotated_siblings()]

    def _follow_copy(self, fd: int, fst: os.stat_result) -> None:
        """Read the copy of the current file from where the file was left (offset 0)."""
        live = self._identity
        self._close_current()
        self._fd, self._identity = fd, (fst.st_dev, fst.st_ino)
        self._head = self._read_head()
        self._copy_of = live

    # Rotation by `copy` and a collapse of the copied bytes (deploy/systemd/mps-log-collapse):
    # the log loses its first N bytes, N the copy's length C rounded down to the file
    # system's block size, so its first C - N bytes are the copy's last ones.

    def _collapsed_in_place(self, copy_fd: int, c: int) -> bool:
        """The log (the open file) shrank or changed its head, and its verified copy (`c`
        bytes) ends at or before the read offset: if the log is that file less its first N
        bytes (its first c - N bytes are the copy's last ones, and the bytes read just
        before the offset are at offset - N), go on there and say True. False: truncated,
        start again from 0 (the usual copytruncate)."""
        assert self._fd is not None
        o = self._offset
        try:
            n = c - c % _block_size(self._fd)
            k, live_size = c - n, os.fstat(self._fd).st_size
            t = min(TAIL_BYTES, len(self._recent), o - n)
            if n <= 0 or t <= 0 or live_size < o - n:
                return False
            first = os.pread(self._fd, max(k, HEAD_BYTES), 0)  # one read: the head kept is the one checked
            if k and first[:k] != os.pread(copy_fd, k, n):
                return False
            if os.pread(self._fd, t, o - n - t) != bytes(self._recent[-t:]):
                return False
        except OSError:
            return False
        self._offset, self._line_start = o - n, max(0, self._line_start - n)
        self._head, self._size_seen = first[:HEAD_BYTES], live_size
        log.debug("%s: its first %d bytes were collapsed away after a copy: going on at %d", self.path, n, o - n)
        return True

    def _collapsed_successor(self, st: os.stat_result) -> Optional[Tuple[int, os.stat_result, int, bytes]]:
        """At the end of a copy read after a rotation: the log it is a copy of, under the
        name still, whose first k = C - N bytes (k > 0) are the copy's last ones: (fd,
        fstat, k, its first bytes as checked). None: read the log from its start (a truncate; or N = C, where both
        mean the same)."""
        live = self._copy_of
        if live is None or self._fd is None or (st.st_dev, st.st_ino) != live:
            return None
        c = self._offset
        try:
            if os.fstat(self._fd).st_size != c:
                return None
            fd, fst = open_regular(self.path)
        except OSError:
            return None
        try:
            n = c - c % _block_size(fd)
            k = c - n
            first = os.pread(fd, max(k, HEAD_BYTES), 0)  # one read: the head kept is the one checked
            if (fst.st_dev, fst.st_ino) == live and 0 < k <= len(first) and first[:k] == os.pread(self._fd, k, n):
                return fd, fst, k, first[:HEAD_BYTES]
        except OSError:
            pass
        os.close(fd)
        return None

    def _chained_copy(self, live: Tuple[int, int], c: int, recent: bytearray, partial: bytes, dropping: bool,
                      line_start: int) -> bool:
        """Two collapses before the follower came: the copy just read to its end (`c`
        bytes, read last `recent`) is followed by the next copy, whose first c % block
        bytes are its last ones. Go on after them (as in the log after one collapse) and
        say True; the next copy is a copy of the log too."""
        if self._fd is None or self._offset:
            return False
        try:
            k = c % _block_size(self._fd)
            first = os.pread(self._fd, max(k, HEAD_BYTES), 0)
        except OSError:
            return False
        if not k or len(recent) < k or first[:k] != bytes(recent[-k:]):
            return False
        self._offset, self._line_start = k, max(0, line_start - (c - k))
        self._partial, self._dropping, self._recent = partial, dropping, recent
        self._head, self._copy_of = first[:HEAD_BYTES], live
        log.debug("%s: the next copy starts with the last %d bytes of the one before: going on there", self.path, k)
        return True

    def _continue_collapsed(self, fd: int, fst: os.stat_result, k: int, head: bytes) -> None:
        """Leave the copy (read to its end C) for the log at k: its first k bytes are the
        copy's last ones, read already. The partial line goes on (its rest follows at k)."""
        c, line_start = self._offset, self._line_start
        self._finish_file()
        self._fd, self._identity = fd, (fst.st_dev, fst.st_ino)
        self._offset, self._line_start = k, max(0, line_start - (c - k))
        self._head, self._size_seen, self._copy_of = head, 0, None
        log.debug("%s: after its copy, going on at %d (the copy's last %d bytes were left at its head)",
                  self.path, k, k)

    def _read_head(self) -> bytes:
        try:
            return os.pread(self._fd, HEAD_BYTES, 0) if self._fd is not None else b""
        except OSError:
            return b""

    def _rewritten(self) -> bool:
        """Truncated (copytruncate), collapsed, or rewritten from the start since we last
        looked: shorter than the offset or than it was seen, other first bytes, or other
        bytes just before the offset."""
        if self._fd is None:
            return False
        try:
            size = os.fstat(self._fd).st_size
        except OSError:
            return False
        if size < max(self._offset, self._size_seen):
            return True
        self._size_seen = size
        head = self._read_head()
        if head[: len(self._head)] != self._head:
            return True
        # And the bytes just before the offset: after a collapse the log starts mid-line,
        # where a run of equal bytes can make its first bytes look unchanged.
        t = min(TAIL_BYTES, len(self._recent), self._offset)
        try:
            if t and os.pread(self._fd, t, self._offset - t) != bytes(self._recent[-t:]):
                return True
        except OSError:
            pass
        self._head = head
        return False

    def poll_text(self) -> Tuple[str, int]:
        """poll()'s lines as one text, each line ended by a newline ("" for none), and how
        many of them were cut to the cap: the same lines, without a string made for each
        (logs/bulk.py and logs/echoes.py scan a batch's text whole, and count its lines)."""
        self._chunked = True
        try:
            chunks, truncated = self.poll()
        finally:
            self._chunked = False
        return ("\n".join(chunks) + "\n" if chunks else ""), truncated

    def _restart_file(self) -> None:
        self._offset = self._line_start = 0
        self._partial, self._dropping, self._recent = b"", False, bytearray()
        self._size_seen, self._siblings_while_empty, self._copy_of = 0, None, None
        self._head = self._read_head()

    def _read(self, lines: List[str], max_bytes: int) -> int:
        truncated, budget = 0, MAX_POLL_BYTES
        while self._fd is not None:
            # Past max_bytes only while no line came out (one long line must not look like
            # the end of the file), and never past MAX_POLL_BYTES: `more` says to come back.
            if max_bytes <= 0 and lines or budget <= 0:
                self.more = True
                break
            # The bytes just before the offset are read again with the new ones: a file
            # collapsed or truncated since the look at it (rotation between the two) no
            # longer has them there, and the next look finds why (_rewritten).
            t = min(TAIL_BYTES, len(self._recent), self._offset)
            try:
                data = os.pread(self._fd, (min(READ_SIZE, max_bytes) if max_bytes > 0 else READ_SIZE) + t,
                                self._offset - t)
            except OSError as e:
                self._problem = read_error(self.path, e)
                break
            if t:
                if data[:t] != self._recent[-t:]:
                    break  # the next look finds what happened
                data = data[t:]
            if not data:
                break
            self._offset += len(data)
            self._recent += data[-RECENT_BYTES:]
            if len(self._recent) > 2 * RECENT_BYTES:  # trimmed now and then, not on every read
                del self._recent[:-RECENT_BYTES]
            max_bytes -= len(data)
            budget -= len(data)
            truncated += self._split(data, lines)
        return truncated

    def _split(self, data: bytes, lines: List[str]) -> int:
        last_nl = data.rfind(b"\n")
        if last_nl >= 0:  # file offsets count the raw bytes, NULs included
            self._line_start = self._offset - (len(data) - last_nl - 1)
        if b"\x00" in data:
            data = data.replace(b"\x00", b"")
            last_nl = data.rfind(b"\n")
        if last_nl < 0:
            self._grow_partial(data)
            return 0
        cap, truncated = self.max_line_bytes, 0
        first_nl = data.find(b"\n")
        if self._dropping:
            first, truncated = self._partial, 1
        else:
            first = self._partial + data[:first_nl]
        self._partial, self._dropping = b"", False
        if len(first) > cap:
            first, truncated = first[:cap], truncated + 1
        lines.append(first.decode("utf-8", "replace"))
        if last_nl > first_nl:
            text = data[first_nl + 1:last_nl].decode("utf-8", "replace")
            if self._chunked and _within_cap(text, cap):  # poll_text: the lines as they are, joined
                lines.append(text)
            else:
                middle = text.split("\n")
                if max(map(len, middle)) > cap:  # rare: only then line by line
                    for i, line in enumerate(middle):
                        if len(line) > cap:
                            middle[i], truncated = line[:cap], truncated + 1
                lines.extend(middle)
        self._grow_partial(data[last_nl + 1:])
        return truncated

    def _grow_partial(self, data: bytes) -> None:
        if self._dropping or not data:
            return
        if len(self._partial) + len(data) > self.max_line_bytes:
            self._partial = (self._partial + data)[: self.max_line_bytes]
            self._dropping = True
        else:
            self._partial += data

    @staticmethod
    def _decode(data: bytes) -> str:
        return data.replace(b"\x00", b"").decode("utf-8", "replace")


# _within_cap looks at blocks no shorter than this; a smaller cap (tests) is checked line by line.
MIN_CAP_BLOCK = 1024


def _within_cap(text: str, cap: int) -> bool:
    """True where no line of text is longer than cap, found without splitting it: a line of
    cap + 1 characters or more holds a whole one of the blocks of `block` characters the
    text is cut into (2 * block - 1 <= cap + 1), so a block without a newline is the only
    sign of one. False: maybe (a block without a newline, or a cap too small to look so)."""
    block = (cap + 2) // 2
    if block < MIN_CAP_BLOCK:
        return False
    find = text.find
    for start in range(0, len(text) - block + 1, block):
        if find("\n", start, start + block) < 0:
            return False
    return True


def _block_size(fd: int) -> int:
    """The file system's block size, as `stat -f -c %S` prints it (fallocate's unit)."""
    st = os.fstatvfs(fd)
    return st.f_frsize or st.f_bsize or 1


def _rotation_number(path: str) -> int:
    """logrotate's N of `name.N` (higher: older); 0 for other names."""
    suffix = path.rsplit(".", 1)[-1]
    return int(suffix) if ascii_digits(suffix) else 0
