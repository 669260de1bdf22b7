"""HTTP serving the Prometheus-exporter way: /metrics, a landing page, /-/healthy.

The web config (TLS, basic auth, headers, rate limit) is parsed in webconfig.py;
this module serves it. Under load it behaves like node_exporter's Go server:

- idle connections cost no thread: one thread holds every connection in epoll
  until a whole request head is in, then a small pool answers it; connections are
  capped (the longest idle closed first), the soft file limit is raised to the hard
  one, EMFILE backs off, and a connection that sends no whole request head within
  10 s is closed (docs/http.md: 1,100 silent or 2,000 idle connections);
- request heads are parsed here (parse_head) and protocol errors answered as
  Go's net/http answers them: 400, 431, 501, 505, then close;
- the listen backlog is the system's (net.core.somaxconn), not socketserver's 5,
  so a burst of connections waits in the kernel instead of being dropped;
- every response goes out in one write with TCP_NODELAY, so back-to-back
  requests on a keep-alive connection do not wait for a delayed ACK;
- at most `max_requests` scrapes of /metrics run at once (`--web.max-requests`,
  as node_exporter's); more get 503 at once;
- the rate limit and basic auth come before anything else, whatever the method;
  the result of a bcrypt check, failed or not, is cached (as exporter-toolkit
  does), and unknown users are checked against a decoy hash of the configured
  cost, so neither a repeated wrong password nor a user name costs a full check
  or shows in the timing;
- plain HTTP sent to the TLS port gets Go's 400 answer; no Server header, so
  the version is shown only on the landing page, behind auth;
- TLS handshakes run on their own thread, never on the connection-watching one: at
  most MAX_HANDSHAKES at once (the oldest closed for a new one), each within
  HANDSHAKE_TIMEOUT, and the C heap is given back once a flood of them is over.
"""

from __future__ import annotations

import _thread
import base64
import binascii
import collections
import contextlib
import ctypes
import email.utils
import errno
import gzip
import hashlib
import html
import logging
import os
import queue
import re
import resource
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Protocol, Tuple, Union, runtime_checkable
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector, CollectorRegistry

from .. import __version__, runbook
from ..config import GZIP_LEVEL, Config
from ..scrape_timeout import scrape_timeout
from .webconfig import (RateLimit, TLSContextSource, WebConfig, WebConfigWatch, bcrypt_cost, peer_sans,
                        resolve_listen_address)

log = logging.getLogger(__name__)


@runtime_checkable
class SelfEncoding(Protocol):
    """A registry that encodes a scrape's body itself (collector.Exposition: it reuses what
    did not change); the server knows it by this method alone, not by the collector."""

    def encode(self, encoder: Callable[[Any], bytes], content_type: str, gzip: bool) -> bytes: ...

HEALTH_PATH = "/-/healthy"
READY_PATH = "/-/ready"  # 503 while a source is not ready to serve the truth (the logs catching up)
# Go's answer to a plain HTTP request on a TLS port (net/http server.go).
_PLAIN_HTTP_ON_TLS = b"HTTP/1.0 400 Bad Request\r\n\r\nClient sent an HTTP request to an HTTPS server.\n"


def system_backlog() -> int:
    """The kernel's accept-queue limit, as Go's net package reads it."""
    try:
        with open("/proc/sys/net/core/somaxconn", encoding="ascii") as f:
            return max(min(int(f.read().strip()), 65535), 128)
    except (OSError, ValueError):
        return socket.SOMAXCONN


# --------------------------------------------------------------------------
# Request guards: basic auth, rate limit
# --------------------------------------------------------------------------

class BasicAuth:
    """Checks `Authorization: Basic` headers against bcrypt hashes.

    bcrypt costs ~70 ms at cost 10 and ~260 ms at cost 12, and Prometheus sends
    the same credentials every scrape, so every outcome (right or wrong) is
    cached by a SHA-256 of user, hash and password (never the password itself),
    as exporter-toolkit does. Wrong answers are evicted first, so a flood of
    guesses cannot push out the scraper's entry. Checks run one at a time so a
    burst of bad requests cannot occupy every core.
    """

    def __init__(self, users: Mapping[str, bytes], cache_seconds: float = 60.0, cache_size: int = 100,
                 decoy: Optional[bytes] = None) -> None:
        import bcrypt  # present: webconfig checked it for any config with users

        self._bcrypt = bcrypt
        self._users = dict(users)
        self._cache_seconds = cache_seconds
        self._cache_size = cache_size
        self._cache: "collections.OrderedDict[bytes, Tuple[float, bool]]" = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()
        # An unknown user is checked against a hash of the cost the real users have,
        # so that a wrong user name costs what a wrong password costs.
        self.decoy = decoy or bcrypt.hashpw(os.urandom(16).hex().encode(), bcrypt.gensalt(decoy_cost(users.values())))

    def check(self, header: Optional[str]) -> bool:
        credentials = _parse_basic_header(header)
        if credentials is None:
            return False
        user, password = credentials
        hashed = self._users.get(user)
        known = hashed is not None
        if hashed is None:
            hashed = self.decoy
        key = hashlib.sha256(b"\0".join((user.encode("utf-8"), hashed, password))).digest()
        now = time.monotonic()
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > now:
                return cached[1]
        with self._bcrypt_lock:
            try:
                ok = self._bcrypt.checkpw(password, hashed) and known
            except ValueError:  # e.g. a password over bcrypt's 72-byte limit
                ok = False
        self._remember(key, now + self._cache_seconds, ok)
        return ok

    def _remember(self, key: bytes, expires: float, ok: bool) -> None:
        with self._cache_lock:
            if key not in self._cache and len(self._cache) >= self._cache_size:
                now = time.monotonic()
                stale = [k for k, (t, _) in self._cache.items() if t <= now]
                wrong = [k for k, (_, good) in self._cache.items() if not good]
                for k in stale or wrong[:1] or list(self._cache)[:1]:
                    del self._cache[k]
            self._cache[key] = (expires, ok)


