"""The web config file (Prometheus exporter-toolkit format) and the listen address.

TLS and basic auth come from a web config file in the exporter-toolkit format
(https://github.com/prometheus/exporter-toolkit, docs/web-configuration.md), so
the file an operator wrote for node_exporter works here too: every fixture of the
toolkit's own tests (web/testdata) gets the toolkit's accept/reject decision
(tests/test_webconfig.py), except where Python's ssl module cannot do what Go does.
Those cases are rejected at start-up with one clear line, never silently ignored:

- `client_auth_type` RequestClientCert and RequireAnyClientCert (accepting a
  client certificate without verifying it): the ssl module always verifies;
- `curve_preferences` with several curves: the ssl module sets one curve, so
  the first (most preferred) one that this Python's OpenSSL can set is used. A
  curve it cannot set (Debian 12's Python 3.11.2 refuses X25519 where other 3.11
  builds take it) is skipped with one warning line (`WebConfig.warnings`); a list
  with no curve it can set is a config error;
- `http_server_config.http2` is accepted, but only HTTP/1.1 is served; its
  cipher check (an HTTP/2-required suite when TLS 1.2 is allowed) is kept so a
  file behaves as it would under node_exporter.

The TLS context is built once, here, when the file is read; the server takes it
from the parsed config (`WebConfig.tls_context`) and rebuilds it only when a
certificate file changes on disk (rotated certificates apply without a restart).

The file itself is re-read when it changes (`WebConfigWatch`, checked at most every
0.25 s while requests come): a user removed or a password changed is refused within
a second, as exporter-toolkit (which reads the file on every request) does. A file
that no longer parses keeps the previous config, said once in the log.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple


from ..errors import ConfigError, yaml_error_line

log = logging.getLogger(__name__)

_TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"}
_TLS_KEYS = {
    "cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file",
    "client_allowed_sans", "min_version", "max_version", "cipher_suites",
    "prefer_server_cipher_suites", "curve_preferences",
}
_HTTP_KEYS = {"http2", "headers"}
_RATE_LIMIT_KEYS = {"interval", "burst"}

# Go's crypto/tls ClientAuthType names -> ssl verify mode. None: the ssl module
# cannot ask for a certificate without verifying it.
_CLIENT_AUTH: Dict[str, Optional[ssl.VerifyMode]] = {
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

# Go's curve names (crypto/tls CurveID) -> OpenSSL's.
_CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}

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
# Go's http2.ConfigureServer refuses a TLS 1.2 cipher list without one of these.
_HTTP2_REQUIRED_CIPHERS = ("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256")

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


class TLSMaterialError(Exception):
    """A certificate, key or CA that cannot be loaded."""


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
    curve: Optional[str] = None  # OpenSSL curve name

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
        if self.curve:
            try:
                ctx.set_ecdh_curve(self.curve)
            except (ssl.SSLError, ValueError) as e:  # checked when the file is read; kept as one line anyway
                raise TLSMaterialError(f"cannot set curve {self.curve}: {_ssl_reason(e)}") from e
        cert_pem = self.cert_pem if self.cert_pem else _read_text(self.cert_file, "cert_file")
        key_pem = self.key_pem if self.key_pem else _read_text(self.key_file, "key_file")
        _check_pem_kinds(cert_pem, key_pem)
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
            elif self.verify_mode != ssl.CERT_NONE:
                # Go verifies against the system's roots when no client CA is given.
                ctx.load_default_certs(ssl.Purpose.CLIENT_AUTH)
        except (OSError, ssl.SSLError) as e:
            raise TLSMaterialError(f"cannot load the client CA: {_ssl_reason(e)}") from e
        return ctx


def _read_text(path: Optional[str], key: str) -> str:
    try:
        with open(path or "", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise TLSMaterialError(f"cannot read {key} {path}: {e.strerror}") from e


def _check_pem_kinds(cert_pem: str, key_pem: str) -> None:
    """Name the usual mistakes that OpenSSL reports only as "PEM lib"."""
    cert_is_key = "PRIVATE KEY-----" in cert_pem
    key_is_cert = "BEGIN CERTIFICATE-----" in key_pem
    if cert_is_key and key_is_cert:
        raise TLSMaterialError("the certificate holds a private key and the key a certificate: "
                               "cert and key (cert_file and key_file) are swapped")
    if "BEGIN CERTIFICATE-----" not in cert_pem:
        what = "a private key" if cert_is_key else "no PEM certificate"
        raise TLSMaterialError(f"the certificate (cert or cert_file) holds {what}")
    if "PRIVATE KEY-----" not in key_pem:
        what = "a certificate" if key_is_cert else "no PEM private key"
        raise TLSMaterialError(f"the key (key or key_file) holds {what}")


def _ssl_reason(e: Exception) -> str:
    if isinstance(e, ssl.SSLError):
        if e.reason == "KEY_VALUES_MISMATCH":
            return "the private key does not belong to the certificate"
        return str(e.reason or e)
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


class TLSContextSource:
    """The SSLContext for new connections, rebuilt when a certificate, key or
    CA file changes on disk. A rebuild that fails keeps the previous context."""

    def __init__(self, settings: TLSSettings) -> None:
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


@dataclass(frozen=True)
class RateLimit:
    interval_seconds: float
    burst: int  # 0: every request is refused, as Go's rate.Limiter does


@dataclass(frozen=True)
class WebConfig:
    tls: Optional[TLSSettings] = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # user name -> bcrypt hash
    users: Mapping[str, bytes] = field(default_factory=dict)
    rate_limit: Optional[RateLimit] = None
    # Built once from `tls` while the file is read (that is its validation too).
    tls_context: Optional[TLSContextSource] = field(default=None, compare=False, repr=False)
    path: Optional[str] = field(default=None, compare=False)  # the file it came from, watched for changes
    # What was read but not applied as written (a curve this Python cannot set): one
    # log line each, said by whoever loads the file once logging is set up.
    warnings: Tuple[str, ...] = field(default=(), compare=False)


def _file_stamp(path: str) -> Tuple[int, ...]:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class WebConfigWatch:
    """The web config in force: re-read when its file changes (name, size or times),
    checked at most every `interval` seconds. A file that fails to read or parse keeps
    the previous config (one error line per change); so does one that would switch TLS
    on or off, which needs a restart (the listening socket serves one or the other)."""

    def __init__(self, config: WebConfig, interval: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.reloads = 0
        self.failures = 0
        self._interval = interval
        self._clock = clock
        self._next_check = clock() + interval
        self._stamp = _file_stamp(config.path) if config.path else ()
        self._lock = threading.Lock()

    def current(self) -> WebConfig:
        """The config to apply to this request; a new one when the file changed."""
        path = self.config.path
        if path is None or self._clock() < self._next_check or not self._lock.acquire(blocking=False):
            return self.config
        try:
            self._next_check = self._clock() + self._interval
            stamp = _file_stamp(path)
            if stamp != self._stamp:
                self._stamp = stamp
                self._reload(path)
        finally:
            self._lock.release()
        return self.config

    def _reload(self, path: str) -> None:
        try:
            fresh = load_web_config(path)
        except ConfigError as e:
            self.failures += 1
            log.error("cannot reload the web config, keeping the previous one: %s", e)
            return
        if (fresh.tls is None) != (self.config.tls is None):
            self.failures += 1
            log.error("web config file %s switches TLS %s: that needs a restart; keeping the previous config",
                      path, "on" if fresh.tls else "off")
            return
        self.config = fresh
        self.reloads += 1
        for warning in fresh.warnings:
            log.warning("%s", warning)
        log.info("reloaded web config file %s (%d users, TLS %s)", path, len(fresh.users),
                 "on" if fresh.tls else "off")


def load_web_config(path: str) -> WebConfig:
    """Read and fully validate a web config file (certificates are loaded once
    here, so a bad file fails at start-up, not at the first scrape)."""
    import yaml  # here: an exporter without a web config file starts without it (issue 44)

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read web config file {path}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"web config file {path} is not valid YAML: {yaml_error_line(e)}") from e
    try:
        config = parse_web_config(doc, os.path.dirname(os.path.abspath(path)))
    except ConfigError as e:
        raise ConfigError(f"web config file {path}: {e}") from e
    return WebConfig(tls=config.tls, headers=config.headers, users=config.users, rate_limit=config.rate_limit,
                     tls_context=config.tls_context, path=path,
                     warnings=tuple(f"web config file {path}: {w}" for w in config.warnings))


def parse_web_config(doc: object, base_dir: str) -> WebConfig:
    """The parsed YAML document -> WebConfig. Relative file names are taken
    relative to base_dir, as the toolkit does."""
    if doc is None:
        return WebConfig()
    top = _mapping(doc, "the file", _TOP_KEYS)
    http2 = True
    headers: Dict[str, str] = {}
    if top.get("http_server_config") is not None:
        http = _mapping(top["http_server_config"], "http_server_config", _HTTP_KEYS)
        http2 = http.get("http2", True)
        if not isinstance(http2, bool):
            raise ConfigError("http_server_config.http2 must be true or false")
        headers = _parse_headers(http.get("headers"))
    warnings: List[str] = []
    tls = _parse_tls(top["tls_server_config"], base_dir, http2, warnings) if top.get("tls_server_config") else None
    users = _parse_users(top.get("basic_auth_users"))
    rate_limit = _parse_rate_limit(top["rate_limit"]) if top.get("rate_limit") is not None else None
    context = None
    if tls is not None:
        try:
            context = TLSContextSource(tls)
        except TLSMaterialError as e:
            raise ConfigError(f"tls_server_config: {e}") from e
    return WebConfig(tls=tls, headers=headers, users=users, rate_limit=rate_limit, tls_context=context,
                     warnings=tuple(warnings))


def _mapping(value: object, where: str, allowed: Iterable[str]) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping")
    unknown = sorted(str(k) for k in value if k not in allowed)
    if unknown:
        raise ConfigError(f"unknown keys in {where}: {', '.join(unknown)}")
    return value


def _string(section: Mapping[str, object], key: str, where: str) -> Optional[str]:
    value = section.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}.{key} must be a string")
    return value


def _string_list(section: Mapping[str, object], key: str, where: str) -> List[str]:
    value = section.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}.{key} must be a list of strings")
    return value


def _parse_tls(value: object, base_dir: str, http2: bool, warnings: List[str]) -> TLSSettings:
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
    for key, file_path in (("cert_file", cert_file), ("key_file", key_file), ("client_ca_file", ca_file)):
        if file_path:
            try:
                with open(file_path, "rb"):
                    pass
            except OSError as e:
                raise ConfigError(f"{where}: cannot read {key} {file_path}: {e.strerror}") from e

    auth_name = _string(section, "client_auth_type", where) or "NoClientCert"
    if auth_name not in _CLIENT_AUTH:
        raise ConfigError(f"{where}: invalid client_auth_type {auth_name!r} (one of {', '.join(_CLIENT_AUTH)})")
    verify_mode = _CLIENT_AUTH[auth_name]
    if verify_mode is None:
        raise ConfigError(
            f"{where}: client_auth_type {auth_name} (a client certificate without verification) is not "
            "supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert with a client CA")
    if (ca_file or ca_pem) and verify_mode == ssl.CERT_NONE:
        raise ConfigError(f"{where}: a client CA is set but client_auth_type is NoClientCert")

    allowed_sans = tuple(_string_list(section, "client_allowed_sans", where))
    if allowed_sans and verify_mode != ssl.CERT_REQUIRED:
        raise ConfigError(f"{where}: client_allowed_sans requires client_auth_type RequireAndVerifyClientCert")
    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise ConfigError(f"{where}.prefer_server_cipher_suites must be true or false")

    cipher_names = _string_list(section, "cipher_suites", where)
    settings = TLSSettings(
        cert_file=cert_file, key_file=key_file, cert_pem=cert_pem, key_pem=key_pem,
        client_ca_file=ca_file, client_ca_pem=ca_pem, verify_mode=verify_mode,
        allowed_sans=allowed_sans,
        min_version=_tls_version(section, "min_version", ssl.TLSVersion.TLSv1_2),
        max_version=_tls_version(section, "max_version", ssl.TLSVersion.TLSv1_3),
        ciphers=_openssl_ciphers(cipher_names),
        prefer_server_ciphers=prefer,
        curve=_curve(_string_list(section, "curve_preferences", where), warnings),
    )
    if settings.min_version > settings.max_version:
        raise ConfigError(f"{where}: min_version is above max_version")
    if (http2 and cipher_names and settings.min_version < ssl.TLSVersion.TLSv1_3
            and not set(cipher_names) & set(_HTTP2_REQUIRED_CIPHERS)):
        raise ConfigError(f"{where}: cipher_suites is missing an HTTP/2-required suite (one of "
                          f"{' or '.join(_HTTP2_REQUIRED_CIPHERS)}); add one, or set http_server_config.http2: false")
    return settings


def _tls_version(section: Mapping[str, object], key: str, default: ssl.TLSVersion) -> ssl.TLSVersion:
    name = section.get(key)
    if name is None:
        return default
    if not isinstance(name, str) or name not in _TLS_VERSIONS:
        raise ConfigError(f"tls_server_config: unknown {key} {name!r} (one of {', '.join(_TLS_VERSIONS)})")
    return _TLS_VERSIONS[name]


def _curve(names: List[str], warnings: List[str]) -> Optional[str]:
    """The OpenSSL name of the first listed curve this Python can set. Curves before
    it that it cannot set are skipped with one warning; none settable: ConfigError."""
    for name in names:
        if name not in _CURVES:
            raise ConfigError(f"tls_server_config: unknown curve {name!r} (one of {', '.join(_CURVES)})")
    if not names:
        return None
    usable = [name for name in names if _curve_settable(_CURVES[name])]
    if not usable:
        settable = [name for name in _CURVES if _curve_settable(_CURVES[name])]
        raise ConfigError(f"tls_server_config: curve_preferences: this Python ({ssl.OPENSSL_VERSION}) cannot set "
                          f"{', '.join(names)}; list one it can set: {', '.join(settable) or 'none'}")
    skipped = names[:names.index(usable[0])]
    if skipped:
        warnings.append(f"curve_preferences: this Python ({ssl.OPENSSL_VERSION}) cannot set {', '.join(skipped)}; "
                        f"using {usable[0]}")
    return _CURVES[usable[0]]


def _curve_settable(openssl_name: str) -> bool:
    """Whether the ssl module here sets this curve: builds differ (Debian 12's
    Python 3.11.2 refuses X25519 with `[EC: UNKNOWN_GROUP]`)."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        probe.set_ecdh_curve(openssl_name)
    except (ssl.SSLError, ValueError):
        return False
    return True


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
        if isinstance(val, int) and not isinstance(val, bool):
            val = str(val)  # `X-XSS-Protection: 1` is a YAML number
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
    users = {}
    for user, hashed in value.items():
        match = _BCRYPT_HASH.match(hashed) if isinstance(hashed, str) else None
        if not match or not 4 <= int(match.group(1)) <= 31:
            raise ConfigError(f"basic_auth_users: the password of {user!r} is not a bcrypt hash")
        users[str(user)] = hashed.encode("ascii")
    if users:
        try:
            import bcrypt  # noqa: F401  (only basic auth needs it; GPU hosts may lack it)
        except ImportError:
            raise ConfigError("basic_auth_users needs the Python package bcrypt, which is not installed") from None
    return users


