"""``rpcguard status`` against a real serve whose metrics endpoint has a real web config: TLS,
RequireAndVerifyClientCert and basic auth, as deploy/kubernetes and prometheus.example.yml use it.
Each way of not giving what the endpoint asks for is one line naming the option to pass."""

from __future__ import annotations

import os
import subprocess

import bcrypt
import pytest
import yaml

from tests.support.guard import start_guard
from tests.support.realpeer import PYTHON

PASSWORD = "status-reads-me"


def status(*args: str, password: str | None = PASSWORD) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RPCGUARD_METRICS_PASSWORD"}
    if password is not None:
        env["RPCGUARD_METRICS_PASSWORD"] = password
    p = subprocess.run([PYTHON, "-m", "rpcguard", "status", *args], capture_output=True, text=True, timeout=60,
                       env=env)
    assert "Traceback" not in p.stdout + p.stderr and "internal error" not in p.stderr, p.stdout + p.stderr
    return p


@pytest.fixture
def node(pki, workdir, rpc_server):
    pki.issue("metrics", server=True, dns=["localhost"], ips=["127.0.0.1"])
    pki.issue("operator", server=False, uris=["spiffe://lab/operator"])
    web = workdir / "web.yml"
    web.write_text(yaml.safe_dump({
        "tls_server_config": {"cert_file": pki.path("metrics"), "key_file": pki.path("metrics", "key"),
                              "client_ca_file": pki.path("ca"), "client_auth_type": "RequireAndVerifyClientCert"},
        "basic_auth_users": {"operator": bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()}}))
    g = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args(),
                                       "--web-config", str(web)])
    yield g, web
    g.stop()


def test_status_reads_a_tls_basic_auth_endpoint_with_readiness_and_certificate_files(node, pki):
    g, _ = node
    url = f"https://127.0.0.1:{g.metrics_port}"
    client = ["--cert", pki.path("operator"), "--key", pki.path("operator", "key")]
    p = status("--metrics", url, "--ca", pki.path("ca"), *client, "--user", "operator")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert out.startswith(f"rpcguard instance at {url}/metrics\n"), out
    assert "  ready: yes - listener0: 127.0.0.1:" in out and "answered HELLO" in out, out
    assert "serve listener0: 0 active" in out and "protocol core: " in out, out
    # each certificate with the file it was loaded from and its expiry date
    assert f"  certificate cert {pki.path(pki.node)} expires 20" in out, out
    assert f"  certificate ca {pki.path('ca')} expires 20" in out, out
    # what is missing, one line each
    cases = [
        (["--metrics", url, *client, "--user", "operator"], "cannot verify the TLS certificate", "pass --ca FILE"),
        (["--metrics", url, "--ca", pki.path("ca"), "--user", "operator"], "requires a client certificate",
         "--cert FILE --key FILE"),
        (["--metrics", url, "--ca", pki.path("ca"), *client], "401 unauthorized", "--user USER"),
        (["--metrics", f"127.0.0.1:{g.metrics_port}"], "serves TLS", "https://"),
    ]
    for args, what, hint in cases:
        p = status(*args)
        assert p.returncode == 1 and p.stdout == "", (args, p.stdout)
        (line,) = p.stderr.splitlines()
        assert line.startswith("rpcguard status: ") and what in line and hint in line, (args, line)
    p = status("--metrics", url, "--ca", pki.path("ca"), *client, "--user", "operator", password="wrong")
    assert p.returncode == 1 and "401 unauthorized: wrong user or password" in p.stderr, p.stderr


def test_status_reads_the_endpoint_a_config_names(node, pki, workdir):
    g, web = node
    cfg = workdir / "serve.yaml"
    cfg.write_text(yaml.safe_dump({
        "tls": {"cert": pki.path(pki.node), "key": pki.path(pki.node, "key"), "ca": pki.path("ca")},
        "metrics": {"listen": f"127.0.0.1:{g.metrics_port}", "web_config": str(web)},
        "allow": {"all": True}, "listeners": [{"listen": "127.0.0.1:0", "upstream": "127.0.0.1:1"}]}))
    p = status("--config", str(cfg), "--cert", pki.path("operator"), "--key", pki.path("operator", "key"),
               "--user", "operator")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"rpcguard instance at https://127.0.0.1:{g.metrics_port}/metrics\n"), p.stdout
    assert "  ready: yes" in p.stdout