def decoy_cost(hashes: Iterable[bytes]) -> int:
    """The most common cost among the configured hashes (the higher one on a tie)."""
    counts = collections.Counter(bcrypt_cost(h) for h in hashes)
    if not counts:
        return 10
    return max(counts, key=lambda cost: (counts[cost], cost))


def _parse_basic_header(header: Optional[str]) -> Optional[Tuple[str, bytes]]:
    if not header:
        return None
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(b":")
    if not sep:
        return None
    return user.decode("utf-8", "replace"), password


class TokenBucket:
    """The toolkit's rate_limit: one token every `interval`, at most `burst` saved
    (a burst of 0 refuses every request, as Go's rate.Limiter does)."""

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = 1.0 / limit.interval_seconds
        self._burst = float(limit.burst)
        self._tokens = float(limit.burst)
        self._clock = clock
        self._last = clock()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


# --------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------

class _Guards:
    """What one version of the web config file decides for a request."""

    def __init__(self, config: WebConfig, previous: Optional["_Guards"] = None) -> None:
        self.config = config
        # The decoy hash costs a full bcrypt: a new file whose users have the same cost keeps it.
        before: Optional[BasicAuth] = previous.auth if previous is not None else None
        decoy = before.decoy if before is not None and bcrypt_cost(before.decoy) == decoy_cost(config.users.values()) \
            else None
        self.auth: Optional[BasicAuth] = BasicAuth(config.users, decoy=decoy) if config.users else None
        self.limiter = TokenBucket(config.rate_limit) if config.rate_limit else None


def _always_ready() -> bool:
    return True


class _App:
    def __init__(self, registry: Collector, telemetry_path: str, config: WebConfig, max_requests: int,
                 ready: Callable[[], bool] = _always_ready, notice: str = "") -> None:
        self.registry = registry
        self.notice = notice  # said on the landing page (replay: what is played)
        self.ready = ready
        self.telemetry_path = telemetry_path
        self.web_config = WebConfigWatch(config)
        self._guards = _Guards(config)
        self.max_requests = max_requests
        # Scrapes in flight; None: no cap (--web.max-requests 0).
        self.scrapes = threading.BoundedSemaphore(max_requests) if max_requests > 0 else None

    def guards(self) -> _Guards:
        """Auth, rate limit and headers of the web config in force (re-read when its file
        changed: a new BasicAuth, so no cached answer outlives a removed password)."""
        config = self.web_config.current()
        guards = self._guards
        if config is not guards.config:
            guards = self._guards = _Guards(config, guards)
        return guards

    @property
    def config(self) -> WebConfig:
        return self.guards().config

    @property
    def auth(self) -> Optional[BasicAuth]:
        return self.guards().auth


# --------------------------------------------------------------------------
# Requests: the head of one HTTP/1.x request, parsed from bytes (pure)
# --------------------------------------------------------------------------

MAX_HEAD_BYTES = 64 * 1024  # request line and headers; more gets 431, as Go past its limit
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_VERSION = re.compile(rb"^HTTP/(\d)\.(\d)$")


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    version: str  # "HTTP/1.0" or "HTTP/1.1"
    headers: Mapping[str, str]  # lower-case names; repeated headers joined with ", "
    keep_alive: bool
    has_body: bool  # a body we do not read: the connection closes after the answer


@dataclass(frozen=True)
class ProtocolError:
    """A request that gets an error answer and a closed connection, as Go's server does."""

    status: HTTPStatus
    reason: str


