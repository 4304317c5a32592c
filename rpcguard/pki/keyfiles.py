"""One rule for every private key rpcguard reads: the TLS key, the CA key, the metrics web config's.

How this works: ``key_file_problem(path)`` returns the one line that says what is wrong with a
private key file, or None. A file that holds a certificate and no private key is named as such
(the most common slip: ``--cert`` and ``--key`` swapped), before its mode is looked at. The mode
rule is PostgreSQL's: 0600 or stricter, or 0640 when owned by root (a group such as ``rpcguard``
may read a root-owned key). Callers raise their own error type with the message (pki/tls.py
``TlsConfigError``, pki/certs.py ``CertError``, observe/webconfig.py ``ConfigError``).
"""

from __future__ import annotations

import os
import stat

__all__ = ["key_file_problem"]

_READ_BYTES = 1 << 20  # a PEM key is a few KiB; enough to tell a certificate from a key


def key_file_problem(path: str | os.PathLike[str], *, allow_insecure: bool = False) -> str | None:
    """What is wrong with the private key file ``path`` (one line naming it), or None."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            head = f.read(_READ_BYTES)
    except OSError as exc:
        return f"{os.fspath(path)}: cannot read private key: {exc.strerror or exc}"
    if b"-----BEGIN CERTIFICATE" in head and b"PRIVATE KEY-----" not in head:
        return (f"{os.fspath(path)}: is a certificate, not a private key (were the certificate and key files "
                "swapped?)")
    if allow_insecure or os.name != "posix":
        return None
    mode = stat.S_IMODE(st.st_mode)
    if mode & (0o037 if st.st_uid == 0 else 0o077):
        return (f"{os.fspath(path)}: private key is accessible by others (mode {mode:04o}); chmod 600 it "
                "(or chown root and chmod 640)")
    return None
