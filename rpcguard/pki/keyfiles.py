"""One rule for every private key rpcguard reads: the TLS key, its passphrase, the CA key, the metrics web config's.

How this works: ``key_file_problem(path)`` returns the one line that says what is wrong with a
private key file, or None. A file that holds a certificate and no private key is named as such
(the most common slip: ``--cert`` and ``--key`` swapped), before its mode is looked at. The mode
rule is PostgreSQL's: 0600 or stricter, or 0640 when owned by root (a group such as ``rpcguard``
may read a root-owned key). Callers raise their own error type with the message (pki/tls.py
``TlsConfigError``, pki/certs.py ``CertError``, observe/webconfig.py ``ConfigError``).

An encrypted key's passphrase is a secret of the same weight: ``read_passphrase`` applies the
same rule to the passphrase file (``tls.key_passphrase_file``, ``certs issue --passphrase-file``)
and returns its first line. ``credential_path`` resolves ``credential:NAME``, a file systemd
hands the service (``LoadCredential=NAME:PATH`` or ``LoadCredentialEncrypted=``) in
``$CREDENTIALS_DIRECTORY``, mode 0400 and owned by the service's user (systemd.exec(5),
"Credentials"); any file key of ``tls:`` may name one.
"""

from __future__ import annotations

import os
import stat

__all__ = ["key_file_problem", "read_passphrase", "credential_path", "CREDENTIAL_PREFIX", "MAX_PASSPHRASE_BYTES"]

_READ_BYTES = 1 << 20  # a PEM key is a few KiB; enough to tell a certificate from a key
# OpenSSL's PEM callbacks take passphrases of up to 1023 bytes (PEM_BUFSIZE 1024); a longer first
# line is a wrong file, not a passphrase.
MAX_PASSPHRASE_BYTES = 1023
CREDENTIAL_PREFIX = "credential:"


def key_file_problem(path: str | os.PathLike[str], *, allow_insecure: bool = False,
                     what: str = "private key") -> str | None:
    """What is wrong with the private key file ``path`` (one line naming it), or None.

    ``what``: the name of the secret in the message (``"passphrase file"``)."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            head = f.read(_READ_BYTES)
    except OSError as exc:
        return f"{os.fspath(path)}: cannot read {what}: {exc.strerror or exc}"
    if b"-----BEGIN CERTIFICATE" in head and b"PRIVATE KEY-----" not in head:
        return (f"{os.fspath(path)}: is a certificate, not a {what} (were the certificate and key files "
                "swapped?)")
    if allow_insecure or os.name != "posix":
        return None
    mode = stat.S_IMODE(st.st_mode)
    if mode & (0o037 if st.st_uid == 0 else 0o077):
        return (f"{os.fspath(path)}: {what} is accessible by others (mode {mode:04o}); chmod 600 it "
                "(or chown root and chmod 640)")
    return None


def read_passphrase(path: str | os.PathLike[str], *, allow_insecure: bool = False) -> bytes:
    """The first line of the passphrase file ``path`` (its line ending removed); ``ValueError``
    with one line naming the file when the key-file rule refuses it or it holds no passphrase."""
    problem = key_file_problem(path, allow_insecure=allow_insecure, what="passphrase file")
    if problem:
        raise ValueError(problem)
    with open(path, "rb") as f:
        line = f.readline(MAX_PASSPHRASE_BYTES + 2).rstrip(b"\r\n")
    if not line:
        raise ValueError(f"{os.fspath(path)}: passphrase file is empty (the passphrase is its first line)")
    if len(line) > MAX_PASSPHRASE_BYTES:
        raise ValueError(f"{os.fspath(path)}: first line longer than {MAX_PASSPHRASE_BYTES} bytes: not a passphrase")
    return line


def credential_path(value: str) -> str:
    """The file of ``credential:NAME`` in ``$CREDENTIALS_DIRECTORY``; ``ValueError`` saying what is
    missing (the variable: not started by systemd with a credential; the file: no such credential)."""
    name = value[len(CREDENTIAL_PREFIX):]
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{value!r}: expected credential:NAME, NAME as in LoadCredential=NAME:PATH")
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        raise ValueError(f"{value}: $CREDENTIALS_DIRECTORY is not set (a systemd unit with "
                         f"LoadCredential={name}:PATH sets it)")
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise ValueError(f"{value}: no credential {name!r} in $CREDENTIALS_DIRECTORY ({directory}): "
                         f"add LoadCredential={name}:PATH to the unit")
    return path