def parse_head(data: bytes) -> Tuple[Optional[Union[Request, ProtocolError]], int]:
    """(the request or its error, bytes used) from the start of `data`; (None, 0) while
    incomplete. The request line is judged as soon as it is complete, so an HTTP/0.9
    request (`GET /`, which never sends a blank line) is answered at once."""
    line_end = data.find(b"\n")
    if line_end < 0:
        return (ProtocolError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request line too long"), len(data)) \
            if len(data) > MAX_HEAD_BYTES else (None, 0)
    parts = data[:line_end].rstrip(b"\r").split(b" ")
    if len(parts) != 3 or not parts[1]:
        return ProtocolError(HTTPStatus.BAD_REQUEST, "malformed HTTP request"), line_end + 1
    method, target, proto = parts
    if not _TOKEN.match(method):
        return ProtocolError(HTTPStatus.BAD_REQUEST, "invalid method"), line_end + 1
    version = _VERSION.match(proto)
    if version is None:
        return ProtocolError(HTTPStatus.BAD_REQUEST, "malformed HTTP version"), line_end + 1
    if method == b"PRI" and target == b"*" and proto == b"HTTP/2.0":  # HTTP/2's preface: Go's mux says 400
        return ProtocolError(HTTPStatus.BAD_REQUEST, "HTTP/2 is not served here"), line_end + 1
    if version.group(1) != b"1":  # HTTP/0.x, 2, 9.9...
        return ProtocolError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "unsupported protocol version"), line_end + 1
    ends = [i for i in (data.find(b"\n\r\n", line_end), data.find(b"\n\n", line_end)) if i >= 0]
    if not ends:
        return (ProtocolError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too long"), len(data)) \
            if len(data) > MAX_HEAD_BYTES else (None, 0)
    end = min(ends)
    used = end + (3 if data[end:end + 3] == b"\n\r\n" else 2)
    if used > MAX_HEAD_BYTES:
        return ProtocolError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "headers too long"), used
    headers: Dict[str, str] = {}
    hosts = 0
    key = ""
    for raw in data[line_end + 1:end].split(b"\n") if end > line_end else ():
        if raw[:1] in (b" ", b"\t") and key:  # an obsolete folded line continues the last header, as in Go
            headers[key] = f"{headers[key]} {raw.strip().decode('latin-1')}"
            continue
        name, colon, value = raw.rstrip(b"\r").partition(b":")
        if not colon or not _TOKEN.match(name):  # no colon, or a space before it
            return ProtocolError(HTTPStatus.BAD_REQUEST, "malformed MIME header line"), used
        key = name.decode("ascii").lower()
        text = value.strip(b" \t").decode("latin-1")
        hosts += key == "host"
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    minor = version.group(2)
    if minor != b"0" and hosts == 0:
        return ProtocolError(HTTPStatus.BAD_REQUEST, "missing required Host header"), used
    if hosts > 1:
        return ProtocolError(HTTPStatus.BAD_REQUEST, "too many Host headers"), used
    length = headers.get("content-length")
    if length is not None and not all(v.strip().isdigit() and v.strip() == length.split(",")[0].strip()
                                      for v in length.split(",")):
        return ProtocolError(HTTPStatus.BAD_REQUEST, "bad Content-Length"), used
    coding = headers.get("transfer-encoding")
    if coding is not None and coding.lower() != "chunked":
        return ProtocolError(HTTPStatus.NOT_IMPLEMENTED, "unsupported transfer encoding"), used
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "keep-alive" in tokens if minor == b"0" else "close" not in tokens
    has_body = coding is not None or (length is not None and int(length.split(",")[0]) > 0)
    return Request(method.decode("ascii"), target.decode("latin-1"), "HTTP/1." + minor.decode(),
                   headers, keep_alive, has_body), used


def error_answer(error: ProtocolError) -> bytes:
    """Go's answer to a request it cannot serve: status, a one-line body, close."""
    text = f"{error.status.value} {error.status.phrase}: {error.reason}"
    return (f"HTTP/1.1 {error.status.value} {error.status.phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n{text}").encode("latin-1")


# --------------------------------------------------------------------------
# The server: one thread watches every connection, a few threads answer
# --------------------------------------------------------------------------

# A connection must send a whole request head within this long of connecting (or of
# its first byte after an idle spell): a silent or trickling client is closed.
HEAD_TIMEOUT = 10.0
# A kept-alive connection may sit idle this long between requests (Prometheus
# scrapes every 15 s to a few minutes on one connection).
IDLE_TIMEOUT = 300.0
# Writing one answer may take this long (a client that stops reading).
WRITE_TIMEOUT = 30.0
# After a last answer the write side is shut and what the client still sends is read
# and dropped for this long, so that closing does not reset the connection (and the
# answer with it) while the client's unread bytes are in our buffer; Go waits 500 ms.
LINGER_TIMEOUT = 0.5
# Open connections at most, whatever the file limit allows; past it the connection
# idle longest is closed to make room.
MAX_CONNECTIONS = 10_000
# Descriptors kept for everything else (logs, NVML, control pipes, the state file).
RESERVED_FDS = 128
# After accept() fails for want of descriptors: wait this long before accepting again.
ACCEPT_BACKOFF = 0.1
MAX_WORKERS = 64  # threads answering requests at once, at most
# TLS handshakes in progress at once, at most (each holds ~45 KB of OpenSSL's and
# Python's); past it the oldest is closed for the new one, so a flood of hanging
# ClientHellos costs bounded memory (~23 MB) and a scraper's handshake is never the
# oldest: at 200 hanging hellos a second it has 2.5 s to finish.
MAX_HANDSHAKES = 512
# A TLS handshake must be done within this long of its first byte.
HANDSHAKE_TIMEOUT = 5.0
# New TLS connections begun between two looks at the handshakes under way.
TAKE_IN_BATCH = 8


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as Go's runtime does since 1.19);
    return the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as e:
            log.warning("cannot raise the open file limit from %d to %d: %s", soft, target, e)
    return soft


def connection_cap(soft_limit: int) -> int:
    return max(16, min(MAX_CONNECTIONS, soft_limit - RESERVED_FDS))


class _Conn:
    """One client connection while the watcher holds it (not while a worker answers)."""

    __slots__ = ("fd", "sock", "peer", "buffer", "since", "tls_done", "served")

    def __init__(self, sock: socket.socket, peer: Any, tls: bool) -> None:
        self.fd = sock.fileno()
        self.sock: socket.socket = sock
        self.peer = peer
        self.buffer = b""
        self.since = time.monotonic()  # when the current wait (for a head, or idle) began
        self.tls_done = not tls
        self.served = 0


