"""HTTP serving the Prometheus-exporter way: /metrics, a landing page, /-/healthy.

The web config (TLS, basic auth, headers, rate limit) is parsed in webconfig.py;
this module serves it. Under load it behaves like node_exporter's Go server:

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
  the version is shown only on the landing page, behind auth.
"""

from __future__ import annotations

import _thread
import base64
import binascii
import collections
import gzip
import hashlib
import html
import logging
import os
import socket
import socketserver
import ssl
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from . import __version__, runbook
from .collector import Exposition, scrape_timeout
from .webconfig import RateLimit, WebConfig, bcrypt_cost, peer_sans, resolve_listen_address

log = logging.getLogger(__name__)

HEALTH_PATH = "/-/healthy"
DEFAULT_MAX_REQUESTS = 40  # node_exporter's --web.max-requests default
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

class _App:
    def __init__(self, registry: Collector, telemetry_path: str, config: WebConfig, max_requests: int) -> None:
        self.registry = registry
        self.telemetry_path = telemetry_path
        self.config = config
        self.auth = BasicAuth(config.users) if config.users else None
        self.limiter = TokenBucket(config.rate_limit) if config.rate_limit else None
        self.max_requests = max_requests
        # Scrapes in flight; None: no cap (--web.max-requests 0).
        self.scrapes = threading.BoundedSemaphore(max_requests) if max_requests > 0 else None


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # A TLS handshake or a request that stalls longer than this is dropped.
    socket_timeout = 30.0

    def __init__(self, listen_address: str, app: _App) -> None:
        where = resolve_listen_address(listen_address)
        self.address_family = where.family
        self._dual_stack = where.dual_stack
        self.request_queue_size = system_backlog()
        self.app = app
        self.tls = app.config.tls_context
        super().__init__((where.host, where.port), _Handler)

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.setblocking(False)  # _handle_request_noblock accepts until the queue is empty

    def _handle_request_noblock(self) -> None:
        # socketserver accepts one connection per wake-up of its select loop; under
        # load, connections queued behind a burst then wait on every handler thread
        # for the GIL. Take every queued connection at once.
        while True:
            try:
                request, client_address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            try:
                self.process_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
                self.shutdown_request(request)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Thread.start() waits until the new thread has run, a GIL hand-off that the
        # accept loop pays per connection: with 200 busy connections it falls seconds
        # behind a burst. A raw thread (the same daemon-like thread, no wait) does not.
        _thread.start_new_thread(self.process_request_thread, (request, client_address))

    def server_bind(self) -> None:
        if self._dual_stack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # HTTPServer.server_bind would call getfqdn(): a DNS lookup at start-up.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

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

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The stdlib prints tracebacks to stderr; route them through logging.
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, socket.timeout)):
            log.debug("connection from %s ended: %s", client_address[0], err)
        else:
            log.error("error while serving %s", client_address[0], exc_info=True)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs in the connection's own thread, so a slow TLS handshake holds up
        # only its own connection, never the accept loop.
        request.settimeout(self.socket_timeout)
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        try:
            first = request.recv(1, socket.MSG_PEEK)
        except OSError:
            return
        if first[:1].isalpha():  # not a TLS record: someone speaks plain HTTP to the TLS port
            try:
                request.sendall(_PLAIN_HTTP_ON_TLS)
            except OSError:
                pass
            return
        try:
            conn = self.tls.context().wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as e:
            log.debug("TLS handshake with %s failed: %s", client_address[0], e)
            return
        try:
            sans = self.tls.settings.allowed_sans
            if sans and not set(peer_sans(conn.getpeercert())) & set(sans):
                log.warning("client certificate of %s has none of the allowed SANs", client_address[0])
                return
            super().finish_request(conn, client_address)
        finally:
            conn.close()


