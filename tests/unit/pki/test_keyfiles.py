"""One key-permission rule, one message, wherever rpcguard reads a private key: the TLS key
(serve/connect), the CA key (certs issue / sign), the metrics web config's key_file; and a
certificate given as a key is named as such."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rpcguard.pki import certs, tls
from rpcguard.pki.csr import make_csr, sign_csr
from rpcguard.errors import ConfigError
from rpcguard.pki.keyfiles import key_file_problem
from rpcguard.observe.webconfig import load_web_config

OPEN = "private key is accessible by others (mode 0644); chmod 600 it (or chown root and chmod 640)"
AS_KEY = "is a certificate, not a private key (were the certificate and key files swapped?)"


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    certs.init_ca(tmp_path / "ca")
    certs.issue(tmp_path, "node1", server=True, dns=["node1"], ca_dir=tmp_path / "ca")
    return tmp_path


def test_the_rule(pki):
    key = pki / "node1.key"
    assert key_file_problem(key) is None
    key.chmod(0o644)
    assert key_file_problem(key) == f"{key}: {OPEN}"
    assert key_file_problem(key, allow_insecure=True) is None
    assert key_file_problem(pki / "node1.pem") == f"{pki / 'node1.pem'}: {AS_KEY}"
    assert key_file_problem(pki / "nope.key") == f"{pki / 'nope.key'}: cannot read private key: No such file or directory"


def test_the_tls_key(pki):
    ca = pki / "ca" / "ca.pem"
    (pki / "node1.key").chmod(0o644)
    with pytest.raises(tls.TlsConfigError) as info:
        tls.server_context(pki / "node1.pem", pki / "node1.key", ca)
    assert str(info.value) == f"{pki / 'node1.key'}: {OPEN}"
    with pytest.raises(tls.TlsConfigError) as info:  # swapped: the certificate is named, not told to chmod
        tls.server_context(pki / "node1.pem", pki / "node1.pem", ca)
    assert str(info.value) == f"{pki / 'node1.pem'}: {AS_KEY}"


def test_the_ca_key_of_issue_and_sign(pki):
    ca_key = pki / "ca" / "ca.key"
    ca_key.chmod(0o644)
    with pytest.raises(certs.CertError) as info:
        certs.issue(pki, "node2", server=True, dns=["node2"], ca_dir=pki / "ca")
    assert str(info.value) == f"{ca_key}: {OPEN.replace('private key', 'CA key', 1)}"
    assert not (pki / "node2.pem").exists()
    make_csr(pki, "node3", server=True, dns=["node3"])
    with pytest.raises(certs.CertError) as info:
        sign_csr(pki / "ca", pki / "node3.csr", pki / "node3.pem")
    assert str(info.value) == f"{ca_key}: {OPEN.replace('private key', 'CA key', 1)}"


def test_the_web_config_key_file(pki, tmp_path):
    key = tmp_path / "web.key"
    shutil.copy(pki / "node1.key", key)
    key.chmod(0o644)
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {pki / 'node1.pem'}\n  key_file: {key}\n")
    with pytest.raises(ConfigError) as info:
        load_web_config(str(web))
    assert str(info.value).endswith(f"tls_server_config.key_file: {key}: {OPEN}"), str(info.value)
    os.chmod(key, 0o600)
    assert load_web_config(str(web)).key_file == str(key)


# -- passphrase files and systemd credentials (issue 31 item 4) ----------------------------------


def _secret(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("data,expected", [(b"s3cret\n", b"s3cret"), (b"s3cret", b"s3cret"),
                                           (b"s3cret\r\nsecond line\n", b"s3cret"), (b"with space \n", b"with space ")])
def test_the_passphrase_is_the_first_line(tmp_path, data, expected):
    from rpcguard.pki.keyfiles import read_passphrase

    assert read_passphrase(_secret(tmp_path / "pw", data)) == expected


@pytest.mark.parametrize("data,mode,message", [
    (b"s3cret\n", 0o644, "pw: passphrase file is accessible by others (mode 0644)"),
    (b"\n", 0o600, "pw: passphrase file is empty"),
    (b"", 0o600, "pw: passphrase file is empty"),
    (b"x" * 1024 + b"\n", 0o600, "pw: first line longer than 1023 bytes"),
])
def test_the_key_file_rule_applies_to_the_passphrase_file(tmp_path, data, mode, message):
    from rpcguard.pki.keyfiles import read_passphrase

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_passphrase(_secret(tmp_path / "pw", data, mode))
    with pytest.raises(ValueError, match="cannot read passphrase file"):
        read_passphrase(tmp_path / "missing")


def test_a_credential_is_a_file_of_credentials_directory(tmp_path, monkeypatch):
    from rpcguard.pki.keyfiles import credential_path

    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with pytest.raises(ValueError, match=r"\$CREDENTIALS_DIRECTORY is not set .*LoadCredential=node.key:PATH"):
        credential_path("credential:node.key")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    with pytest.raises(ValueError, match="no credential 'node.key' in .*add LoadCredential=node.key:PATH"):
        credential_path("credential:node.key")
    _secret(tmp_path / "node.key", b"k", 0o400)
    assert credential_path("credential:node.key") == str(tmp_path / "node.key")
    for bad in ("credential:", "credential:a/b", "credential:.."):
        with pytest.raises(ValueError, match="expected credential:NAME"):
            credential_path(bad)
