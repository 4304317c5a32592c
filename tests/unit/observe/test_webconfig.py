"""Unit tests of rpcguard.observe.webconfig and the metrics endpoint behind it: the exporter-toolkit
file format (every refused key named), mTLS + basic auth on a loopback server with real
certificates (asyncio and uvloop), the bcrypt cache, SAN allow-lists, the config rules for a
non-loopback metrics address, and reload through the Runtime."""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml

from rpcguard.pki import certs
from rpcguard.config.flags import build_config
from rpcguard.errors import ConfigError
from rpcguard.observe.metrics import Metrics
from rpcguard.observe.http import start_http
from rpcguard.proxy.server import Runtime
from rpcguard.observe.webconfig import GO_CIPHER_SUITES, WebGuard, load_web_config
from tests.support.loops import run  # noqa: F401,F811  (a fixture: the endpoint tests run on both loops)

PASSWORD = "s3cret-scraper"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()  # cheap rounds for tests


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    other = d / "other"
    certs.init_ca(d)
    certs.init_ca(other)
    certs.issue(d, "metrics", server=True, dns=["localhost"], ips=["127.0.0.1"])
    certs.issue(d, "prometheus", server=False, uris=["spiffe://lab/prometheus"])
    certs.issue(d, "grafana", server=False, uris=["spiffe://lab/grafana"])
    certs.issue(other, "stranger", server=False, uris=["spiffe://lab/prometheus"])
    return d


def write(tmp_path: Path, data: object, name: str = "web.yml") -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data, encoding="utf-8")
    return str(p)