class _Handler(BaseHTTPRequestHandler):
    server: ExporterServer
    protocol_version = "HTTP/1.1"  # keep-alive: Prometheus reuses connections

    def handle_one_request(self) -> None:
        # The stdlib's, but every method goes through _route (auth first), not do_<METHOD>.
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = self.command = ""
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
            self._route()
        except TimeoutError as e:
            self.log_error("request timed out: %r", e)
            self.close_connection = True

    def send_response(self, code: int, message: Optional[str] = None) -> None:
        # The stdlib adds `Server: <name>/<version>`; Go's server sends none, nor do we.
        self.log_request(code)
        self.send_response_only(code, message)
        self.send_header("Date", self.date_time_string())

    def _route(self) -> None:
        app = self.server.app
        if self.command not in ("GET", "HEAD"):
            self.close_connection = True  # its body, if any, is not read
        if app.limiter is not None and not app.limiter.allow():
            self._reply(HTTPStatus.TOO_MANY_REQUESTS, b"Too Many Requests\n")
            return
        if app.auth is not None and not app.auth.check(self.headers.get("Authorization")):
            self._reply(HTTPStatus.UNAUTHORIZED, b"Unauthorized\n", {"WWW-Authenticate": "Basic"})
            return
        if self.command not in ("GET", "HEAD"):
            self._reply(HTTPStatus.METHOD_NOT_ALLOWED, b"Method Not Allowed\n", {"Allow": "GET, HEAD"})
            return
        url = urlsplit(self.path)
        if url.path == app.telemetry_path:
            self._metrics(parse_qs(url.query))
        elif url.path == "/":
            self._reply(HTTPStatus.OK, _landing_page(app.telemetry_path), {"Content-Type": "text/html; charset=utf-8"})
        elif url.path == HEALTH_PATH:
            self._reply(HTTPStatus.OK, b"OK")
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
        encoder, content_type = choose_encoder(self.headers.get("Accept") or "")
        zipped = gzip_accepted(self.headers.get("Accept-Encoding") or "")
        if params.get("name[]"):
            registry = _OnlySamples(registry, params["name[]"])
        try:
            with scrape_timeout(self.headers.get("X-Prometheus-Scrape-Timeout-Seconds")):
                if isinstance(registry, Exposition):  # reuses the readings' encoded part
                    body = registry.encode(encoder, content_type, zipped)
                else:
                    body = encoder(registry)
                    body = gzip.compress(body, compresslevel=6) if zipped else body
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
        self.log_request(int(status))
        all_headers = {"Content-Type": "text/plain; charset=utf-8", **(headers or {}), **self.server.app.config.headers}
        all_headers["Content-Length"] = str(len(body))
        all_headers["Date"] = self.date_time_string()
        if self.close_connection:
            all_headers["Connection"] = "close"
        elif self.request_version == "HTTP/1.0":  # it asked for keep-alive: say it is kept
            all_headers["Connection"] = "keep-alive"
        head = f"HTTP/1.1 {status.value} {status.phrase}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in all_headers.items())
        payload = head.encode("latin-1") + b"\r\n"
        self.wfile.write(payload + body if self.command != "HEAD" else payload)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the stdlib's name)
        # Access logs would be one line per scrape: debug level only.
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s", self.address_string(), format % args)


class _OnlySamples:
    """`?name[]=a&name[]=b`: only samples with those names, like client_python's
    restricted registry, but without needing collectors to describe() themselves."""

    def __init__(self, registry: Collector, names: Iterable[str]) -> None:
        self._registry = registry
        self._names = set(names)

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            samples = [s for s in family.samples if s.name in self._names]
            if samples:
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = samples
                yield kept


def _landing_page(telemetry_path: str) -> bytes:
    path = html.escape(telemetry_path, quote=True)
    return (
        "<!DOCTYPE html>\n<html>\n<head><meta charset=\"utf-8\"><title>MPS Exporter</title></head>\n"
        "<body>\n<h1>MPS Exporter</h1>\n"
        "<p>Prometheus exporter for NVIDIA MPS (CUDA Multi-Process Service).</p>\n"
        f"<ul>\n<li><a href=\"{path}\">Metrics</a></li>\n<li><a href=\"{HEALTH_PATH}\">Health</a></li>\n"
        f"<li><a href=\"{runbook.PATH}\">Alert runbook</a></li>\n</ul>\n"
        f"<p>Version {html.escape(__version__)}</p>\n</body>\n</html>\n"
    ).encode("utf-8")


def make_server(registry: Collector, listen_address: str, telemetry_path: str = "/metrics",
                web_config: Optional[WebConfig] = None, max_requests: int = DEFAULT_MAX_REQUESTS) -> ExporterServer:
    """Bind (port 0 picks a free port) without serving yet; tests and serve() use it."""
    return ExporterServer(listen_address, _App(registry, telemetry_path, web_config or WebConfig(), max_requests))


def serve(registry: Collector, listen_address: str, telemetry_path: str, web_config: Optional[WebConfig], *,
          max_requests: int = DEFAULT_MAX_REQUESTS, ready: Optional[threading.Event] = None,
          stop: Optional[threading.Event] = None) -> None:
    """Serve until `stop` is set (or forever). Blocking. Raises OSError when the
    address cannot be bound (nothing is logged as listening then)."""
    server = make_server(registry, listen_address, telemetry_path, web_config, max_requests)
    log.info("listening on %s, metrics at %s (TLS %s, basic auth %s)", server.bound_addresses(), telemetry_path,
             "on" if server.tls else "off", "on" if server.app.auth else "off")
    if stop is not None:
        def stop_when_asked() -> None:
            stop.wait()
            server.shutdown()

        threading.Thread(target=stop_when_asked, name="web-stop", daemon=True).start()
    try:
        if ready is not None:
            ready.set()
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
