"""HTTP serving the Prometheus-exporter way: /metrics, a landing page, /-/healthy.

TLS and basic auth come from a web config file in the Prometheus
exporter-toolkit format (https://github.com/prometheus/exporter-toolkit,
docs/web-configuration.md), so the file an operator wrote for node_exporter
works here too. What Python's ssl module cannot do is rejected at start-up
with one clear line instead of being silently ignored:

- `client_auth_type` RequestClientCert and RequireAnyClientCert (accepting a
  client certificate without verifying it) and `curve_preferences` have no
  equivalent in the ssl module;
- `http_server_config.http2` is accepted, but only HTTP/1.1 is served.

Certificate and key files are re-read when they change on disk, so rotated
certificates (cert-manager, a renewal cron job) apply without a restart.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import html
import ipaddress
import logging
import os
import re
import socket
import socketserver
import sys
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Iterable, List, Mapping, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

try:
    import bcrypt
except ImportError:  # only basic auth needs it (GPU hosts may lack it); checked at config load
    bcrypt = None
import yaml
from prometheus_client.exposition import choose_encoder, generate_latest, gzip_accepted
from prometheus_client.metrics_core import Metric

from . import __version__, runbook
from .config import ConfigError
from .exposition import generate_text

log = logging.getLogger(__name__)

HEALTH_PATH = "/-/healthy"

# --------------------------------------------------------------------------
# The web config file
# --------------------------------------------------------------------------

_TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"}
_TLS_KEYS = {
    "cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
    "client_allowed_sans", "min_version", "max_version", "cipher_suites",
    "prefer_server_cipher_suites", "curve_preferences",
}
_HTTP_KEYS = {"http2", "headers"}
_RATE_LIMIT_KEYS = {"interval", "burst"}

# Go's crypto/tls ClientAuthType names -> ssl verify mode. None: the ssl module
# cannot ask for a certificate without verifying it against a CA.
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": None,
    "RequireAnyClientCert": None,
    "RequireClientCert": None,  # old spelling the toolkit still accepts
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}

_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}

# Go's cipher suite names (IANA names, crypto/tls.CipherSuites) -> IANA id.
# OpenSSL spells the same suites differently; the id finds OpenSSL's name.
_TLS12_CIPHER_IDS = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": 0x002F,
    "TLS_RSA_WITH_AES_256_CBC_SHA": 0x0035,
    "TLS_RSA_WITH_AES_128_GCM_SHA256": 0x009C,
    "TLS_RSA_WITH_AES_256_GCM_SHA384": 0x009D,
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": 0xC009,
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": 0xC00A,
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": 0xC013,
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": 0xC014,
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": 0xC02B,
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": 0xC02C,
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": 0xC02F,
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": 0xC030,
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": 0xCCA8,
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": 0xCCA9,
}
# Go ignores cipher_suites for TLS 1.3 (its suites are not configurable); so do we.
_TLS13_CIPHERS = {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}

# The toolkit allows these response headers only, some with fixed values.
_EXTRA_HEADERS: Dict[str, Tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}

# $2a$/$2b$/$2y$, two-digit cost, 22 salt + 31 hash characters.
_BCRYPT_HASH = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class TLSSettings:
    """The `tls_server_config` section, paths resolved against the file's directory."""

    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    cert_pem: Optional[str] = None
    key_pem: Optional[str] = None
    client_ca_file: Optional[str] = None
    client_ca_pem: Optional[str] = None
    verify_mode: ssl.VerifyMode = ssl.CERT_NONE
    allowed_sans: Tuple[str, ...] = ()
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3
    ciphers: Optional[str] = None  # OpenSSL cipher string for TLS <= 1.2
    prefer_server_ciphers: bool = True

    def watched_files(self) -> Tuple[str, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)

    def build_context(self) -> ssl.SSLContext:
        """A server-side SSLContext; raises TLSMaterialError on bad material."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = self.min_version
        ctx.maximum_version = self.max_version
        if self.ciphers:
            ctx.set_ciphers(self.ciphers)
        if self.prefer_server_ciphers:
            ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        try:
            _load_cert_chain(ctx, self.cert_file, self.cert_pem, self.key_file, self.key_pem)
        except (OSError, ssl.SSLError) as e:
            raise TLSMaterialError(f"cannot load the server certificate and key: {_ssl_reason(e)}") from e
        ctx.verify_mode = self.verify_mode
        try:
            if self.client_ca_file:
                ctx.load_verify_locations(cafile=self.client_ca_file)
            elif self.client_ca_pem:
                ctx.load_verify_locations(cadata=self.client_ca_pem)
        except (OSError, ssl.SSLError) as e:
            raise TLSMaterialError(f"cannot load the client CA: {_ssl_reason(e)}") from e
        return ctx


class TLSMaterialError(Exception):
    """A certificate, key or CA that cannot be loaded."""


def _ssl_reason(e: Exception) -> str:
    if isinstance(e, ssl.SSLError):
        return e.reason or str(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


@dataclass(frozen=True)
class RateLimit:
    interval_seconds: float
    burst: int


@dataclass(frozen=True)
class WebConfig:
    tls: Optional[TLSSettings] = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # user name -> bcrypt hash
    users: Mapping[str, bytes] = field(default_factory=dict)
    rate_limit: Optional[RateLimit] = None


def load_web_config(path: str) -> WebConfig:
    """Read and fully validate a web config file (certificates are loaded once
    here, so a bad file fails at start-up, not at the first scrape)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read web config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"web config file {path} is not valid YAML: {str(e).splitlines()[0]}") from e
    try:
        return parse_web_config(doc, os.path.dirname(os.path.abspath(path)))
    except ConfigError as e:
        raise ConfigError(f"web config file {path}: {e}") from e


