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
import ssl
import textwrap
from pathlib import Path

import pytest

from mps_exporter.config import ConfigError
from mps_exporter.httpd.webconfig import load_web_config
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
    _same_decision(config_dir, name)


@pytest.fixture
def refuse_x25519(monkeypatch):
    """This Python's ssl module as Debian 12's 3.11.2 has it: set_ecdh_curve refuses X25519."""
    real = ssl.SSLContext.set_ecdh_curve

    def set_ecdh_curve(self, name):
        if name == "X25519":
            raise ssl.SSLError(1, "[EC: UNKNOWN_GROUP] unknown group (_ssl.c:4029)")
        return real(self, name)

    monkeypatch.setattr(ssl.SSLContext, "set_ecdh_curve", set_ecdh_curve)


@pytest.mark.parametrize("name", sorted(n for n in TOOLKIT_ACCEPTS if "Curves" in n))
def test_same_decision_where_python_refuses_x25519(config_dir, refuse_x25519, name):
    _same_decision(config_dir, name)


def _same_decision(config_dir, name):
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


def test_a_curve_python_cannot_set_is_skipped_with_one_warning(config_dir, refuse_x25519):
    """allCurves lists X25519 first: where it cannot be set the next one applies, said once."""
    path = config_dir / "web_config_noAuth_allCurves.good.yml"
    cfg = load_web_config(str(path))
    assert cfg.tls.curve == "prime256v1"
    assert len(cfg.warnings) == 1
    assert "cannot set X25519; using CurveP256" in cfg.warnings[0] and str(path) in cfg.warnings[0]
    assert "\n" not in cfg.warnings[0]


def test_every_curve_settable_is_no_warning(config_dir):
    cfg = load_web_config(str(config_dir / "web_config_noAuth_someCurves.good.yml"))
    assert cfg.tls.curve == "secp384r1" and cfg.warnings == ()


def test_no_settable_curve_is_one_line(config_dir, refuse_x25519, tmp_path):
    path = tmp_path / "x25519.yml"
    path.write_text((config_dir / "web_config_noAuth_allCurves.good.yml").read_text()
                    .replace("server.crt", str(config_dir / "server.crt"))
                    .replace("server.key", str(config_dir / "server.key"))
                    .replace("    - CurveP256\n    - CurveP384\n    - CurveP521\n", ""))
    with pytest.raises(ConfigError) as err:
        load_web_config(str(path))
    message = str(err.value)
    assert "\n" not in message
    assert "cannot set X25519; list one it can set: CurveP256, CurveP384, CurveP521" in message


def test_the_cli_logs_the_skipped_curve_once_and_serves(config_dir, refuse_x25519, monkeypatch, capsys):
    import mps_exporter.service as service
    from mps_exporter import cli

    served = []
    monkeypatch.setattr(service, "serve", lambda cfg: served.append(cfg) or 0)
    code = cli.main(["--web.config.file", str(config_dir / "web_config_noAuth_allCurves.good.yml"),
                     "--web.listen-address", "127.0.0.1:0"])
    assert code == 0 and len(served) == 1
    err = capsys.readouterr().err
    assert err.count("cannot set X25519") == 1 and "level=warn" in err and "Traceback" not in err, err


def test_the_cli_refuses_a_list_of_unsettable_curves_in_one_line(config_dir, refuse_x25519, tmp_path, capsys):
    from mps_exporter import cli

    path = tmp_path / "x25519.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {config_dir / 'server.crt'}\n"
                    f"  key_file: {config_dir / 'server.key'}\n  curve_preferences: [X25519]\n")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--web.config.file", str(path), "--web.listen-address", "127.0.0.1:0"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mps-exporter: error: web config file") and "X25519" in lines[0]
