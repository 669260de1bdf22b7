"""The HTTP side: web config parsing, routes, auth, TLS, concurrency."""

from __future__ import annotations

import base64
import contextlib
import gzip
import http.client
import logging
import os
import re
import shutil
import socket
import ssl
import textwrap
import threading
import time

import bcrypt
import pytest
from prometheus_client import CollectorRegistry

from mps_exporter.httpd import web, webconfig
from mps_exporter.cli import parse_args
from mps_exporter.config import ConfigError
from mps_exporter.contract import DECLARED
from mps_exporter.families import FamilyBuilder, empty_family
from tests.support.certs import make_tls_files

# Cost 4 keeps hashing fast in tests; the server accepts any cost 4..31.
ALICE_PASSWORD = "s3cret-alice"
ALICE_HASH = bcrypt.hashpw(ALICE_PASSWORD.encode(), bcrypt.gensalt(4)).decode()


class GpuCollector:
    """Two GPUs' worth of contract families."""

    def describe(self):  # as client_python's registry and its name[] filter want
        return [empty_family(DECLARED[name]) for name in ("mps_gpu_up", "mps_gpu_memory_used_bytes")]

    def collect(self):
        out = FamilyBuilder()
        for gpu in ("0", "1"):
            out.add("mps_gpu_up", 1, gpu=gpu, uuid=f"GPU-{gpu}")
            out.add("mps_gpu_memory_used_bytes", 1024 * (int(gpu) + 1), gpu=gpu, uuid=f"GPU-{gpu}")
        return out.families()


class BrokenCollector:
    def collect(self):
        raise RuntimeError("NVML exploded")


def registry_with(*collectors) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    return registry