def release_memory() -> bool:
    """Return the C heap's free memory to the system (glibc's malloc_trim); False where
    the C library has none (musl)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _malloc_trim = False
    if _malloc_trim is False:
        return False
    _malloc_trim(0)
    return True


_malloc_trim: Any = None


class _Handshakes:
    """TLS handshakes on their own thread ("web-tls"), off the thread that watches the
    connections: the watcher hands over a connection once its first byte has come (and is
    not plain HTTP), this thread wraps it and steps its handshake as the client's bytes
    arrive, and gives it back through `done(conn, True)` once the handshake is done (or
    `done(conn, False)` once it has closed it). Bounded in number (at most `limit` at
    once: the oldest is closed for a new one) and in time (`timeout` from the hand-over).
    `clock` is injected so that tests decide when a handshake is late."""

    def __init__(self, tls: Callable[[], Optional[TLSContextSource]], done: Callable[[_Conn, bool], None],
                 limit: int = MAX_HANDSHAKES, timeout: float = HANDSHAKE_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tls = tls
        self._done = done
        self.limit = max(1, limit)
        self.timeout = timeout
        self._clock = clock
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._incoming: "collections.deque[_Conn]" = collections.deque()
        self._conns: "collections.OrderedDict[int, _Conn]" = collections.OrderedDict()  # oldest first
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self.evicted = 0  # closed to make room for a newer one
        self.expired = 0  # closed for taking longer than `timeout`
        self._since_release = 0  # handshakes begun since memory was last given back

    @property
    def in_progress(self) -> int:
        return len(self._conns)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="web-tls", daemon=True)
            self._thread.start()

    def submit(self, conn: _Conn) -> None:
        """From the watcher: the connection is this thread's until `done` is called."""
        self._incoming.append(conn)
        self.poke()

    def poke(self) -> None:
        """Wake the thread (a new connection, a clock moved in a test, stop)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def close(self) -> None:
        """Stop the thread and close every connection it holds."""
        self._stop = True
        self.poke()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for conn in list(self._conns.values()) + list(self._incoming):
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.clear()
        self._incoming.clear()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        self._selector.register(self._wake_r.fileno(), selectors.EVENT_READ, None)
        while not self._stop:
            now = self._clock()
            wait = 0.0 if self._incoming else 0.5  # more to take in: only look at what is ready
            if self._conns:
                wait = min(wait, max(0.0, next(iter(self._conns.values())).since + self.timeout - now))
            for key, _ in self._selector.select(wait):
                conn: Optional[_Conn] = key.data
                if conn is None:
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                elif self._conns.get(key.fd) is conn:  # not finished earlier in this batch
                    self._step(conn)
            self._take_in()
            self._expire(self._clock())
            self._settle()

    def _settle(self) -> None:
        """Once a flood of handshakes is over (none in progress after more than `limit`
        since the last time), give the freed memory back to the system: OpenSSL's
        buffers are malloc'ed by this thread, and glibc keeps a thread's freed heap."""
        if not self._conns and not self._incoming and self._since_release > self.limit:
            self._since_release = 0
            release_memory()

    def _take_in(self) -> None:
        """Begin the handshakes of a few new connections (not all that wait: a flood of
        them must not delay the handshakes whose next bytes are in)."""
        for _ in range(TAKE_IN_BATCH):
            if not self._incoming or self._stop:
                return
            conn = self._incoming.popleft()
            while len(self._conns) >= self.limit:
                self.evicted += 1
                oldest = next(iter(self._conns.values()))
                log.debug("closing the TLS handshake with %s: %d in progress", oldest.peer[0], len(self._conns))
                self._finish(oldest, False)
            tls = self._tls()
            if tls is None:
                self._finish(conn, False)
                continue
            try:
                conn.sock = tls.context().wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
            except (OSError, ssl.SSLError) as e:
                log.debug("TLS with %s failed: %s", conn.peer[0], e)
                self._finish(conn, False)
                continue
            conn.since = self._clock()
            self._since_release += 1
            self._conns[conn.fd] = conn
            self._selector.register(conn.fd, selectors.EVENT_READ, conn)
            self._step(conn)  # its first bytes are in already

    def _step(self, conn: _Conn) -> None:
        """Advance the handshake as far as the bytes in allow, without blocking."""
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
            return
        except (OSError, ssl.SSLError) as e:
            log.debug("TLS handshake with %s failed: %s", conn.peer[0], e)
            self._finish(conn, False)
            return
        tls = self._tls()
        sans = tls.settings.allowed_sans if tls is not None else ()
        if sans and not set(peer_sans(sock.getpeercert())) & set(sans):
            log.warning("client certificate of %s has none of the allowed SANs", conn.peer[0])
            self._finish(conn, False)
            return
        conn.tls_done = True
        self._finish(conn, True)

    def _want(self, conn: _Conn, events: int) -> None:
        if self._selector.get_key(conn.fd).events != events:
            self._selector.modify(conn.fd, events, conn)

    def _expire(self, now: float) -> None:
        while self._conns:
            conn = next(iter(self._conns.values()))
            if conn.since + self.timeout > now:
                break
            self.expired += 1
            log.debug("closing the TLS handshake with %s: not done in %.0f s", conn.peer[0], self.timeout)
            self._finish(conn, False)

    def _finish(self, conn: _Conn, ok: bool) -> None:
        if self._conns.pop(conn.fd, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.fd)
        if not ok:
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._done(conn, ok)


class ExporterServer:
    """HTTP/1.1 for the exporter. Idle connections cost no thread: one watcher thread
    (serve_forever) holds every connection in epoll until a whole request head has
    arrived, then hands it to a small pool of workers, which give kept-alive
    connections back. So a flood of silent or idle connections costs descriptors and
    memory only, and both are capped: the soft file limit is raised to the hard one,
    at most `max_connections` are open (the longest idle is closed for a new one),
    accept() failing with EMFILE/ENFILE backs off instead of spinning, and a
    connection that has not sent a whole request head within HEAD_TIMEOUT is closed."""

    def __init__(self, listen_address: str, app: _App, max_connections: Optional[int] = None,
                 listener: Optional[socket.socket] = None) -> None:
        """`listener`: a socket already bound and listening (systemd's), served instead of
        binding `listen_address`."""
        self.request_queue_size = system_backlog()
        self.app = app
        self.max_connections = max_connections or connection_cap(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        if listener is not None:
            self.socket = listener
            self.address_family = listener.family
            self._dual_stack = listener.family == socket.AF_INET6 and not listener.getsockopt(
                socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
        else:
            where = resolve_listen_address(listen_address)
            self.address_family = where.family
            self._dual_stack = where.dual_stack
            self.socket = socket.socket(where.family, socket.SOCK_STREAM)
            try:
                self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if self._dual_stack:
                    self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                self.socket.bind((where.host, where.port))
                self.socket.listen(self.request_queue_size)
            except BaseException:
                self.socket.close()
                raise
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.server_port = int(self.server_address[1])
        self._selector = selectors.DefaultSelector()
        self._waiting: "collections.OrderedDict[int, _Conn]" = collections.OrderedDict()  # for a request head
        self._idle: "collections.OrderedDict[int, _Conn]" = collections.OrderedDict()  # kept alive, silent
        self._closing: "collections.OrderedDict[int, _Conn]" = collections.OrderedDict()  # answered, lingering
        self._busy = 0  # connections a worker holds
        self._accept_paused_until = 0.0
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._returned: "collections.deque[Tuple[_Conn, bool]]" = collections.deque()
        # TLS handshakes run on their own thread (_Handshakes); the count is the watcher's.
        self._handshakes = _Handshakes(lambda: self.tls, self._handshaken, MAX_HANDSHAKES, HANDSHAKE_TIMEOUT) \
            if self.tls is not None else None
        self._handshaking = 0
        self._shaken: "collections.deque[Tuple[_Conn, bool]]" = collections.deque()
        self._jobs: "queue.SimpleQueue[Optional[Tuple[_Conn, Union[Request, ProtocolError]]]]" = queue.SimpleQueue()
        self._workers = 0
        self._idle_workers = 0
        self._max_workers = max(16, min(MAX_WORKERS, app.max_requests + 8)) if app.max_requests else MAX_WORKERS
        self._pool_lock = threading.Lock()
        self._running = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._stop = False
        self.evicted = 0  # connections closed to make room for new ones
        self._last_fd_warning = 0.0

    # ------------------------------------------------------------ outside view
    def bound_addresses(self) -> str:
        """What the socket really listens on, for the start-up line."""
        host, port = str(self.server_address[0]), self.server_port
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._dual_stack:
            return f"{shown} (every IPv6 and IPv4 address)"
        if host in ("0.0.0.0", "::"):
            return f"{shown} (every {'IPv4' if host == '0.0.0.0' else 'IPv6'} address)"
        return shown

    @property
    def url(self) -> str:
        host = str(self.server_address[0])
        if host in ("::", "0.0.0.0"):
            host = "127.0.0.1" if self.address_family == socket.AF_INET else "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self.tls else 'http'}://{host}:{self.server_port}"

    @property
    def tls(self) -> Optional[TLSContextSource]:
        """The TLS context source of the web config in force (None: plain HTTP)."""
        return self.app.config.tls_context

    @property
    def open_connections(self) -> int:
        return len(self._waiting) + len(self._idle) + len(self._closing) + self._busy + self._handshaking

    def serve_forever(self, poll_interval: Optional[float] = None) -> None:
        """Until shutdown(). `poll_interval`: the longest the watcher sleeps (None: until a
        connection, a worker or a deadline wakes it; an idle exporter then wakes nobody)."""
        self._stop = False
        self._stopped.clear()
        self._running.set()
        self._selector.register(self.socket.fileno(), selectors.EVENT_READ, None)
        self._selector.register(self._wake_r.fileno(), selectors.EVENT_READ, self._wake_r)
        if self._handshakes is not None:
            self._handshakes.start()
        accepting = True
        try:
            while not self._stop:
                now = time.monotonic()
                if not accepting and now >= self._accept_paused_until:
                    self._selector.register(self.socket.fileno(), selectors.EVENT_READ, None)
                    accepting = True
                for key, _ in self._selector.select(self._next_timeout(now, poll_interval)):
                    if key.data is None:
                        self._accept()
                    elif key.data is self._wake_r:
                        self._take_back()
                    else:
                        self._readable(key.data)
                if accepting and self._accept_paused_until > time.monotonic():
                    self._selector.unregister(self.socket.fileno())
                    accepting = False
                self._expire(time.monotonic())
        finally:
            for fd in (self.socket.fileno(), self._wake_r.fileno()):
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(fd)
            self._running.clear()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever and wait for it (from another thread)."""
        self._stop = True
        self._wake()
        if self._running.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        for conns in (self._waiting, self._idle, self._closing):
            for conn in list(conns.values()):
                self._close(conn)
        for _ in range(self._workers):
            self._jobs.put(None)
        if self._handshakes is not None:
            self._handshakes.close()
        while self._shaken:
            with contextlib.suppress(OSError):
                self._shaken.popleft()[0].sock.close()
        self.socket.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------ the watcher
    def _next_timeout(self, now: float, poll_interval: Optional[float]) -> Optional[float]:
        deadlines = [] if poll_interval is None else [poll_interval]
        if self._waiting:
            deadlines.append(next(iter(self._waiting.values())).since + HEAD_TIMEOUT - now)
        if self._idle:
            deadlines.append(next(iter(self._idle.values())).since + IDLE_TIMEOUT - now)
        if self._closing:
            deadlines.append(next(iter(self._closing.values())).since + LINGER_TIMEOUT - now)
        if self._accept_paused_until > now:
            deadlines.append(self._accept_paused_until - now)
        return max(0.0, min(deadlines)) if deadlines else None

    def _expire(self, now: float) -> None:
        for conns, timeout in ((self._waiting, HEAD_TIMEOUT), (self._idle, IDLE_TIMEOUT),
                               (self._closing, LINGER_TIMEOUT)):
            while conns:
                conn = next(iter(conns.values()))
                if conn.since + timeout > now:
                    break
                log.debug("closing connection from %s: %s", conn.peer[0],
                          "no request in time" if conns is self._waiting else "idle")
                self._close(conn)

    def _accept(self) -> None:
        while True:
            if self.open_connections >= self.max_connections and not self._evict_oldest():
                self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF  # every slot is answering
                return
            try:
                sock, peer = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._warn_descriptors(e)
                    if not self._evict_oldest():
                        self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF
                        return
                    continue
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                log.error("accept failed: %s", e)
                self._accept_paused_until = time.monotonic() + ACCEPT_BACKOFF
                return
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            conn = _Conn(sock, peer, self.tls is not None)
            self._waiting[conn.fd] = conn
            self._selector.register(conn.fd, selectors.EVENT_READ, conn)

    def _warn_descriptors(self, e: OSError) -> None:
        now = time.monotonic()
        if now - self._last_fd_warning > 60:
            self._last_fd_warning = now
            log.warning("out of file descriptors accepting a connection (%s, %d open): closing the longest idle",
                        e.strerror, self.open_connections)

    def _evict_oldest(self) -> bool:
        """Close the connection that has waited longest without a request."""
        fronts = [next(iter(c.values())) for c in (self._closing, self._waiting, self._idle) if c]
        if not fronts:
            return False
        self.evicted += 1
        self._close(min(fronts, key=lambda c: c.since))
        return True

    def _readable(self, conn: _Conn) -> None:
        if conn.fd in self._closing:
            self._drain(conn)
            return
        if not conn.tls_done:
            self._start_tls(conn)
            return
        try:
            while True:
                data = conn.sock.recv(65536)
                if not data:
                    self._close(conn)
                    return
                if conn.fd in self._idle:  # a new request begins: its head has HEAD_TIMEOUT
                    del self._idle[conn.fd]
                    conn.since = time.monotonic()
                    self._waiting[conn.fd] = conn
                conn.buffer += data
                if len(conn.buffer) > MAX_HEAD_BYTES or not isinstance(conn.sock, ssl.SSLSocket) \
                        or not conn.sock.pending():
                    break
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        except OSError as e:
            log.debug("connection from %s failed: %s", conn.peer[0], e)
            self._close(conn)
            return
        self._dispatch_if_complete(conn)

    def _start_tls(self, conn: _Conn) -> None:
        """Its first byte has come: plain HTTP gets Go's 400, anything else goes to the
        handshake thread (the watcher never runs a handshake)."""
        assert self._handshakes is not None
        try:
            first = conn.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not first:
            self._close(conn)
            return
        if first.isalpha():  # plain HTTP spoken to the TLS port
            with contextlib.suppress(OSError):
                conn.sock.send(_PLAIN_HTTP_ON_TLS)
                conn.sock.shutdown(socket.SHUT_WR)
            self._waiting.pop(conn.fd, None)
            self._linger(conn)
            return
        self._waiting.pop(conn.fd, None)
        self._selector.unregister(conn.fd)
        self._handshaking += 1
        self._handshakes.submit(conn)

    def _handshaken(self, conn: _Conn, ok: bool) -> None:
        """From the handshake thread: the connection is the watcher's again."""
        self._shaken.append((conn, ok))
        self._wake()

    def _dispatch_if_complete(self, conn: _Conn) -> None:
        request, used = parse_head(conn.buffer)
        if request is None:
            return
        conn.buffer = conn.buffer[used:]
        self._waiting.pop(conn.fd, None)
        self._idle.pop(conn.fd, None)
        self._selector.unregister(conn.fd)
        self._busy += 1
        self._jobs.put((conn, request))
        with self._pool_lock:
            start = self._idle_workers == 0 and self._workers < self._max_workers
            if start:
                self._workers += 1
            elif self._idle_workers:
                self._idle_workers -= 1  # this one is taken: the next job may need a new thread
        if start:
            _thread.start_new_thread(self._work, ())

    def _take_back(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        while self._shaken:
            conn, ok = self._shaken.popleft()
            self._handshaking -= 1
            if not ok:
                continue  # closed by the handshake thread
            if self._stop:
                with contextlib.suppress(OSError):
                    conn.sock.close()
                continue
            conn.since = time.monotonic()  # the head timeout starts after the handshake
            self._waiting[conn.fd] = conn
            self._selector.register(conn.fd, selectors.EVENT_READ, conn)
            self._readable(conn)  # the request may be read already, with the handshake's last bytes
        while self._returned:
            conn, keep = self._returned.popleft()
            self._busy -= 1
            if self._stop:
                self._close(conn)
                continue
            if not keep:
                self._selector.register(conn.fd, selectors.EVENT_READ, conn)
                self._linger(conn)
                continue
            conn.since = time.monotonic()
            conn.served += 1
            self._selector.register(conn.fd, selectors.EVENT_READ, conn)
            if conn.buffer:  # pipelined: the next request is here already
                self._waiting[conn.fd] = conn
                self._dispatch_if_complete(conn)
            else:
                self._idle[conn.fd] = conn

    def _linger(self, conn: _Conn) -> None:
        """Its write side is shut: read and drop what comes until EOF or LINGER_TIMEOUT."""
        conn.since = time.monotonic()
        self._closing[conn.fd] = conn

    def _drain(self, conn: _Conn) -> None:
        try:
            while conn.sock.recv(65536):
                pass
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            pass
        self._close(conn)  # EOF or an error: done

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _close(self, conn: _Conn) -> None:
        held = [c.pop(conn.fd, None) for c in (self._waiting, self._idle, self._closing)]
        if any(c is not None for c in held):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.fd)
        with contextlib.suppress(OSError):
            conn.sock.close()

    # ------------------------------------------------------------ the workers
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, request = job
            keep = False
            try:
                conn.sock.settimeout(WRITE_TIMEOUT)
                if isinstance(request, ProtocolError):
                    log.debug("bad request from %s: %s", conn.peer[0], request.reason)
                    conn.sock.sendall(error_answer(request))
                else:
                    keep = _Exchange(self, conn, request).answer()
                if keep:
                    conn.sock.settimeout(0)
            except (OSError, ssl.SSLError) as e:
                log.debug("connection from %s ended: %s", conn.peer[0], e)
                keep = False
            except Exception:
                log.error("error while serving %s", conn.peer[0], exc_info=True)
                keep = False
            if not keep:  # shut our side; the watcher drains what the client still sends
                with contextlib.suppress(OSError):
                    conn.sock.settimeout(0)
                    conn.sock.shutdown(socket.SHUT_WR)
            self._returned.append((conn, keep))
            with self._pool_lock:
                self._idle_workers += 1
            self._wake()


class _Exchange:
    """One request on one connection, answered by a worker thread."""

    def __init__(self, server: ExporterServer, conn: _Conn, request: Request) -> None:
        self.server = server
        self.conn = conn
        self.command = request.method
        self.path = request.target
        self.request_version = request.version
        self.headers = request.headers
        self.close_connection = not request.keep_alive or request.has_body
        self.guards = server.app.guards()

    def answer(self) -> bool:
        """Serve the request; True when the connection stays open for the next."""
        self._route()
        return not self.close_connection

    def _route(self) -> None:
        app = self.server.app
        guards = self.guards
        if self.command not in ("GET", "HEAD"):
            self.close_connection = True  # its body, if any, is not read
        if guards.limiter is not None and not guards.limiter.allow():
            self._reply(HTTPStatus.TOO_MANY_REQUESTS, b"Too Many Requests\n")
            return
        if guards.auth is not None and not guards.auth.check(self.headers.get("authorization")):
            self._reply(HTTPStatus.UNAUTHORIZED, b"Unauthorized\n", {"WWW-Authenticate": "Basic"})
            return
        if self.command not in ("GET", "HEAD"):
            self._reply(HTTPStatus.METHOD_NOT_ALLOWED, b"Method Not Allowed\n", {"Allow": "GET, HEAD"})
            return
        url = urlsplit(self.path)
        if url.path == app.telemetry_path:
            self._metrics(parse_qs(url.query))
        elif url.path == "/":
            self._reply(HTTPStatus.OK, _landing_page(app.telemetry_path, app.notice), {"Content-Type": "text/html; charset=utf-8"})
        elif url.path == HEALTH_PATH:
            self._reply(HTTPStatus.OK, b"OK")
        elif url.path == READY_PATH:
            if app.ready():
                self._reply(HTTPStatus.OK, b"OK")
            else:
                self._reply(HTTPStatus.SERVICE_UNAVAILABLE, b"Not ready: the logs are being read through their history\n")
        elif url.path == runbook.PATH:
            self._reply(HTTPStatus.OK, runbook.served_page(), {"Content-Type": "text/html; charset=utf-8"})
        else:
            self._reply(HTTPStatus.NOT_FOUND, b"404 page not found\n")

    def _metrics(self, params: Dict[str, List[str]]) -> None:
        app = self.server.app
        if app.scrapes is not None and not app.scrapes.acquire(blocking=False):
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE,
                        f"Limit of concurrent requests reached ({app.max_requests}), try again later.\n".encode())
            return
        try:
            self._scrape(params)
        finally:
            if app.scrapes is not None:
                app.scrapes.release()

    def _scrape(self, params: Dict[str, List[str]]) -> None:
        registry: Collector = self.server.app.registry
        encoder, content_type = choose_encoder(self.headers.get("accept") or "")
        zipped = gzip_accepted(self.headers.get("accept-encoding") or "")
        if params.get("name[]") and isinstance(registry, CollectorRegistry):
            registry = registry.restricted_registry(params["name[]"])
        try:
            with scrape_timeout(self.headers.get("x-prometheus-scrape-timeout-seconds")):
                if isinstance(registry, SelfEncoding):  # the collector's: reuses the readings' encoded part
                    body = registry.encode(encoder, content_type, zipped)
                else:
                    body = encoder(registry)
                    body = gzip.compress(body, compresslevel=GZIP_LEVEL) if zipped else body
        except Exception as e:  # a broken collector must cost one scrape, not the server
            log.error("scrape failed: %s: %s", type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR,
                        f"An error has occurred while serving metrics:\n\n{type(e).__name__}: {e}\n".encode())
            return
        headers = {"Content-Type": content_type}
        if zipped:
            headers["Content-Encoding"] = "gzip"
        self._reply(HTTPStatus.OK, body, headers)

    def _reply(self, status: HTTPStatus, body: bytes, headers: Optional[Dict[str, str]] = None) -> None:
        """Status line, headers and body in one write: two writes on a keep-alive
        connection meet Nagle and the client's delayed ACK (~40 ms a request)."""
        if log.isEnabledFor(logging.DEBUG):  # access logs would be one line per scrape
            log.debug("%s \"%s %s %s\" %d", self.conn.peer[0], self.command, self.path, self.request_version,
                      status.value)
        all_headers = {"Content-Type": "text/plain; charset=utf-8", **(headers or {}), **self.guards.config.headers}
        all_headers["Content-Length"] = str(len(body))
        all_headers["Date"] = email.utils.formatdate(usegmt=True)
        if self.close_connection:
            all_headers["Connection"] = "close"
        elif self.request_version == "HTTP/1.0":  # it asked for keep-alive: say it is kept
            all_headers["Connection"] = "keep-alive"
        head = f"HTTP/1.1 {status.value} {status.phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in all_headers.items())
        payload = head.encode("latin-1") + b"\r\n"
        send_all(self.conn.sock, payload + body if self.command != "HEAD" else payload)