def parse_web_config(doc: object, base_dir: str) -> WebConfig:
    """The parsed YAML document -> WebConfig. Relative file names are taken
    relative to base_dir, as the toolkit does."""
    if doc is None:
        return WebConfig()
    top = _mapping(doc, "the file", _TOP_KEYS)
    tls = _parse_tls(top["tls_server_config"], base_dir) if top.get("tls_server_config") else None
    headers: Dict[str, str] = {}
    if top.get("http_server_config") is not None:
        http = _mapping(top["http_server_config"], "http_server_config", _HTTP_KEYS)
        if "http2" in http and not isinstance(http["http2"], bool):
            raise ConfigError("http_server_config.http2 must be true or false")
        headers = _parse_headers(http.get("headers"))
    users = _parse_users(top.get("basic_auth_users"))
    rate_limit = _parse_rate_limit(top["rate_limit"]) if top.get("rate_limit") is not None else None
    return WebConfig(tls=tls, headers=headers, users=users, rate_limit=rate_limit)


def _mapping(value: object, where: str, allowed: Iterable[str]) -> Dict[str, object]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ConfigError(f"unknown keys in {where}: {', '.join(unknown)}")
    return value


def _string(section: Dict[str, object], key: str, where: str) -> Optional[str]:
    value = section.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{key} must be a string")
    return value


def _string_list(section: Dict[str, object], key: str, where: str) -> List[str]:
    value = section.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}.{key} must be a list of strings")
    return value