@contextlib.contextmanager
def running(registry, config: webconfig.WebConfig | None = None, listen: str = "127.0.0.1:0", path: str = "/metrics"):
    server = web.make_server(registry, listen, path, config)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def request(server, path="/", headers=None, method="GET", context: ssl.SSLContext | None = None, host=None):
    """(status, headers, body) of one request to the server."""
    host = host or "127.0.0.1"
    port = server.server_port
    if server.tls is not None:
        conn = http.client.HTTPSConnection(host, port, timeout=10, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def basic(user: str, password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def write_config(tmp_path, text: str) -> str:
    path = tmp_path / "web.yml"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    return d, make_tls_files(str(d)), make_tls_files(str(d), prefix="other-")


def client_context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


# ---------------------------------------------------------------- config file

def test_full_config_parses(tmp_path, tls_dir):
    d, files, _ = tls_dir
    # Relative file names are relative to the config file's directory.
    path = d / "web.yml"
    path.write_text(textwrap.dedent(f"""\
        tls_server_config:
          cert_file: server.pem
          key_file: server-key.pem
          client_auth_type: RequireAndVerifyClientCert
          client_ca_file: ca.pem
          client_allowed_sans: [scraper.example]
          min_version: TLS13
          max_version: TLS13
          cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]
          prefer_server_cipher_suites: false
        http_server_config:
          http2: false
          headers:
            X-Frame-Options: deny
            Strict-Transport-Security: max-age=31536000
        basic_auth_users:
          alice: {ALICE_HASH}
        rate_limit:
          interval: 250ms
          burst: 5
        """))
    cfg = webconfig.load_web_config(str(path))
    assert cfg.tls.cert_file == files.server_cert
    assert cfg.tls.client_ca_file == files.ca_cert
    assert cfg.tls.verify_mode == ssl.CERT_REQUIRED
    assert cfg.tls.allowed_sans == ("scraper.example",)
    assert cfg.tls.min_version == cfg.tls.max_version == ssl.TLSVersion.TLSv1_3
    # OpenSSL's name for the IANA suite; the TLS 1.3 suite is not configurable, as in Go.
    assert cfg.tls.ciphers == "ECDHE-RSA-AES128-GCM-SHA256"
    assert cfg.tls.prefer_server_ciphers is False
    assert cfg.headers == {"X-Frame-Options": "deny", "Strict-Transport-Security": "max-age=31536000"}
    assert cfg.users == {"alice": ALICE_HASH.encode()}
    assert cfg.rate_limit == webconfig.RateLimit(0.25, 5)


def test_every_go_cipher_name_maps_to_an_openssl_suite(tmp_path, tls_dir):
    _, files, _ = tls_dir
    names = sorted(webconfig._TLS12_CIPHER_IDS)
    cfg = webconfig.load_web_config(write_config(tmp_path, f"""\
        tls_server_config:
          cert_file: {files.server_cert}
          key_file: {files.server_key}
          cipher_suites: [{", ".join(names)}]
        """))
    assert len(cfg.tls.ciphers.split(":")) == len(names)
    assert "ECDHE-ECDSA-CHACHA20-POLY1305" in cfg.tls.ciphers.split(":")


@pytest.mark.parametrize("text", ["", "# only a comment\n", "basic_auth_users:\n"])
def test_empty_config_means_plain_http_without_auth(tmp_path, text):
    cfg = webconfig.load_web_config(write_config(tmp_path, text))
    assert cfg.tls is None and not cfg.users and not cfg.headers and cfg.rate_limit is None


def test_inline_certificate_and_key(tmp_path, tls_dir):
    _, files, _ = tls_dir
    indent = lambda p: textwrap.indent(open(p).read(), "    ")  # noqa: E731
    text = (f"tls_server_config:\n  cert: |\n{indent(files.server_cert)}  key: |\n{indent(files.server_key)}"
            f"  client_auth_type: VerifyClientCertIfGiven\n  client_ca: |\n{indent(files.ca_cert)}")
    (tmp_path / "web.yml").write_text(text)
    cfg = webconfig.load_web_config(str(tmp_path / "web.yml"))
    with running(registry_with(GpuCollector()), cfg) as server:
        status, _, body = request(server, "/metrics", context=client_context(files.ca_cert))
    assert status == 200 and b"mps_gpu_up" in body


BAD_CONFIGS = {
    "unknown top-level key": ("tls_config: {{}}\n", "unknown keys in the file: tls_config"),
    "not a mapping": ("- a\n- b\n", "must be a mapping"),
    "unknown TLS key": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  keyfile: x\n",
                        "unknown keys in tls_server_config: keyfile"),
    "no key": ("tls_server_config:\n  cert_file: {cert}\n", "missing one of key or key_file"),
    "no cert": ("tls_server_config:\n  key_file: {key}\n", "missing one of cert or cert_file"),
    "missing cert file": ("tls_server_config:\n  cert_file: /nonexistent/server.pem\n  key_file: {key}\n",
                          "cannot read cert_file /nonexistent/server.pem"),
    "garbage certificate": ("tls_server_config:\n  cert_file: {garbage}\n  key_file: {key}\n",
                            "cannot load the server certificate and key"),
    "key of another certificate": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {other_key}\n",
                                   "the private key does not belong to the certificate"),
    "swapped cert and key": ("tls_server_config:\n  cert_file: {key}\n  key_file: {cert}\n",
                             "cert and key (cert_file and key_file) are swapped"),
    "key for cert": ("tls_server_config:\n  cert_file: {key}\n  key_file: {key}\n",
                     "the certificate (cert or cert_file) holds a private key"),
    "garbage client CA": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                          "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {garbage}\n",
                          "cannot load the client CA"),
    "bad client_auth_type": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_auth_type: Always\n",
                             "invalid client_auth_type 'Always'"),
    "unverified client certs": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                                "  client_auth_type: RequireAnyClientCert\n", "is not supported"),
    "CA without client auth": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  client_ca_file: {ca}\n",
                               "client CA is set but client_auth_type is NoClientCert"),
    "SANs without required certs": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                                    "  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {ca}\n"
                                    "  client_allowed_sans: [x]\n", "client_allowed_sans requires"),
    "curves": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  curve_preferences: [CurveP257]\n",
               "unknown curve 'CurveP257'"),
    "no HTTP/2 cipher": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                         "  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]\n",
                         "cipher_suites is missing an HTTP/2-required suite"),
    "unknown cipher": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  cipher_suites: [RC4]\n",
                       "unknown cipher 'RC4'"),
    "unknown TLS version": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n  min_version: TLS14\n",
                            "unknown min_version 'TLS14'"),
    "min above max": ("tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                      "  min_version: TLS13\n  max_version: TLS12\n", "min_version is above max_version"),
    "unknown header": ("http_server_config:\n  headers:\n    X-Powered-By: me\n", "X-Powered-By"),
    "bad header value": ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n",
                         "invalid value for header X-Frame-Options"),
    "http2 not a bool": ("http_server_config:\n  http2: yes please\n", "http2 must be true or false"),
    "plain-text password": ("basic_auth_users:\n  alice: hunter2\n", "password of 'alice' is not a bcrypt hash"),
    "truncated hash": ("basic_auth_users:\n  alice: '$2y$10$mDwo.lAisC94iLAyP81MCe'\n", "not a bcrypt hash"),
    "users as a list": ("basic_auth_users:\n  - alice\n", "basic_auth_users must be a mapping"),
    "bad duration": ("rate_limit:\n  interval: soon\n  burst: 1\n", "invalid duration 'soon'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_one_clear_line(tmp_path, tls_dir, case):
    _, files, other = tls_dir
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    text, expected = BAD_CONFIGS[case]
    path = write_config(tmp_path, text.format(cert=files.server_cert, key=files.server_key, ca=files.ca_cert,
                                              other_key=other.server_key, garbage=garbage))
    with pytest.raises(ConfigError) as err:
        webconfig.load_web_config(path)
    message = str(err.value)
    assert expected in message
    assert message.startswith(f"web config file {path}: ")
    assert "\n" not in message


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read web config file .*: No such file"):
        webconfig.load_web_config(str(tmp_path / "absent.yml"))
    bad = write_config(tmp_path, "basic_auth_users: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        webconfig.load_web_config(bad)
    assert "is not valid YAML" in str(err.value) and "\n" not in str(err.value)
    # issue 43: where in the file, as PyYAML knows it
    assert "is not valid YAML: line 2, column 1: expected ',' or ']'" in str(err.value), str(err.value)


def test_cli_rejects_bad_web_config_with_exit_2(tmp_path, capsys):
    bad = write_config(tmp_path, "basic_auth_users:\n  alice: hunter2\n")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--web.config.file", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a bcrypt hash" in err


@pytest.mark.parametrize("text,seconds", [("1s", 1.0), ("250ms", 0.25), ("1m30s", 90.0), ("0", 0.0), ("2h", 7200.0)])
def test_parse_duration(text, seconds):
    assert webconfig.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["1", "s", "1x", "1s2", "-1s"])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError):
        webconfig.parse_duration(text)


@pytest.mark.parametrize("address,expected", [
    (":10138", ("", 10138)),
    ("127.0.0.1:10138", ("127.0.0.1", 10138)),
    ("0.0.0.0:10138", ("0.0.0.0", 10138)),
    ("[::1]:10138", ("::1", 10138)),
    ("localhost:0", ("localhost", 0)),
])
def test_parse_listen_address(address, expected):
    assert webconfig.parse_listen_address(address) == expected


@pytest.mark.parametrize("address", ["10138", "127.0.0.1", "::1:10138", "[::1:10138", "host:99999", "host:http"])
def test_parse_listen_address_rejects(address):
    with pytest.raises(ConfigError, match="invalid listen address"):
        webconfig.parse_listen_address(address)


# ---------------------------------------------------------------- routes

def test_landing_page_links_the_metrics_path():
    with running(registry_with(GpuCollector()), path="/custom/metrics") as server:
        status, headers, body = request(server, "/")
    assert status == 200
    assert headers["content-type"].startswith("text/html")
    assert b'href="/custom/metrics"' in body


def test_runbook_page_is_served_with_an_anchor_per_alert():
    """Each alert's default runbook_url (alerts/config.py) lands on this page."""
    with running(registry_with(GpuCollector())) as server:
        status, headers, body = request(server, "/runbook")
        assert b'href="/runbook"' in request(server, "/")[2]
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b'<h2 id="mpsserverfault">MpsServerFault</h2>' in body