def send_all(sock: socket.socket, data: bytes) -> None:
    """Every answer goes out through here, in one call."""
    sock.sendall(data)


def _landing_page(telemetry_path: str, notice: str = "") -> bytes:
    """`notice`: plain text said first, in bold (what a replay plays)."""
    path = html.escape(telemetry_path, quote=True)
    said = f"<p><strong>{html.escape(notice)}</strong></p>\n" if notice else ""
    return (
        "<!DOCTYPE html>\n<html>\n<head><meta charset=\"utf-8\"><title>MPS Exporter</title></head>\n"
        f"<body>\n<h1>MPS Exporter</h1>\n{said}"
        "<p>Prometheus exporter for NVIDIA MPS (CUDA Multi-Process Service).</p>\n"
        f"<ul>\n<li><a href=\"{path}\">Metrics</a></li>\n<li><a href=\"{HEALTH_PATH}\">Health</a></li>\n"
        f"<li><a href=\"{runbook.PATH}\">Alert runbook</a></li>\n</ul>\n"
        f"<p>Version {html.escape(__version__)}</p>\n</body>\n</html>\n"
    ).encode("utf-8")


def make_server(registry: Collector, listen_address: str, telemetry_path: str = "/metrics",
                web_config: Optional[WebConfig] = None, max_requests: int = Config.max_requests,
                max_connections: Optional[int] = None, listener: Optional[socket.socket] = None,
                readiness: Callable[[], bool] = _always_ready, notice: str = "") -> ExporterServer:
    """Bind (port 0 picks a free port) without serving yet; tests and serve() use it.
    max_connections: None takes what the file limit allows (connection_cap); listener: a
    listening socket to serve instead of binding (systemd socket activation);
    `readiness`: what /-/ready answers (False: 503); `notice`: said on the landing page."""
    return ExporterServer(listen_address, _App(registry, telemetry_path, web_config or WebConfig(), max_requests,
                                               readiness, notice), max_connections, listener)


def serve(registry: Collector, listen_address: str, telemetry_path: str, web_config: Optional[WebConfig], *,
          max_requests: int = Config.max_requests, ready: Optional[threading.Event] = None,
          stop: Optional[threading.Event] = None, listener: Optional[socket.socket] = None,
          readiness: Callable[[], bool] = _always_ready, notice: str = "") -> None:
    """Serve until `stop` is set (or forever). Blocking. Raises OSError when the
    address cannot be bound (nothing is logged as listening then)."""
    raise_open_file_limit()
    server = make_server(registry, listen_address, telemetry_path, web_config, max_requests, listener=listener,
                         readiness=readiness, notice=notice)
    log.info("listening on %s, metrics at %s (TLS %s, basic auth %s, at most %d connections)",
             server.bound_addresses(), telemetry_path, "on" if server.tls else "off",
             "on" if server.app.auth else "off", server.max_connections)
    if stop is not None:
        def stop_when_asked() -> None:
            stop.wait()
            server.shutdown()

        threading.Thread(target=stop_when_asked, name="web-stop", daemon=True).start()
    try:
        if ready is not None:
            ready.set()
        server.serve_forever()
    finally:
        server.server_close()