def bcrypt_cost(hashed: bytes) -> int:
    """The cost of a hash that passed _parse_users."""
    return int(hashed[4:6])


def _parse_rate_limit(value: object) -> Optional[RateLimit]:
    section = _mapping(value, "rate_limit", _RATE_LIMIT_KEYS)
    interval = parse_duration(section.get("interval", "0"))
    burst = section.get("burst", 0)
    if not isinstance(burst, int) or isinstance(burst, bool) or burst < 0:
        raise ConfigError("rate_limit.burst must be a non-negative integer")
    if interval == 0:
        return None  # the toolkit's way to switch the limiter off
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


def peer_sans(peer_cert: Optional[Mapping[str, Any]]) -> List[str]:
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
# The listen address
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class ListenAddress:
    """Where to bind: family, host, port; dual_stack when one IPv6 socket takes IPv4 too."""

    family: socket.AddressFamily
    host: str
    port: int
    dual_stack: bool = False


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


def resolve_listen_address(address: str) -> ListenAddress:
    """Parse and resolve; an empty host listens on IPv6 and IPv4 where the kernel
    allows one socket for both, as Go's ":port" does. Raises ConfigError."""
    host, port = parse_listen_address(address)
    if not host:
        if socket.has_ipv6:
            try:
                with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                return ListenAddress(socket.AF_INET6, "::", port, dual_stack=True)
            except OSError:
                pass
        return ListenAddress(socket.AF_INET, "0.0.0.0", port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
        raise ConfigError(f"invalid listen address {address!r}: cannot resolve host {host!r}: {reason}") from e
    family, _, _, _, sockaddr = infos[0]
    return ListenAddress(family, str(sockaddr[0]), port)
