"""The lowest TLS version a side accepts (``tls.min_version``): one list, one default.

How this works: ``TlsVersion`` is the one list of allowed values, as a ``Literal`` so mypy checks
every use; ``TLS_MIN_VERSIONS`` is the same list at run time (config readers, flag choices, error
messages) and ``DEFAULT_MIN_VERSION`` the one default (TLS 1.3: 1.2 is an opt-in for old peers,
pki/tls.py says which ciphers it then allows). No ssl or cryptography import: the config layer
reads these without loading either.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

__all__ = ["TlsVersion", "TLS_MIN_VERSIONS", "DEFAULT_MIN_VERSION"]

TlsVersion = Literal["1.3", "1.2"]
TLS_MIN_VERSIONS: Final[tuple[TlsVersion, ...]] = get_args(TlsVersion)
DEFAULT_MIN_VERSION: Final[TlsVersion] = "1.3"