def _parse_tls(value: object, base_dir: str) -> TLSSettings:
    where = "tls_server_config"
    section = _mapping(value, where, _TLS_KEYS)

    def path(key: str) -> Optional[str]:
        name = _string(section, key, where)
        return os.path.join(base_dir, name) if name else None

    cert_file, key_file, ca_file = path("cert_file"), path("key_file"), path("client_ca_file")
    cert_pem, key_pem = _string(section, "cert", where), _string(section, "key", where)
    ca_pem = _string(section, "client_ca", where)
    for inline, file_key in ((cert_pem, "cert_file"), (key_pem, "key_file"), (ca_pem, "client_ca_file")):
        if inline and section.get(file_key):
            raise ConfigError(f"{where}: set {file_key} or its inline form, not both")
    if not (cert_file or cert_pem):
        raise ConfigError(f"{where}: missing one of cert or cert_file")
    if not (key_file or key_pem):
        raise ConfigError(f"{where}: missing one of key or key_file")

    auth_name = _string(section, "client_auth_type", where) or "NoClientCert"
    if auth_name not in _CLIENT_AUTH:
        raise ConfigError(f"{where}: invalid client_auth_type {auth_name!r} (one of {', '.join(_CLIENT_AUTH)})")
    verify_mode = _CLIENT_AUTH[auth_name]
    if verify_mode is None:
        raise ConfigError(
            f"{where}: client_auth_type {auth_name} (a client certificate without verification) is not "
            "supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert with a client CA")
    has_ca = bool(ca_file or ca_pem)
    if has_ca and verify_mode == ssl.CERT_NONE:
        raise ConfigError(f"{where}: a client CA is set but client_auth_type is NoClientCert")
    if not has_ca and verify_mode != ssl.CERT_NONE:
        raise ConfigError(f"{where}: client_auth_type {auth_name} needs client_ca_file or client_ca")

    allowed_sans = tuple(_string_list(section, "client_allowed_sans", where))
    if allowed_sans and verify_mode != ssl.CERT_REQUIRED:
        raise ConfigError(f"{where}: client_allowed_sans requires client_auth_type RequireAndVerifyClientCert")
    if section.get("curve_preferences"):
        raise ConfigError(f"{where}: curve_preferences is not supported (Python's ssl module cannot set it)")
    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise ConfigError(f"{where}.prefer_server_cipher_suites must be true or false")

    settings = TLSSettings(
        cert_file=cert_file, key_file=key_file, cert_pem=cert_pem, key_pem=key_pem,
        client_ca_file=ca_file, client_ca_pem=ca_pem, verify_mode=verify_mode,
        allowed_sans=allowed_sans,
        min_version=_tls_version(section, "min_version", ssl.TLSVersion.TLSv1_2),
        max_version=_tls_version(section, "max_version", ssl.TLSVersion.TLSv1_3),
        ciphers=_openssl_ciphers(_string_list(section, "cipher_suites", where)),
        prefer_server_ciphers=prefer,
    )
    if settings.min_version > settings.max_version:
        raise ConfigError(f"{where}: min_version is above max_version")
    for key, file_path in (("cert_file", cert_file), ("key_file", key_file), ("client_ca_file", ca_file)):
        if file_path:
            try:
                with open(file_path, "rb"):
                    pass
            except OSError as e:
                raise ConfigError(f"{where}: cannot read {key} {file_path}: {e.strerror}") from e
    try:
        settings.build_context()
    except TLSMaterialError as e:
        raise ConfigError(f"{where}: {e}") from e
    return settings


def _tls_version(section: Dict[str, object], key: str, default: ssl.TLSVersion) -> ssl.TLSVersion:
    name = section.get(key)
    if name is None:
        return default
    if not isinstance(name, str) or name not in _TLS_VERSIONS:
        raise ConfigError(f"tls_server_config: unknown {key} {name!r} (one of {', '.join(_TLS_VERSIONS)})")
    return _TLS_VERSIONS[name]


def _openssl_ciphers(names: List[str]) -> Optional[str]:
    """Go cipher suite names -> an OpenSSL cipher string, through the IANA ids
    of the suites this OpenSSL build knows."""
    if not names:
        return None
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    probe.set_ciphers("ALL:@SECLEVEL=0")
    by_id = {c["id"] & 0xFFFF: c["name"] for c in probe.get_ciphers()}
    chosen = []
    for name in names:
        if name in _TLS13_CIPHERS:
            continue
        iana_id = _TLS12_CIPHER_IDS.get(name)
        if iana_id is None:
            raise ConfigError(f"tls_server_config: unknown cipher {name!r}")
        if iana_id not in by_id:
            raise ConfigError(f"tls_server_config: cipher {name} is not available in {ssl.OPENSSL_VERSION}")
        chosen.append(by_id[iana_id])
    return ":".join(chosen) or None


def _load_cert_chain(ctx: ssl.SSLContext, cert_file: Optional[str], cert_pem: Optional[str],
                     key_file: Optional[str], key_pem: Optional[str]) -> None:
    # load_cert_chain reads files only: inline PEM goes through a private
    # temporary file that lives just for the call.
    with tempfile.TemporaryDirectory(prefix="mps-exporter-tls-") as tmp:
        def materialize(path: Optional[str], pem: Optional[str], name: str) -> str:
            if path:
                return path
            out = os.path.join(tmp, name)
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(pem or "")
            return out

        ctx.load_cert_chain(materialize(cert_file, cert_pem, "cert.pem"), materialize(key_file, key_pem, "key.pem"))