def mtls(pki: Path, **extra: Any) -> dict:
    tls = {"cert_file": str(pki / "metrics.pem"), "key_file": str(pki / "metrics.key"),
           "client_ca_file": str(pki / "ca.pem"), "client_auth_type": "RequireAndVerifyClientCert", **extra}
    return {"tls_server_config": tls, "basic_auth_users": {"prometheus": HASH},
            "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "deny"}}}


# ----------------------------------------------------------------------------- the file format


def test_full_config_parses(pki: Path, tmp_path: Path) -> None:
    wc = load_web_config(write(tmp_path, mtls(pki, min_version="TLS13", cipher_suites=list(GO_CIPHER_SUITES)[:2],
                                              client_allowed_sans=["spiffe://lab/prometheus"])))
    assert wc.tls and wc.authenticates and wc.client_auth_type == "RequireAndVerifyClientCert"
    assert wc.min_version == "TLS13" and wc.max_version == "TLS13"
    assert wc.users == (("prometheus", HASH.encode()),)
    assert dict(wc.headers) == {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "deny"}
    assert set(wc.files()) == {str(tmp_path / "web.yml"), str(pki / "metrics.pem"), str(pki / "metrics.key"),
                               str(pki / "ca.pem")}
    ctx = WebGuard(wc).context
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3


def test_empty_file_and_basic_auth_only(tmp_path: Path) -> None:
    assert load_web_config(write(tmp_path, "")).tls is False  # exporter-toolkit: no TLS, no auth
    wc = load_web_config(write(tmp_path, {"basic_auth_users": {"u": HASH}}))
    assert not wc.tls and wc.authenticates and WebGuard(wc).context is None


def test_relative_paths_are_relative_to_the_file(pki: Path, tmp_path: Path) -> None:
    tls = {**mtls(pki)["tls_server_config"], "cert_file": "metrics.pem", "key_file": "./metrics.key"}
    wc = load_web_config(write(pki, {"tls_server_config": tls}, "rel.yml"))
    assert (wc.cert_file, wc.key_file) == (str(pki / "metrics.pem"), str(pki / "metrics.key"))


TLS_ERRORS = [
    ("unknown-top", {"web": 1}, "web: unknown key"),
    ("rate-limit", {"rate_limit": {"interval": "1s"}}, "rate_limit: not supported by rpcguard"),
    ("unknown-tls", {"tls_server_config": {"certfile": "x"}}, "tls_server_config.certfile: unknown key"),
    ("inline-cert", {"tls_server_config": {"cert": "PEM"}}, "tls_server_config.cert: inline certificates"),
    ("curves", {"tls_server_config": {"curve_preferences": ["X25519"]}},
     "tls_server_config.curve_preferences: not supported by Python's ssl"),
    ("no-key", {"tls_server_config": {"cert_file": "{pki}/metrics.pem"}},
     "tls_server_config.key_file: required when tls_server_config is set"),
    ("missing-file", {"tls_server_config": {"cert_file": "{pki}/nope.pem", "key_file": "{pki}/metrics.key"}},
     "tls_server_config.cert_file: no such file"),
    ("auth-type", {"TLS": {"client_auth_type": "Maybe"}}, "tls_server_config.client_auth_type: 'Maybe': expected one of"),
    ("request-cert", {"TLS": {"client_auth_type": "RequestClientCert"}},
     "tls_server_config.client_auth_type: RequestClientCert accepts a client certificate without verifying it"),
    ("require-any", {"TLS": {"client_auth_type": "RequireAnyClientCert"}},
     "tls_server_config.client_auth_type: RequireAnyClientCert accepts a client certificate without verifying it"),
    ("ca-no-policy", {"TLS": {"client_ca_file": "{pki}/ca.pem"}},
     "tls_server_config.client_auth_type: client CA configured without a client auth policy"),
    ("policy-no-ca", {"TLS": {"client_auth_type": "RequireAndVerifyClientCert"}},
     "tls_server_config.client_ca_file: required with client_auth_type RequireAndVerifyClientCert"),
    ("min-version", {"TLS": {"min_version": "1.3"}}, "tls_server_config.min_version: '1.3': expected one of TLS10"),
    ("max-below-min", {"TLS": {"min_version": "TLS13", "max_version": "TLS12"}},
     "tls_server_config.max_version: TLS12 is below min_version TLS13"),
    ("cipher", {"TLS": {"cipher_suites": ["TLS_RSA_WITH_RC4_128_SHA"]}},
     "tls_server_config.cipher_suites: 'TLS_RSA_WITH_RC4_128_SHA' is not a supported suite"),
    ("sans-without-verify", {"TLS": {"client_allowed_sans": ["a"]}},
     "tls_server_config.client_allowed_sans: needs client_auth_type RequireAndVerifyClientCert"),
    ("http2", {"http_server_config": {"http2": True}}, "http_server_config.http2: rpcguard's metrics endpoint speaks HTTP/1.1"),
    ("header", {"http_server_config": {"headers": {"Server": "x"}}}, "http_server_config.headers.Server: header not allowed"),
    ("header-value", {"http_server_config": {"headers": {"X-Frame-Options": "allow"}}},
     "http_server_config.headers.X-Frame-Options: 'allow': expected one of deny, sameorigin"),
    ("plain-password", {"basic_auth_users": {"u": "hunter2"}}, "basic_auth_users.u: must be a bcrypt hash"),
    ("user-colon", {"basic_auth_users": {"a:b": HASH}}, "basic_auth_users.a:b: user names are non-empty strings"),
    ("not-mapping", {"tls_server_config": ["x"]}, "tls_server_config: must be a mapping"),
]


@pytest.mark.parametrize("data, expected", [pytest.param(d, e, id=i) for i, d, e in TLS_ERRORS])
def test_bad_web_config_names_file_and_key(pki: Path, tmp_path: Path, data: dict, expected: str) -> None:
    if "TLS" in data:  # a valid cert/key plus the keys under test
        data = {"tls_server_config": {"cert_file": "{pki}/metrics.pem", "key_file": "{pki}/metrics.key", **data["TLS"]}}
    text = yaml.safe_dump(data).replace("{pki}", str(pki))
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_web_config(path)
    assert str(info.value).startswith(f"{path}: {expected}"), str(info.value)


def test_bad_yaml_and_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_web_config(write(tmp_path, "a: [b"))
    with pytest.raises(ConfigError, match="cannot read web config"):
        load_web_config(str(tmp_path / "absent.yml"))


def test_key_not_matching_certificate_is_a_config_error(pki: Path, tmp_path: Path) -> None:
    data = mtls(pki)
    data["tls_server_config"]["key_file"] = str(pki / "prometheus.key")
    with pytest.raises(ConfigError, match="cannot load certificate, key or client CA"):
        WebGuard.load(write(tmp_path, data))


# ----------------------------------------------------------------------------- config rules


def serve_overrides(pki: Path, **kw: Any) -> dict:
    return {"cert": str(pki / "metrics.pem"), "key": str(pki / "metrics.key"), "ca": str(pki / "ca.pem"),
            "listen": "127.0.0.1:0", "upstream": "127.0.0.1:1", "allow_all": True, **kw}


def test_public_metrics_address_needs_an_authenticating_web_config(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--metrics: 0.0.0.0:9450 is not loopback; set metrics.web_config"):
        build_config("serve", overrides=serve_overrides(pki, metrics="0.0.0.0:9450"))
    tls_only = write(tmp_path, {"tls_server_config": mtls(pki)["tls_server_config"] | {
        "client_auth_type": "VerifyClientCertIfGiven"}}, "tls-only.yml")
    with pytest.raises(ConfigError, match="its web config must enable TLS and require RequireAndVerifyClientCert"):
        build_config("serve", overrides=serve_overrides(pki, metrics="0.0.0.0:9450", web_config=tls_only))
    password_in_clear = write(tmp_path, {"basic_auth_users": {"u": HASH}}, "plain.yml")
    with pytest.raises(ConfigError, match="its web config must enable TLS"):
        build_config("serve", overrides=serve_overrides(pki, metrics="0.0.0.0:9450", web_config=password_in_clear))
    good = write(tmp_path, mtls(pki), "good.yml")
    cfg = build_config("serve", overrides=serve_overrides(pki, metrics="0.0.0.0:9450", web_config=good))
    assert cfg.metrics.web_config == good and not cfg.metrics.unsafe_public


def test_web_config_errors_name_the_flag_or_key(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--web-config: no such file"):
        build_config("serve", overrides=serve_overrides(pki, web_config=str(tmp_path / "nope.yml")))
    bad = write(tmp_path, {"basic_auth_users": {"u": "x"}}, "bad.yml")
    conf = tmp_path / "serve.yaml"
    conf.write_text(yaml.safe_dump({"metrics": {"web_config": "bad.yml"}}), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.yml: basic_auth_users.u: must be a bcrypt hash"):
        build_config("serve", file=str(conf), overrides=serve_overrides(pki))


# ----------------------------------------------------------------------------- the endpoint


def client_ctx(pki: Path, name: str | None = "prometheus", ca_dir: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if name:
        d = ca_dir or pki
        ctx.load_cert_chain(str(d / f"{name}.pem"), str(d / f"{name}.key"))
    return ctx


async def fetch(port: int, path: str, ctx: ssl.SSLContext | None, auth: tuple[str, str] | None = None
                ) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                                   server_hostname="localhost" if ctx else None)
    extra = ""
    if auth:
        extra = "Authorization: Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode() + "\r\n"
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, body


async def refused(port: int, ctx: ssl.SSLContext | None) -> None:
    """The connection must fail (handshake error, or the TLS 1.3 post-handshake alert on read)."""
    with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError)):
        await fetch(port, "/metrics", ctx, ("prometheus", PASSWORD))


async def serving(guard: WebGuard, fn: Callable[[int, Metrics], Coroutine[Any, Any, Any]]) -> Any:
    m = Metrics(role="serve")
    m.listener("serve", "gpu0")
    server = await start_http(m, "127.0.0.1", 0, web=lambda: guard)
    try:
        return await fn(server.sockets[0].getsockname()[1], m)
    finally:
        server.close()
        await server.wait_closed()


def test_mtls_and_basic_auth_end_to_end(pki: Path, tmp_path: Path, run) -> None:  # type: ignore[no-untyped-def]
    guard = WebGuard.load(write(tmp_path, mtls(pki)))

    async def body(port: int, m: Metrics) -> None:
        ok = client_ctx(pki)
        status, headers, text = await fetch(port, "/metrics", ok, ("prometheus", PASSWORD))
        assert status == 200 and b"rpcguard_refusals_total" in text and b"process_open_fds" in text
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "deny"
        status, _, text = await fetch(port, "/refusals", ok, ("prometheus", PASSWORD))
        assert (status, text) == (200, b"[]\n")
        # authenticated by certificate but not by password
        # a password past bcrypt's 72 bytes is a wrong one (bcrypt >= 5 raised, the connection dropped)
        for auth, reason in ((None, "auth_required"), (("prometheus", "wrong"), "auth_failed"),
                             (("nobody", PASSWORD), "auth_failed"), (("prometheus", "x" * 100), "auth_failed"),
                             (("prometheus", PASSWORD + "é" * 40), "auth_failed")):
            status, headers, _ = await fetch(port, "/metrics", ok, auth)
            assert status == 401 and headers["www-authenticate"].startswith('Basic realm="rpcguard"'), auth
            assert m.web_refusals[reason] >= 1
        assert (await fetch(port, "/refusals", ok, ("prometheus", "wrong")))[0] == 401
        # health probes skip basic auth (still TLS with a client certificate here)
        assert (await fetch(port, "/healthz", ok))[0::2] == (200, b"ok\n")
        assert (await fetch(port, "/readyz", ok))[0] == 200
        # no client certificate, a certificate of another CA, plain HTTP: refused in the handshake
        await refused(port, client_ctx(pki, None))
        await refused(port, client_ctx(pki, "stranger", pki / "other"))
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /metrics HTTP/1.1\r\n\r\n")
        answer = await asyncio.wait_for(r.read(), 5)
        assert answer.startswith(b"HTTP/1.1 400 ") and b"HTTPS" in answer and b"rpcguard" not in answer
        w.close()
        deadline = asyncio.get_running_loop().time() + 15  # the server counts after its side of the handshake failed
        while asyncio.get_running_loop().time() < deadline:
            if m.web_refusals["tls_no_client_cert"] and m.web_refusals["tls_unknown_ca"] and m.web_refusals["tls_not_tls"]:
                break
            await asyncio.sleep(0.02)
        assert m.web_refusals["tls_no_client_cert"] == 1, m.web_refusals
        assert m.web_refusals["tls_unknown_ca"] == 1, m.web_refusals
        assert m.web_refusals["tls_not_tls"] == 1, m.web_refusals
        g = m.registry.get_sample_value
        assert g("rpcguard_web_refusals_total", {"role": "serve", "reason": "auth_required"}) == 1

    run(serving(guard, body))


def test_successful_bcrypt_checks_are_cached(pki: Path, tmp_path: Path, run) -> None:  # type: ignore[no-untyped-def]
    guard = WebGuard.load(write(tmp_path, mtls(pki)))

    async def body(port: int, m: Metrics) -> None:
        ok = client_ctx(pki)
        for _ in range(5):
            assert (await fetch(port, "/metrics", ok, ("prometheus", PASSWORD)))[0] == 200
        assert guard.auth is not None and guard.auth.bcrypt_checks == 1  # one bcrypt for five scrapes
        for _ in range(3):  # failures are never cached: each wrong password costs a check
            assert (await fetch(port, "/metrics", ok, ("prometheus", PASSWORD + "x")))[0] == 401
        assert guard.auth.bcrypt_checks == 4
        assert (await fetch(port, "/metrics", ok, ("prometheus", PASSWORD)))[0] == 200
        assert guard.auth.bcrypt_checks == 4

    run(serving(guard, body))


def test_bcrypt_runs_off_the_event_loop(tmp_path: Path, run) -> None:  # type: ignore[no-untyped-def]
    slow = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=11)).decode()  # ~0.15 s of one core
    guard = WebGuard.load(write(tmp_path, {"basic_auth_users": {"u": slow}}))
    assert guard.auth is not None

    async def body() -> tuple[str | None, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        t = asyncio.create_task(ticker())
        result = await guard.auth.check("Basic " + base64.b64encode(b"u:pw").decode())  # type: ignore[union-attr]
        t.cancel()
        return result, ticks

    result, ticks = run(body())
    assert result is None
    assert ticks >= 10, ticks  # the loop kept running while bcrypt worked (0 if it blocked)


def test_client_allowed_sans(pki: Path, tmp_path: Path, run) -> None:  # type: ignore[no-untyped-def]
    data = mtls(pki, client_allowed_sans=["spiffe://lab/prometheus"])
    del data["basic_auth_users"]
    guard = WebGuard.load(write(tmp_path, data))

    async def body(port: int, m: Metrics) -> None:
        assert (await fetch(port, "/metrics", client_ctx(pki)))[0] == 200
        assert (await fetch(port, "/metrics", client_ctx(pki, "grafana")))[0] == 403
        assert (await fetch(port, "/healthz", client_ctx(pki, "grafana")))[0] == 200
        assert m.web_refusals["client_san_not_allowed"] == 1

    run(serving(guard, body))


def test_verify_if_given_lets_a_load_balancer_probe_health(pki: Path, tmp_path: Path, run) -> None:  # type: ignore[no-untyped-def]
    data = mtls(pki, client_auth_type="VerifyClientCertIfGiven")
    guard = WebGuard.load(write(tmp_path, data))

    async def body(port: int, m: Metrics) -> None:
        anonymous = client_ctx(pki, None)
        assert (await fetch(port, "/healthz", anonymous))[0] == 200
        assert (await fetch(port, "/metrics", anonymous))[0] == 401
        assert (await fetch(port, "/metrics", anonymous, ("prometheus", PASSWORD)))[0] == 200
        await refused(port, client_ctx(pki, "stranger", pki / "other"))  # a certificate, if given, is verified

    run(serving(guard, body))


# ----------------------------------------------------------------------------- reload


def test_runtime_reloads_the_web_config_and_keeps_it_on_error(pki: Path, tmp_path: Path) -> None:
    path = write(tmp_path, mtls(pki))
    ov = serve_overrides(pki, web_config=path)
    rt = Runtime(build_config("serve", overrides=ov), overrides=ov)
    first = rt.web
    assert first.auth is not None and first.context is not None

    data = mtls(pki)
    data["basic_auth_users"] = {"prometheus": HASH, "grafana": HASH}
    write(tmp_path, data)
    assert asyncio.run(rt.reload("test")) is True
    assert rt.web is not first and rt.web.config is not None and len(rt.web.config.users) == 2

    kept = rt.web
    write(tmp_path, {"basic_auth_users": {"grafana": "not-a-hash"}})
    assert asyncio.run(rt.reload("test")) is False
    assert rt.web is kept
    g = rt.metrics.registry.get_sample_value
    assert g("rpcguard_reload_last_successful", {"role": "serve"}) == 0
    assert g("rpcguard_reload_total", {"role": "serve", "result": "error"}) == 1
    # the poll watcher sees the web config files
    before = rt.reloader.files_stamp()
    write(tmp_path, data)
    assert rt.reloader.files_stamp() != before


def test_loading_a_web_config_computes_no_bcrypt(pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload runs on the event loop: building the guard must not hash (only checks do, in a thread)."""
    def no_hashing(*_a: object, **_k: object) -> None:
        raise AssertionError("bcrypt work while loading the web config")

    monkeypatch.setattr(bcrypt, "hashpw", no_hashing)
    monkeypatch.setattr(bcrypt, "checkpw", no_hashing)
    guard = WebGuard.load(write(tmp_path, mtls(pki)))
    assert guard.auth is not None and guard.auth.bcrypt_checks == 0


def test_an_encrypted_key_is_a_config_error_not_a_prompt(pki: Path, tmp_path: Path) -> None:
    # The web config format (exporter-toolkit's) has no passphrase key. OpenSSL's default for an
    # encrypted key is to ask on the terminal: serve started by hand would wait at a prompt.
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key((pki / "metrics.key").read_bytes(), None)
    enc = tmp_path / "metrics-enc.key"
    enc.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.BestAvailableEncryption(b"pw")))
    enc.chmod(0o600)
    data = mtls(pki)
    data["tls_server_config"]["key_file"] = str(enc)
    with pytest.raises(ConfigError, match="key_file: .*is encrypted .*no passphrase: give an unencrypted key"):
        WebGuard.load(write(tmp_path, data))