def test_health_and_404():
    with running(registry_with(GpuCollector())) as server:
        assert request(server, "/-/healthy")[::2] == (200, b"OK")
        assert request(server, "/nope")[0] == 404
        # Metrics live at the configured path only.
        assert request(server, "/metrics/")[0] == 404


def test_metrics_text_format():
    with running(registry_with(GpuCollector())) as server:
        status, headers, body = request(server, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'mps_gpu_memory_used_bytes{gpu="1",uuid="GPU-1"} 2048.0' in body.decode()
    assert not body.endswith(b"# EOF\n")


def test_openmetrics_negotiation():
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    with running(registry_with(GpuCollector())) as server:
        status, headers, body = request(server, "/metrics", {"Accept": accept})
    assert status == 200
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    assert b'mps_gpu_up{gpu="0",uuid="GPU-0"} 1.0' in body


def test_gzip_when_accepted():
    with running(registry_with(GpuCollector())) as server:
        _, plain_headers, plain = request(server, "/metrics")
        status, headers, body = request(server, "/metrics", {"Accept-Encoding": "gzip"})
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert "content-encoding" not in plain_headers
    assert gzip.decompress(body) == plain


def test_name_filter():
    with running(registry_with(GpuCollector())) as server:
        _, _, body = request(server, "/metrics?name[]=mps_gpu_up")
    assert b"mps_gpu_up{" in body and b"mps_gpu_memory_used_bytes" not in body


def test_head_sends_headers_only():
    with running(registry_with(GpuCollector())) as server:
        status, headers, body = request(server, "/metrics", method="HEAD")
        _, _, full = request(server, "/metrics")
    assert status == 200 and body == b""
    assert int(headers["content-length"]) == len(full)


def test_failing_collector_gives_500_and_the_server_keeps_serving():
    with running(registry_with(BrokenCollector())) as server:
        status, _, body = request(server, "/metrics")
        assert status == 500
        assert b"RuntimeError: NVML exploded" in body
        assert request(server, "/-/healthy")[0] == 200
        assert request(server, "/metrics")[0] == 500


def test_configured_headers_on_every_response():
    cfg = webconfig.WebConfig(headers={"X-Content-Type-Options": "nosniff"})
    with running(registry_with(GpuCollector()), cfg) as server:
        for path in ("/", "/metrics", "/-/healthy", "/nope"):
            assert request(server, path)[1]["x-content-type-options"] == "nosniff"


# ---------------------------------------------------------------- basic auth

@pytest.fixture
def auth_server(tmp_path):
    cfg = webconfig.load_web_config(write_config(tmp_path, f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n"))
    with running(registry_with(GpuCollector()), cfg) as server:
        yield server


@pytest.mark.parametrize("headers", [
    {},
    basic("alice", "wrong"),
    basic("mallory", ALICE_PASSWORD),
    basic("alice", ALICE_PASSWORD + "x" * 80),  # over bcrypt's 72-byte limit
    {"Authorization": "Basic !!!not-base64"},
    {"Authorization": "Basic " + base64.b64encode(b"no-colon").decode()},
    {"Authorization": "Bearer abc"},
])
def test_auth_rejected(auth_server, headers):
    for path in ("/metrics", "/", "/-/healthy"):
        status, resp_headers, _ = request(auth_server, path, headers)
        assert status == 401
        assert resp_headers["www-authenticate"] == "Basic"


def test_auth_accepted(auth_server):
    status, _, body = request(auth_server, "/metrics", basic("alice", ALICE_PASSWORD))
    assert status == 200 and b"mps_gpu_up" in body
    assert request(auth_server, "/-/healthy", basic("alice", ALICE_PASSWORD))[0] == 200


class CountingBcrypt:
    """bcrypt as BasicAuth sees it, counting the expensive checks."""

    def __init__(self):
        self.calls = []

    def checkpw(self, password, hashed):
        self.calls.append(hashed)
        return bcrypt.checkpw(password, hashed)


def counted_auth(users, **kwargs):
    auth = web.BasicAuth(users, **kwargs)
    counter = CountingBcrypt()
    auth._bcrypt = counter
    return auth, counter.calls


def test_auth_caches_every_outcome():
    auth, calls = counted_auth({"alice": ALICE_HASH.encode()})
    good = basic("alice", ALICE_PASSWORD)["Authorization"]
    bad = basic("alice", "wrong")["Authorization"]
    assert auth.check(good) and auth.check(good)
    assert len(calls) == 1  # the second success came from the cache
    assert not auth.check(bad) and not auth.check(bad)
    assert len(calls) == 2  # and so did the second failure: a repeated guess costs no bcrypt
    # An unknown user pays for one bcrypt check against the decoy hash, so
    # response time does not tell which user names exist.
    assert not auth.check(basic("mallory", ALICE_PASSWORD)["Authorization"])
    assert calls[-1] == auth.decoy
    assert auth.check(good)  # still right after failures
    assert len(calls) == 3


def test_failed_guesses_do_not_evict_the_scraper():
    auth, calls = counted_auth({"alice": ALICE_HASH.encode()}, cache_size=4)
    good = basic("alice", ALICE_PASSWORD)["Authorization"]
    assert auth.check(good)
    for i in range(10):
        assert not auth.check(basic("alice", f"guess{i}")["Authorization"])
    assert auth.check(good)
    assert len(calls) == 11  # alice's entry survived ten wrong guesses in a cache of four


def test_auth_cache_expires(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(web.time, "monotonic", lambda: now[0])
    auth, calls = counted_auth({"alice": ALICE_HASH.encode()}, cache_seconds=10)
    good = basic("alice", ALICE_PASSWORD)["Authorization"]
    assert auth.check(good)
    now[0] += 11
    assert auth.check(good)
    assert len(calls) == 2


@pytest.mark.parametrize("costs,expected", [((4,), 4), ((5, 5, 4), 5), ((4, 5), 5), ((), 10)])
def test_decoy_has_the_configured_cost(costs, expected):
    users = {f"u{i}": bcrypt.hashpw(b"pw", bcrypt.gensalt(c)) for i, c in enumerate(costs)}
    assert web.decoy_cost(users.values()) == expected
    if users:
        decoy = web.BasicAuth(users).decoy
        assert webconfig._BCRYPT_HASH.match(decoy.decode()) and webconfig.bcrypt_cost(decoy) == expected
        assert bcrypt.checkpw(b"pw", decoy) is False


# ---------------------------------------------------------------- rate limit

def test_token_bucket():
    now = [0.0]
    bucket = web.TokenBucket(webconfig.RateLimit(interval_seconds=2.0, burst=2), clock=lambda: now[0])
    assert [bucket.allow() for _ in range(3)] == [True, True, False]
    now[0] += 1.0  # half a token
    assert not bucket.allow()
    now[0] += 1.0
    assert bucket.allow() and not bucket.allow()
    now[0] += 100.0  # refills up to the burst only
    assert [bucket.allow() for _ in range(3)] == [True, True, False]


def test_rate_limited_requests_get_429():
    cfg = webconfig.WebConfig(rate_limit=webconfig.RateLimit(interval_seconds=3600, burst=1))
    with running(registry_with(GpuCollector()), cfg) as server:
        assert request(server, "/metrics")[0] == 200
        assert request(server, "/metrics")[0] == 429


# ---------------------------------------------------------------- TLS

def tls_config(tmp_path, files, extra: str = "") -> webconfig.WebConfig:
    return webconfig.load_web_config(write_config(
        tmp_path, f"tls_server_config:\n  cert_file: {files.server_cert}\n  key_file: {files.server_key}\n{extra}"))


def test_tls_serves_https_and_refuses_plain_http(tmp_path, tls_dir):
    _, files, other = tls_dir
    with running(registry_with(GpuCollector()), tls_config(tmp_path, files)) as server:
        status, _, body = request(server, "/metrics", context=client_context(files.ca_cert))
        assert status == 200 and b"mps_gpu_up" in body
        # A client trusting another CA refuses the server.
        with pytest.raises(ssl.SSLCertVerificationError):
            request(server, "/metrics", context=client_context(other.ca_cert))
        # Plain HTTP to the TLS port gets Go's 400 answer (node_exporter's), and no metrics.
        conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 400 and resp.read() == b"Client sent an HTTP request to an HTTPS server.\n"
        conn.close()
        assert request(server, "/-/healthy", context=client_context(files.ca_cert))[0] == 200


def test_tls_with_basic_auth(tmp_path, tls_dir):
    _, files, _ = tls_dir
    cfg = tls_config(tmp_path, files, f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n")
    ctx = client_context(files.ca_cert)
    with running(registry_with(GpuCollector()), cfg) as server:
        assert request(server, "/metrics", context=ctx)[0] == 401
        assert request(server, "/metrics", basic("alice", ALICE_PASSWORD), context=ctx)[0] == 200


CLIENT_AUTH = "  client_auth_type: {mode}\n  client_ca_file: {ca}\n"


def test_required_client_certificate(tmp_path, tls_dir):
    _, files, other = tls_dir
    cfg = tls_config(tmp_path, files, CLIENT_AUTH.format(mode="RequireAndVerifyClientCert", ca=files.ca_cert))
    with running(registry_with(GpuCollector()), cfg) as server:
        good = client_context(files.ca_cert, files.client_cert, files.client_key)
        assert request(server, "/metrics", context=good)[0] == 200
        for ctx in (client_context(files.ca_cert),  # no certificate
                    client_context(files.ca_cert, other.client_cert, other.client_key)):  # foreign CA
            with pytest.raises((ssl.SSLError, ConnectionError)):
                request(server, "/metrics", context=ctx)
        assert request(server, "/metrics", context=good)[0] == 200


def test_optional_client_certificate(tmp_path, tls_dir):
    _, files, other = tls_dir
    cfg = tls_config(tmp_path, files, CLIENT_AUTH.format(mode="VerifyClientCertIfGiven", ca=files.ca_cert))
    with running(registry_with(GpuCollector()), cfg) as server:
        assert request(server, "/metrics", context=client_context(files.ca_cert))[0] == 200
        with pytest.raises((ssl.SSLError, ConnectionError)):
            request(server, "/metrics", context=client_context(files.ca_cert, other.client_cert, other.client_key))


def test_client_allowed_sans(tmp_path, tls_dir):
    _, files, _ = tls_dir
    mode = CLIENT_AUTH.format(mode="RequireAndVerifyClientCert", ca=files.ca_cert)
    good = client_context(files.ca_cert, files.client_cert, files.client_key)
    with running(registry_with(GpuCollector()),
                 tls_config(tmp_path, files, mode + "  client_allowed_sans: [other.example, scraper.example]\n")) as server:
        assert request(server, "/metrics", context=good)[0] == 200
    with running(registry_with(GpuCollector()),
                 tls_config(tmp_path, files, mode + "  client_allowed_sans: [other.example]\n")) as server:
        with pytest.raises((http.client.HTTPException, ConnectionError, ssl.SSLError)):
            request(server, "/metrics", context=good)


def test_peer_sans_spell_ip_addresses_like_go():
    cert = {"subjectAltName": (("DNS", "a.example"), ("IP Address", "0:0:0:0:0:0:0:1\n"), ("IP Address", "10.0.0.1"))}
    assert webconfig.peer_sans(cert) == ["a.example", "::1", "10.0.0.1"]


def test_rotated_certificate_is_picked_up(tmp_path, tls_dir):
    _, files, other = tls_dir
    cert, key = tmp_path / "live.pem", tmp_path / "live-key.pem"
    shutil.copy(files.server_cert, cert)
    shutil.copy(files.server_key, key)
    cfg = webconfig.load_web_config(write_config(tmp_path, f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"))
    with running(registry_with(GpuCollector()), cfg) as server:
        assert request(server, "/metrics", context=client_context(files.ca_cert))[0] == 200
        shutil.copy(other.server_cert, cert)
        shutil.copy(other.server_key, key)
        os.utime(cert, ns=(0, 1))  # a new stamp even within the file system's time resolution
        assert request(server, "/metrics", context=client_context(other.ca_cert))[0] == 200
        # A broken rotation keeps the last good certificate.
        cert.write_text("half-written")
        assert request(server, "/metrics", context=client_context(other.ca_cert))[0] == 200


def client_hello() -> bytes:
    """A TLS client's first flight (a whole ClientHello), as a hanging client sends it."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def hanging_hello(port: int) -> socket.socket:
    """A connection that sent a ClientHello, once the server has answered it (so its
    handshake is in progress there) and that sends nothing more."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(client_hello())
    assert s.recv(65536)  # the ServerHello: the handshake is the server's now
    return s


def closed_by_peer(s: socket.socket) -> bool:
    """Read to the end; True when the peer closed (EOF or reset), never on a timeout."""
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


class Handshakes:
    """A _Handshakes with a clock the test moves, fed server ends of socket pairs;
    `outcomes` gets (client end, ok) as the handshake thread gives each back."""

    def __init__(self, files, limit: int = 10, timeout: float = 5.0) -> None:
        import queue

        self.now = 0.0
        self.outcomes: queue.Queue = queue.Queue()
        self.clients: dict = {}
        source = webconfig.TLSContextSource(webconfig.TLSSettings(cert_file=files.server_cert,
                                                                  key_file=files.server_key))
        self.shaker = web._Handshakes(lambda: source, lambda conn, ok: self.outcomes.put((self.clients[conn.fd], ok)),
                                      limit=limit, timeout=timeout, clock=lambda: self.now)
        self.shaker.start()

    def hello(self) -> socket.socket:
        """A client end that sent a ClientHello and got the ServerHello back."""
        server_end, client_end = socket.socketpair()
        server_end.setblocking(False)
        client_end.settimeout(10)
        conn = web._Conn(server_end, ("test", 0), tls=True)
        self.clients[conn.fd] = client_end
        client_end.sendall(client_hello())
        self.shaker.submit(conn)
        assert client_end.recv(65536)
        return client_end

    def outcome(self):
        return self.outcomes.get(timeout=10)

    def close(self) -> None:
        self.shaker.close()
        for c in self.clients.values():
            c.close()


def test_tls_handshakes_run_off_the_watcher_thread(tmp_path, tls_dir):
    _, files, _ = tls_dir
    with running(registry_with(GpuCollector()), tls_config(tmp_path, files)) as server:
        source = server.tls
        real = source.context
        threads = []
        source.context = lambda: threads.append(threading.current_thread().name) or real()
        assert request(server, "/metrics", context=client_context(files.ca_cert))[0] == 200
        assert threads == ["web-tls"]


def test_tls_handshakes_past_the_limit_close_the_oldest(tls_dir, monkeypatch):
    _, files, _ = tls_dir
    released = threading.Event()
    monkeypatch.setattr(web, "release_memory", released.set)
    hs = Handshakes(files, limit=3)
    try:
        hanging = [hs.hello() for _ in range(3)]
        assert hs.outcomes.empty()
        newest = hs.hello()  # a fourth: the oldest makes room
        assert hs.outcome() == (hanging[0], False)
        assert closed_by_peer(hanging[0])
        assert hs.shaker.evicted == 1 and hs.outcomes.empty()
        for s in hanging[1:] + [newest]:  # the clients leave: their handshakes end
            s.close()
        assert sorted(ok for _, ok in (hs.outcome() for _ in range(3))) == [False] * 3
        assert released.wait(10)  # more than `limit` handshakes, none left: memory given back
    finally:
        hs.close()


def test_a_tls_handshake_is_closed_once_its_time_is_up(tls_dir):
    _, files, _ = tls_dir
    hs = Handshakes(files, timeout=5.0)
    try:
        first = hs.hello()  # handed over at 0.0
        hs.now = 4.9
        second = hs.hello()  # handed over at 4.9
        hs.now = 5.1
        hs.shaker.poke()
        assert hs.outcome() == (first, False)
        assert closed_by_peer(first)
        assert hs.shaker.expired == 1 and hs.outcomes.empty()
        hs.now = 9.9
        hs.shaker.poke()
        assert hs.outcome() == (second, False)
    finally:
        hs.close()


def test_a_tls_handshake_done_beside_hanging_ones_is_given_back(tls_dir):
    _, files, _ = tls_dir
    hs = Handshakes(files, limit=3)
    try:
        hanging = [hs.hello() for _ in range(2)]
        server_end, client_end = socket.socketpair()
        server_end.setblocking(False)
        conn = web._Conn(server_end, ("test", 0), tls=True)
        hs.clients[conn.fd] = client_end
        done = []
        client = threading.Thread(target=lambda: done.append(
            client_context(files.ca_cert).wrap_socket(client_end, server_hostname="localhost")))
        client.start()
        hs.shaker.submit(conn)
        client.join(10)
        assert hs.outcome() == (client_end, True) and conn.tls_done and done
        assert hs.shaker.in_progress == 2 and not any(s.fileno() < 0 for s in hanging)
    finally:
        hs.close()


def test_new_tls_connections_are_begun_a_few_at_a_time(tls_dir):
    """A flood waiting to be taken in must not delay handshakes whose bytes are in: each
    pass of the handshake thread begins at most TAKE_IN_BATCH new ones (driven here
    without the thread)."""
    _, files, _ = tls_dir
    source = webconfig.TLSContextSource(webconfig.TLSSettings(cert_file=files.server_cert, key_file=files.server_key))
    shaker = web._Handshakes(lambda: source, lambda conn, ok: None, limit=100)
    pairs = [socket.socketpair() for _ in range(web.TAKE_IN_BATCH * 2 + 3)]
    try:
        for server_end, client_end in pairs:
            server_end.setblocking(False)
            client_end.sendall(client_hello())
            shaker._incoming.append(web._Conn(server_end, ("test", 0), tls=True))
        shaker._take_in()
        assert shaker.in_progress == web.TAKE_IN_BATCH
        shaker._take_in()
        shaker._take_in()
        assert shaker.in_progress == len(pairs)
    finally:
        shaker.close()
        for _, client_end in pairs:
            client_end.close()


def test_hanging_client_hellos_past_the_limit_do_not_keep_out_a_scrape(tmp_path, tls_dir, monkeypatch):
    _, files, _ = tls_dir
    monkeypatch.setattr(web, "MAX_HANDSHAKES", 4)
    with running(registry_with(GpuCollector()), tls_config(tmp_path, files)) as server:
        hanging = [hanging_hello(server.server_port) for _ in range(10)]
        try:
            assert all(closed_by_peer(s) for s in hanging[:6])  # the oldest made room
            assert request(server, "/metrics", context=client_context(files.ca_cert))[0] == 200
            assert server._handshakes.evicted >= 7  # the scrape's handshake took one place too
        finally:
            for s in hanging:
                s.close()


# ---------------------------------------------------------------- listening and concurrency

def test_dual_stack_listen_address():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with running(registry_with(GpuCollector()), listen=":0") as server:
        assert request(server, "/-/healthy", host="127.0.0.1")[0] == 200
        try:
            assert request(server, "/-/healthy", host="::1")[0] == 200
        except OSError as e:  # IPv6 loopback can be disabled in containers
            pytest.skip(f"no IPv6 loopback: {e}")


def test_ipv6_loopback_listen_address():
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    with running(registry_with(GpuCollector()), listen="[::1]:0") as server:
        assert server.url.startswith("http://[::1]:")
        assert request(server, "/-/healthy", host="::1")[0] == 200


class RendezvousCollector:
    """collect() returns only once `parties` scrapes are inside it at the same
    time: a server handling requests one by one would break the barrier."""

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties, timeout=10)

    def collect(self):
        self.barrier.wait()
        return GpuCollector().collect()


def test_concurrent_scrapes_are_served_in_parallel():
    parties = 6
    with running(registry_with(RendezvousCollector(parties))) as server:
        # A client that connects and sends nothing must not hold up the others.
        stalled = socket.create_connection(("127.0.0.1", server.server_port))
        results = []

        def scrape():
            results.append(request(server, "/metrics")[0])

        threads = [threading.Thread(target=scrape) for _ in range(parties)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        stalled.close()
    assert results == [200] * parties


def test_serve_until_stopped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=web.serve, args=(registry_with(GpuCollector()), f"127.0.0.1:{port}", "/metrics", None),
                              kwargs={"ready": ready, "stop": stop}, daemon=True)
    thread.start()
    assert ready.wait(10)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    assert conn.getresponse().status == 200
    conn.close()
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_cli_rejects_bad_listen_address_with_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--web.listen-address", "::1:10138"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "put an IPv6 address in brackets" in err


# ---------------------------------------------------------------- under load (issue 18)

class GatedCollector:
    """collect() waits until the test opens the gate: a scrape held in flight."""

    def __init__(self):
        self.inside = threading.Semaphore(0)
        self.gate = threading.Event()

    def collect(self):
        self.inside.release()
        assert self.gate.wait(20)
        return GpuCollector().collect()


def test_max_requests_answers_503_past_the_cap():
    collector = GatedCollector()
    with running(registry_with(collector)) as server:
        server.app.max_requests = 1
        server.app.scrapes = threading.BoundedSemaphore(1)
        first = []
        holder = threading.Thread(target=lambda: first.append(request(server, "/metrics")[0]))
        holder.start()
        assert collector.inside.acquire(timeout=20)  # one scrape is in flight
        status, _, body = request(server, "/metrics")
        assert status == 503 and b"Limit of concurrent requests reached (1)" in body
        assert request(server, "/-/healthy")[0] == 200  # the cap is on scrapes only
        collector.gate.set()
        holder.join(20)
        assert first == [200]
        # The slot is given back after the reply went out: the client may ask before.
        assert server.app.scrapes.acquire(timeout=20)
        server.app.scrapes.release()
        assert request(server, "/metrics")[0] == 200  # the slot was given back


def test_every_response_is_one_write(monkeypatch):
    writes = []
    real = web.send_all
    monkeypatch.setattr(web, "send_all", lambda sock, b: writes.append(len(b)) or real(sock, b))
    with running(registry_with(GpuCollector())) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
        for path in ("/metrics", "/-/healthy", "/", "/nope", "/metrics"):
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
        conn.close()
    assert len(writes) == 5, writes  # header and body together, on one keep-alive connection


def test_listen_backlog_is_the_systems():
    with running(registry_with(GpuCollector())) as server:
        assert server.request_queue_size == web.system_backlog() >= 128


def test_two_hundred_clients_connecting_at_once_are_all_answered():
    clients = 200
    with running(registry_with(GpuCollector())) as server:
        # Open every connection first (the accept queue must hold them), then ask.
        socks = [socket.create_connection(("127.0.0.1", server.server_port), timeout=30) for _ in range(clients)]
        try:
            for s in socks:
                s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answers = []
            for s in socks:
                data = b""
                while chunk := s.recv(4096):
                    data += chunk
                answers.append(data.split(b"\r\n", 1)[0])
        finally:
            for s in socks:
                s.close()
    assert answers == [b"HTTP/1.1 200 OK"] * clients


@pytest.mark.parametrize("method", ["POST", "PUT", "OPTIONS", "DELETE", "PATCH", "BREW"])
def test_auth_comes_before_the_method(auth_server, method):
    status, headers, _ = request(auth_server, "/metrics", method=method)
    assert status == 401 and headers["www-authenticate"] == "Basic"
    status, headers, _ = request(auth_server, "/metrics", basic("alice", ALICE_PASSWORD), method=method)
    assert status == 405 and headers["allow"] == "GET, HEAD"


def test_no_server_header_and_no_version_before_auth(auth_server):
    from mps_exporter import __version__

    for hdrs in ({}, basic("alice", ALICE_PASSWORD)):
        status, headers, body = request(auth_server, "/", hdrs)
        assert "server" not in headers
    assert status == 200 and __version__.encode() in body  # the landing page, behind auth
    status, headers, body = request(auth_server, "/")
    assert status == 401 and __version__.encode() not in body


def test_listening_is_logged_once_after_binding_with_the_real_port(caplog):
    caplog.set_level(logging.INFO, logger="mps_exporter.httpd.web")
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=web.serve, args=(registry_with(GpuCollector()), "127.0.0.1:0", "/metrics", None),
                              kwargs={"ready": ready, "stop": stop}, daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
    finally:
        stop.set()
        thread.join(10)
    lines = [r.getMessage() for r in caplog.records if "listening" in r.getMessage()]
    assert len(lines) == 1, lines
    port = int(lines[0].split("127.0.0.1:")[1].split(",")[0])
    assert port != 0  # the port the kernel gave, not the ":0" asked for


def test_dual_stack_listening_line_names_every_address():
    with running(registry_with(GpuCollector()), listen=":0") as server:
        shown = server.bound_addresses()
    if server._dual_stack:
        assert shown == f"[::]:{server.server_port} (every IPv6 and IPv4 address)"
    else:
        assert shown == f"0.0.0.0:{server.server_port} (every IPv4 address)"


def test_taken_port_logs_no_listening_line(caplog):
    caplog.set_level(logging.INFO, logger="mps_exporter.httpd.web")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(OSError):
            web.serve(registry_with(GpuCollector()), f"127.0.0.1:{busy.getsockname()[1]}", "/metrics", None)
    assert not [r for r in caplog.records if "listening" in r.getMessage()]


def test_http_1_0_keep_alive_is_confirmed():
    with running(registry_with(GpuCollector())) as server:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as s:
            f = s.makefile("rb")
            for _ in range(2):  # the same connection answers twice
                s.sendall(b"GET /-/healthy HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
                head = []
                while (line := f.readline()) not in (b"\r\n", b""):
                    head.append(line.decode().strip().lower())
                assert head[0].endswith("200 ok") and "connection: keep-alive" in head
                assert f.read(int(next(h for h in head if h.startswith("content-length")).split(":")[1])) == b"OK"


def test_the_tls_context_is_built_once_at_start_up(tmp_path, tls_dir, monkeypatch):
    _, files, _ = tls_dir
    built = []
    real = webconfig.TLSSettings.build_context
    monkeypatch.setattr(webconfig.TLSSettings, "build_context", lambda self: built.append(1) or real(self))
    path = write_config(tmp_path, f"tls_server_config:\n  cert_file: {files.server_cert}\n  key_file: {files.server_key}\n")
    _, cfg = parse_args(["--web.config.file", path, "--web.listen-address", "127.0.0.1:0"])
    with running(registry_with(GpuCollector()), cfg.web_config) as server:
        assert request(server, "/-/healthy", context=client_context(files.ca_cert))[0] == 200
    assert len(built) == 1  # checked, built and served: once


# ---------------------------------------------------------------- hardening (issue 26)

def raw_exchange(server, data: bytes, timeout: float = 5.0) -> bytes:
    """What the server sends back (until it closes) for `data` on a fresh connection."""
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


# node_exporter 1.5.0's status for each (measured side by side: bench/hostile_bench.py --http-only).
@pytest.mark.parametrize("data, status", [
    (b"GET /metrics HTTP/9.9\r\nHost: x\r\n\r\n", 505),
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    (b"GET / HTTP/0.9\r\nHost: x\r\n\r\n", 505),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    (b"GET /\r\n", 400),  # HTTP/0.9: no blank line ever comes, the answer must not wait for one
    (b"GET /metrics HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nBogus header\r\n\r\n", 400),
    (b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"GET /" + b"a" * (200 << 10) + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    (b"GET /-/healthy HTTP/1.0\r\n\r\n", 200),  # HTTP/1.0 needs no Host
    (b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nX-A: a\r\n  b\r\nConnection: close\r\n\r\n", 200),  # folded line
])
def test_protocol_errors_get_go_status_lines_at_once(data, status):
    with running(registry_with(GpuCollector())) as server:
        started = time.monotonic()
        answer = raw_exchange(server, data)
        took = time.monotonic() - started
    assert answer.split(b"\r\n", 1)[0].startswith(b"HTTP/1.1 %d " % status), answer[:200]
    assert took < 2.0  # answered, not left to a timeout


def test_parse_head_waits_for_a_whole_head_and_counts_what_it_used():
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    assert web.parse_head(head[:-2]) == (None, 0)
    request, used = web.parse_head(head + b"GET /next")
    assert isinstance(request, web.Request) and used == len(head)
    assert (request.method, request.target, request.keep_alive, request.has_body) == ("GET", "/metrics", True, False)
    request, _ = web.parse_head(b"GET / HTTP/1.0\nConnection: Keep-Alive\nContent-Length: 3\n\nabc")
    assert isinstance(request, web.Request) and request.keep_alive and request.has_body


def test_pipelined_requests_are_all_answered_in_order():
    with running(registry_with(GpuCollector())) as server:
        answer = raw_exchange(server, b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n"
                                      b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", answer) == [b"200", b"404"]


def test_silent_connections_hold_no_thread_and_do_not_slow_a_scrape():
    with running(registry_with(GpuCollector())) as server:
        threads_before = threading.active_count()
        silent = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(300)]
        try:
            time.sleep(0.3)
            assert request(server, "/metrics")[0] == 200
            assert threading.active_count() - threads_before < 10
            assert server.open_connections >= 300
        finally:
            for s in silent:
                s.close()


def test_past_the_cap_the_longest_idle_connection_is_closed():
    server = web.make_server(registry_with(GpuCollector()), "127.0.0.1:0", max_connections=20)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        first = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
        time.sleep(0.1)
        rest = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(30)]
        assert request(server, "/-/healthy")[0] == 200
        assert first.recv(1) == b""  # the oldest silent one was closed to make room
        assert server.evicted >= 11 and server.open_connections <= 20
        for s in rest:
            s.close()
        first.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_connection_without_a_request_is_closed_after_the_head_timeout(monkeypatch):
    monkeypatch.setattr(web, "HEAD_TIMEOUT", 0.3)
    with running(registry_with(GpuCollector())) as server:
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as silent, \
                socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as kept:
            kept.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
            assert kept.recv(4096).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            assert silent.recv(1) == b""
            assert 0.2 < time.monotonic() - started < 3
            time.sleep(0.3)  # idle after a request: kept open (IDLE_TIMEOUT, not HEAD_TIMEOUT)
            kept.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
            assert kept.recv(4096).startswith(b"HTTP/1.1 200")


_FD_STARVED_SERVER = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
from prometheus_client import CollectorRegistry
from mps_exporter.httpd import web
server = web.make_server(CollectorRegistry(), "127.0.0.1:0", max_connections=10_000)  # the cap above the limit
print(server.server_port, flush=True)
server.serve_forever(0.05)
"""


def test_out_of_descriptors_the_server_backs_off_and_keeps_answering():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _FD_STARVED_SERVER], stdout=subprocess.PIPE, text=True)
    socks = []
    try:
        port = int(proc.stdout.readline())
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(400)]  # twice the file limit
        time.sleep(0.5)
        cpu_before = _cpu_seconds(proc.pid)
        time.sleep(1.0)
        assert _cpu_seconds(proc.pid) - cpu_before < 0.3  # no accept() spin on EMFILE
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/-/healthy")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.wait(10)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_soft_file_limit_is_raised_to_the_hard_one():
    import subprocess
    import sys

    code = ("import resource; s, h = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, h)); "
            "from mps_exporter.httpd import web; print(web.raise_open_file_limit() == h, "
            "resource.getrlimit(resource.RLIMIT_NOFILE)[0] == h)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["True", "True"]


BOB_PASSWORD = "s3cret-bob"
BOB_HASH = bcrypt.hashpw(BOB_PASSWORD.encode(), bcrypt.gensalt(4)).decode()


def replace_file(path: str, text: str) -> None:
    with open(path + ".new", "w") as f:
        f.write(textwrap.dedent(text))
    os.replace(path + ".new", path)


def first_time(condition, seconds: float = 5.0) -> float:
    """Seconds until condition() holds (polled every 20 ms); fails after `seconds`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, "never happened"
        time.sleep(0.02)
    return time.monotonic() - started


def test_a_removed_password_is_refused_within_a_second(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mps_exporter.httpd.webconfig")
    path = write_config(tmp_path, f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n")
    with running(registry_with(GpuCollector()), webconfig.load_web_config(path)) as server:
        assert request(server, "/metrics", basic("alice", ALICE_PASSWORD))[0] == 200  # cached as right
        replace_file(path, f"basic_auth_users:\n  bob: '{BOB_HASH}'\nhttp_server_config:\n  headers:\n"
                           "    X-Frame-Options: deny\n")
        assert first_time(lambda: request(server, "/metrics", basic("alice", ALICE_PASSWORD))[0] == 401) < 1.0
        status, headers, _ = request(server, "/metrics", basic("bob", BOB_PASSWORD))
        assert status == 200 and headers["x-frame-options"] == "deny"
    assert [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()] == [
        f"reloaded web config file {path} (1 users, TLS off)"]


def test_a_broken_or_tls_switching_web_config_keeps_the_previous_one(tmp_path, tls_dir, caplog):
    _, files, _ = tls_dir
    path = write_config(tmp_path, f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n")
    with running(registry_with(GpuCollector()), webconfig.load_web_config(path)) as server:
        for broken in ("basic_auth_users: [", "basic_auth_users:\n  alice: not-a-hash\n",
                       f"tls_server_config:\n  cert_file: {files.server_cert}\n  key_file: {files.server_key}\n"):
            caplog.clear()
            replace_file(path, broken)
            first_time(lambda: request(server, "/-/healthy")[0] == 401
                       and any("keeping the previous" in r.getMessage() for r in caplog.records))
            time.sleep(0.3)  # checked again: the same file is not reported twice
            assert len([r for r in caplog.records if "keeping the previous" in r.getMessage()]) == 1
            assert request(server, "/metrics", basic("alice", ALICE_PASSWORD))[0] == 200
            assert request(server, "/metrics")[0] == 401
        assert server.app.web_config.failures == 3 and server.tls is None


def test_the_web_config_file_is_checked_at_most_every_interval(tmp_path):
    now = [0.0]
    path = write_config(tmp_path, f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n")
    watch = webconfig.WebConfigWatch(webconfig.load_web_config(path), interval=0.25, clock=lambda: now[0])
    first = watch.current()
    replace_file(path, f"basic_auth_users:\n  bob: '{BOB_HASH}'\n")
    now[0] = 0.2
    assert watch.current() is first  # not looked at yet
    now[0] = 0.3
    assert set(watch.current().users) == {"bob"} and watch.reloads == 1
    now[0] = 0.6
    assert set(watch.current().users) == {"bob"} and watch.reloads == 1  # unchanged: not re-read


def test_ready_answers_503_until_every_source_is_ready():
    state = {"ready": False}
    server = web.make_server(registry_with(GpuCollector()), "127.0.0.1:0", readiness=lambda: state["ready"])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        status, _, body = request(server, "/-/ready")
        assert status == 503 and b"history" in body
        assert request(server, "/-/healthy")[0] == 200  # alive all along: a catch-up is no reason to restart
        state["ready"] = True
        assert request(server, "/-/ready")[::2] == (200, b"OK")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_reload_with_users_of_the_same_cost_keeps_the_decoy_hash(tmp_path):
    path = write_config(tmp_path, f"basic_auth_users:\n  alice: '{ALICE_HASH}'\n")
    app = web._App(registry_with(GpuCollector()), "/metrics", webconfig.load_web_config(path), 40)
    app.web_config = webconfig.WebConfigWatch(app.web_config.config, interval=0)
    decoy = app.guards().auth.decoy
    replace_file(path, f"basic_auth_users:\n  bob: '{BOB_HASH}'\n")  # cost 4 too: no new bcrypt for the decoy
    os.utime(path, ns=(1, 2))
    assert set(app.guards().config.users) == {"bob"} and app.guards().auth.decoy is decoy