def _parse_headers(value: object) -> Dict[str, str]:
    if value is None:
        return {}
    headers = _mapping(value, "http_server_config.headers", _EXTRA_HEADERS)
    out = {}
    for name, val in headers.items():
        if not isinstance(val, str):
            raise ConfigError(f"header {name} must be a string")
        allowed = _EXTRA_HEADERS[name]
        if allowed and val not in allowed:
            raise ConfigError(f"invalid value for header {name}: {val!r} (one of {', '.join(allowed)})")
        if val:
            out[name] = val
    return out


def _parse_users(value: object) -> Dict[str, bytes]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError("basic_auth_users must be a mapping of user name to bcrypt hash")
    if value and bcrypt is None:
        raise ConfigError("basic_auth_users needs the Python package bcrypt, which is not installed")
    users = {}
    for user, hashed in value.items():
        match = _BCRYPT_HASH.match(hashed) if isinstance(hashed, str) else None
        if not match or not 4 <= int(match.group(1)) <= 31:
            raise ConfigError(f"basic_auth_users: the password of {user!r} is not a bcrypt hash")
        users[str(user)] = hashed.encode("ascii")
    return users


def _parse_rate_limit(value: object) -> Optional[RateLimit]:
    section = _mapping(value, "rate_limit", _RATE_LIMIT_KEYS)
    interval = parse_duration(section.get("interval", "0"))
    burst = section.get("burst", 0)
    if not isinstance(burst, int) or isinstance(burst, bool) or burst < 0:
        raise ConfigError("rate_limit.burst must be a non-negative integer")
    if interval == 0:
        return None  # the toolkit's way to switch the limiter off
    if burst == 0:
        raise ConfigError("rate_limit.burst must be at least 1 when an interval is set")
    return RateLimit(interval, burst)


def parse_duration(text: object) -> float:
    """A Go/Prometheus duration ("1s", "250ms", "1m30s", "0") -> seconds."""
    if isinstance(text, int) and text == 0:
        return 0.0
    if not isinstance(text, str) or not text:
        raise ConfigError(f"invalid duration {text!r}")
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text):
        raise ConfigError(f"invalid duration {text!r}")
    return total


# --------------------------------------------------------------------------
# Request guards: basic auth, rate limit, TLS contexts
# --------------------------------------------------------------------------

# bcrypt of a random throw-away password: unknown users are checked against it
# so that a wrong user name costs as much time as a wrong password.
_DECOY_HASH = b"$2b$10$8m.abXeKZRIT7Oi4sQwI1eZHp7yTPh4qdOarjHjfm.TmssMhtef5y"


class BasicAuth:
    """Checks `Authorization: Basic` headers against bcrypt hashes.

    bcrypt costs ~70 ms per check at cost 10 and Prometheus sends the same
    credentials every scrape, so successful checks are remembered for
    `cache_seconds`, keyed by a SHA-256 of user, hash and password (the
    password itself is never kept). Checks run one at a time so a burst of
    bad requests cannot occupy every core.
    """

    def __init__(self, users: Mapping[str, bytes], cache_seconds: float = 60.0, cache_size: int = 100):
        self._users = dict(users)
        self._cache_seconds = cache_seconds
        self._cache_size = cache_size
        self._cache: Dict[bytes, float] = {}
        self._cache_lock = threading.Lock()
        self._bcrypt_lock = threading.Lock()

    def check(self, header: Optional[str]) -> bool:
        credentials = _parse_basic_header(header)
        if credentials is None:
            return False
        user, password = credentials
        hashed = self._users.get(user)
        known = hashed is not None
        if hashed is None:
            hashed = _DECOY_HASH
        key = hashlib.sha256(b"\0".join((user.encode("utf-8"), hashed, password))).digest()
        now = time.monotonic()
        with self._cache_lock:
            expires = self._cache.get(key)
            if expires is not None and expires > now:
                return known
        with self._bcrypt_lock:
            try:
                ok = bcrypt.checkpw(password, hashed)
            except ValueError:  # e.g. a password over bcrypt's 72-byte limit
                ok = False
        if ok and known:
            self._remember(key, now + self._cache_seconds)
        return ok and known

    def _remember(self, key: bytes, expires: float) -> None:
        with self._cache_lock:
            if len(self._cache) >= self._cache_size:
                now = time.monotonic()
                for k in [k for k, t in self._cache.items() if t <= now] or list(self._cache)[:1]:
                    del self._cache[k]
            self._cache[key] = expires


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
    """The toolkit's rate_limit: one token every `interval`, at most `burst` saved."""

    def __init__(self, limit: RateLimit, clock=time.monotonic):
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


