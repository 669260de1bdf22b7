"""The web config parser against the cases of exporter-toolkit's own tests.

exporter-toolkit (the Go library behind node_exporter's --web.config.file) tests
its parser on the files of its web/testdata directory. tests/data/web-config/
holds our own file for each of them, under the same name and testing the same
point, and this test expects the toolkit's accept/reject decision for each one
(the decision its tests assert: a config error, or a server that starts).
Certificates are made per run and put where the files name them.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest

from mps_exporter.config import ConfigError
from mps_exporter.webconfig import load_web_config
from tests.support.certs import make_tls_files

FIXTURES = Path(__file__).parent / "data" / "web-config"

# file -> does exporter-toolkit accept it (tls_config_test.go, handler_test.go).
TOOLKIT_ACCEPTS = {
    "tls_config_noAuth.requireandverifyclientcert.good.yml": True,
    "tls_config_noAuth.requireanyclientcert.good.yml": True,
    "tls_config_noAuth.requireanyclientcertkeyinline.good.yml": True,
    "web_config_auth_clientCAs_invalid.bad.yml": False,  # no such file
    # Its tests never load this one; its code accepts it: the same settings as
    # web_config_noAuth.good.blocking.yml (Go then verifies against the system roots).
    "web_config_auth_clientCAs_missing.bad.yml": True,
    "web_config_auth_client_san.bad.yaml": True,  # starts; the client's handshake fails
    "web_config_auth_client_san.good.yaml": True,
    "web_config_auth_user_list_invalid.bad.yml": False,  # not a bcrypt hash
    "web_config_empty.yml": True,
    "web_config_headers.good.yml": True,
    "web_config_headers_content_type_options.bad.yml": False,
    "web_config_headers_extra_header.bad.yml": False,
    "web_config_headers_frame_options.bad.yml": False,
    "web_config_junk.yml": False,
    "web_config_junk_key.yml": False,
    "web_config_noAuth.bad.yml": False,  # a client CA without a client auth policy
    "web_config_noAuth.good.blocking.yml": True,
    "web_config_noAuth.good.yml": True,
    "web_config_noAuth_allCiphers.good.yml": True,
    "web_config_noAuth_allCurves.good.yml": True,
    "web_config_noAuth_certPath_empty.bad.yml": False,
    "web_config_noAuth_certPath_invalid.bad.yml": False,
    "web_config_noAuth_certPath_keyPath_empty.bad.yml": False,
    "web_config_noAuth_certPath_keyPath_invalid.bad.yml": False,
    "web_config_noAuth_cert_empty.bad.yml": False,
    "web_config_noAuth_inventedCiphers.bad.yml": False,
    "web_config_noAuth_inventedCurves.bad.yml": False,
    "web_config_noAuth_keyPath_empty.bad.yml": False,
    "web_config_noAuth_keyPath_invalid.bad.yml": False,
    "web_config_noAuth_key_empty.bad.yml": False,
    "web_config_noAuth_noHTTP2.good.yml": True,
    "web_config_noAuth_noHTTP2Cipher.bad.yml": False,  # Go's http2 needs an AES-128-GCM suite
    "web_config_noAuth_someCiphers.good.yml": True,
    "web_config_noAuth_someCiphers_noOrder.good.yml": True,
    "web_config_noAuth_someCurves.good.yml": True,
    "web_config_noAuth_tlsInline.good.yml": True,
    "web_config_noAuth_wrongTLSVersion.bad.yml": False,
    "web_config_rate_limiter_nonblocking.yaml": True,
    "web_config_rate_limiter_one_second.yaml": True,  # starts; burst 0 refuses every request
    "web_config_users.good.yml": True,
    "web_config_users_noTLS.good.yml": True,
}

# Where we decide otherwise, and why: Python's ssl module cannot accept a client
# certificate without verifying it, so these are refused with one clear line
# instead of being served with a weaker or stronger policy than written.
DIVERGENCES = {
    "tls_config_noAuth.requireanyclientcert.good.yml": "client_auth_type RequireAnyClientCert",
    "tls_config_noAuth.requireanyclientcertkeyinline.good.yml": "client_auth_type RequireAnyClientCert",
}


def test_a_fixture_for_every_toolkit_case():
    assert sorted(os.listdir(FIXTURES)) == sorted(TOOLKIT_ACCEPTS)
    assert set(DIVERGENCES) <= set(TOOLKIT_ACCEPTS)


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """The fixtures beside the certificates they name (server.crt, client CAs)."""
    d = tmp_path_factory.mktemp("web-config")
    ours = make_tls_files(str(d))
    other = make_tls_files(str(d), prefix="other-")
    shutil.copy(ours.server_cert, d / "server.crt")
    shutil.copy(ours.server_key, d / "server.key")
    shutil.copy(ours.ca_cert, d / "client_selfsigned.pem")
    shutil.copy(other.ca_cert, d / "client2_selfsigned.pem")
    pems = {"server_cert_pem": Path(ours.server_cert).read_text(), "server_key_pem": Path(ours.server_key).read_text()}
    for fixture in FIXTURES.iterdir():
        text = fixture.read_text()
        for name, pem in pems.items():  # inline PEM, indented under its block scalar
            text = text.replace("{%s}" % name, textwrap.indent(pem, "    ").strip())
        (d / fixture.name).write_text(text)
    return d


@pytest.mark.parametrize("name", sorted(TOOLKIT_ACCEPTS))
def test_same_decision_as_exporter_toolkit(config_dir, name):
    path = str(config_dir / name)
    if name in DIVERGENCES:
        with pytest.raises(ConfigError, match=f"{DIVERGENCES[name]} .* is not supported"):
            load_web_config(path)
    elif TOOLKIT_ACCEPTS[name]:
        cfg = load_web_config(path)
        assert (cfg.tls_context is not None) == ("tls_server_config" in Path(path).read_text())
    else:
        with pytest.raises(ConfigError) as err:
            load_web_config(path)
        assert "\n" not in str(err.value)


def test_a_missing_file_is_refused(config_dir):
    with pytest.raises(ConfigError, match="No such file"):
        load_web_config(str(config_dir / "somefile"))


# The toolkit's behaviour tests on the same files (TestUsers, the rate limiter cases).

@pytest.mark.parametrize("user,password,status", [
    (None, None, 401), ("heidi", "heidi-pw", 200), ("grace", "grace-pw", 200),
    ("heidi", "bad", 401), ("nonexistent", "nonexistent", 401),
])
def test_users_as_the_toolkit_tests_them(config_dir, user, password, status):
    from tests.test_web import GpuCollector, basic, registry_with, request, running

    cfg = load_web_config(str(config_dir / "web_config_users_noTLS.good.yml"))
    with running(registry_with(GpuCollector()), cfg) as server:
        assert request(server, "/metrics", basic(user, password) if user else None)[0] == status


@pytest.mark.parametrize("name,statuses", [
    ("web_config_rate_limiter_nonblocking.yaml", [200] * 10),
    ("web_config_rate_limiter_one_second.yaml", [429] * 10),
])
def test_rate_limits_as_the_toolkit_tests_them(config_dir, name, statuses):
    from tests.test_web import GpuCollector, registry_with, request, running

    with running(registry_with(GpuCollector()), load_web_config(str(config_dir / name))) as server:
        assert [request(server, "/-/healthy")[0] for _ in statuses] == statuses


def test_curve_preference_is_applied(config_dir):
    """web_config_noAuth_someCurves: a client offering only another curve fails the handshake."""
    import ssl

    from tests.test_web import GpuCollector, registry_with, request, running

    cfg = load_web_config(str(config_dir / "web_config_noAuth_someCurves.good.yml"))
    with running(registry_with(GpuCollector()), cfg) as server:
        for curve, ok in (("secp384r1", True), ("prime256v1", False)):
            ctx = ssl.create_default_context(cafile=str(config_dir / "ca.pem"))
            ctx.set_ecdh_curve(curve)
            if ok:
                assert request(server, "/-/healthy", context=ctx)[0] == 200
            else:
                with pytest.raises(ssl.SSLError):
                    request(server, "/-/healthy", context=ctx)