class TLSContextSource:
    """The SSLContext for new connections, rebuilt when a certificate, key or
    CA file changes on disk. A rebuild that fails keeps the previous context."""

    def __init__(self, settings: TLSSettings):
        self.settings = settings
        self._stamp = self._file_stamp()
        self._context = settings.build_context()
        self._lock = threading.Lock()

    def _file_stamp(self) -> Tuple[Tuple[int, int], ...]:
        stamps = []
        for path in self.settings.watched_files():
            try:
                st = os.stat(path)
                stamps.append((st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append((-1, -1))
        return tuple(stamps)

    def context(self) -> ssl.SSLContext:
        stamp = self._file_stamp()
        with self._lock:
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._context = self.settings.build_context()
                    log.info("reloaded TLS certificate files")
                except TLSMaterialError as e:
                    log.error("cannot reload TLS certificate files, keeping the previous ones: %s", e)
            return self._context


def peer_sans(peer_cert: Optional[dict]) -> List[str]:
    """Subject alternative names of a verified peer certificate, spelled the
    way Go's crypto/x509 prints them (IP addresses in canonical form)."""
    out = []
    for kind, value in (peer_cert or {}).get("subjectAltName", ()):
        if kind == "IP Address":
            try:
                value = str(ipaddress.ip_address(value.strip()))
            except ValueError:
                pass
        out.append(value)
    return out


# --------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------

def parse_listen_address(address: str) -> Tuple[str, int]:
    """":10138" (all interfaces), "127.0.0.1:10138", "[::1]:10138",
    "0.0.0.0:10138", "localhost:10138" -> (host, port); host "" means all."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"invalid listen address {address!r}: expected [host]:port")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ConfigError(f"invalid listen address {address!r}")
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"invalid listen address {address!r}: put an IPv6 address in brackets")
    return host, int(port_text)


def _resolve(host: str, port: int) -> Tuple[socket.AddressFamily, str, bool]:
    """(family, bind host, dual-stack). An empty host listens on IPv6 and IPv4
    where the kernel allows one socket for both, as Go's ":port" does."""
    if not host:
        if socket.has_ipv6:
            try:
                with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                return socket.AF_INET6, "::", True
            except OSError:
                pass
        return socket.AF_INET, "0.0.0.0", False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve listen host {host!r}: {e.strerror}") from e
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr[0], False


@dataclass
class _App:
    registry: object
    telemetry_path: str
    config: WebConfig
    auth: Optional[BasicAuth]
    limiter: Optional[TokenBucket]


class ExporterServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # A TLS handshake or a request that stalls longer than this is dropped.
    socket_timeout = 30.0

    def __init__(self, listen_address: str, app: _App):
        host, port = parse_listen_address(listen_address)
        family, bind_host, self._dual_stack = _resolve(host, port)
        self.address_family = family
        self.app = app
        self.tls = TLSContextSource(app.config.tls) if app.config.tls else None
        super().__init__((bind_host, port), _Handler)

    def server_bind(self) -> None:
        if self._dual_stack:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # HTTPServer.server_bind would call getfqdn(): a DNS lookup at start-up.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[0], self.server_address[1]

    @property
    def url(self) -> str:
        host = self.server_address[0]
        if host in ("::", "0.0.0.0"):
            host = "127.0.0.1" if self.address_family == socket.AF_INET else "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"{'https' if self.tls else 'http'}://{host}:{self.server_port}"

    def handle_error(self, request, client_address) -> None:
        # The stdlib prints tracebacks to stderr; route them through logging.
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, socket.timeout)):
            log.debug("connection from %s ended: %s", client_address[0], err)
        else:
            log.error("error while serving %s", client_address[0], exc_info=True)

    def finish_request(self, request, client_address) -> None:
        # Runs in the request's own thread, so a slow TLS handshake holds up
        # only its own connection, never the accept loop.
        request.settimeout(self.socket_timeout)
        if self.tls is None:
            super().finish_request(request, client_address)
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
    server_version = f"mps-exporter/{__version__}"
    sys_version = ""

    def do_GET(self) -> None:
        self._route(send_body=True)

    def do_HEAD(self) -> None:
        self._route(send_body=False)

    def _route(self, send_body: bool) -> None:
        app = self.server.app
        self._send_body = send_body
        if app.limiter is not None and not app.limiter.allow():
            self._reply(429, b"Too Many Requests\n")
            return
        if app.auth is not None and not app.auth.check(self.headers.get("Authorization")):
            self._reply(401, b"Unauthorized\n", {"WWW-Authenticate": "Basic"})
            return
        url = urlsplit(self.path)
        if url.path == app.telemetry_path:
            self._metrics(parse_qs(url.query))
        elif url.path == "/":
            self._reply(200, _landing_page(app.telemetry_path), {"Content-Type": "text/html; charset=utf-8"})
        elif url.path == HEALTH_PATH:
            self._reply(200, b"OK")
        elif url.path == runbook.PATH:
            self._reply(200, runbook.served_page(), {"Content-Type": "text/html; charset=utf-8"})
        else:
            self._reply(404, b"404 page not found\n")

    def _metrics(self, params: Dict[str, List[str]]) -> None:
        registry = self.server.app.registry
        encoder, content_type = choose_encoder(self.headers.get("Accept") or "")
        if encoder is generate_latest:  # the classic text format: our faster, byte-identical encoder
            encoder = generate_text
        if params.get("name[]"):
            registry = _OnlySamples(registry, params["name[]"])
        try:
            body = encoder(registry)
        except Exception as e:  # a broken collector must cost one scrape, not the server
            log.error("scrape failed: %s: %s", type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
            self._reply(500, f"An error has occurred while serving metrics:\n\n{type(e).__name__}: {e}\n".encode())
            return
        headers = {"Content-Type": content_type}
        if gzip_accepted(self.headers.get("Accept-Encoding") or ""):
            body = gzip.compress(body, compresslevel=6)
            headers["Content-Encoding"] = "gzip"
        self._reply(200, body, headers)

    def _reply(self, code: int, body: bytes, headers: Optional[Dict[str, str]] = None) -> None:
        self.send_response(code)
        all_headers = {"Content-Type": "text/plain; charset=utf-8", **(headers or {}), **self.server.app.config.headers}
        all_headers["Content-Length"] = str(len(body))
        for name, value in all_headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self._send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the stdlib's name)
        # Access logs would be one line per scrape: debug level only.
        log.debug("%s %s", self.address_string(), format % args)


class _OnlySamples:
    """`?name[]=a&name[]=b`: only samples with those names, like client_python's
    restricted registry, but without needing collectors to describe() themselves."""

    def __init__(self, registry, names: Iterable[str]):
        self._registry = registry
        self._names = set(names)

    def collect(self):
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


def make_server(registry, listen_address: str, telemetry_path: str = "/metrics",
                web_config: Optional[WebConfig] = None) -> ExporterServer:
    """Bind (port 0 picks a free port) without serving yet; tests and serve() use it."""
    config = web_config or WebConfig()
    app = _App(
        registry=registry,
        telemetry_path=telemetry_path,
        config=config,
        auth=BasicAuth(config.users) if config.users else None,
        limiter=TokenBucket(config.rate_limit) if config.rate_limit else None,
    )
    return ExporterServer(listen_address, app)


def serve(registry, listen_address: str, telemetry_path: str, web_config: Optional[WebConfig], *,
          ready: Optional[threading.Event] = None, stop: Optional[threading.Event] = None) -> None:
    """Serve until `stop` is set (or forever). Blocking."""
    server = make_server(registry, listen_address, telemetry_path, web_config)
    log.info("listening on %s (TLS %s, basic auth %s)", server.url.split("://")[1],
             "on" if server.tls else "off", "on" if server.app.auth else "off")
    if stop is not None:
        threading.Thread(target=lambda: (stop.wait(), server.shutdown()), name="web-stop", daemon=True).start()
    try:
        if ready is not None:
            ready.set()
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
