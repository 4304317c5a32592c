"""The TLS material a process serves with: certificate, key and CA as an SSL context.

How this works: ``TlsMaterial.prepare`` reads and checks the files of a ``TlsConfig`` (context
built, expiry read, a digest of each file taken) without changing anything; ``use`` puts prepared
material in use. A reload prepares first and commits only when the whole new configuration is
good, so bad material leaves the running contexts untouched. Routes reach the context through a
getter: running sessions keep the context they were accepted with.

serve holds two server contexts of the same files, one per thing a listener can say in ALPN
(``context_for(enforcing)``, pki/tls.py); connect holds the tunnels' client context and the probe's
(``probe_context``: ``rpcguard check``, ``/readyz``).
"""

from __future__ import annotations

import hashlib
import os
import ssl
from dataclasses import dataclass

from rpcguard.pki.crl import Crl, load_crl
from rpcguard.pki.crl import apply as apply_crl
from rpcguard.pki.preflight import material_expiry
from rpcguard.config.model import Config, TlsConfig
from rpcguard.pki.tls import client_context, probe_context, server_context
from rpcguard.protocol.side import SIDES

__all__ = ["TlsMaterial"]


@dataclass(frozen=True)
class _TlsLoad:
    """TLS material read and checked, not yet in use."""
    tls: TlsConfig
    context: ssl.SSLContext  # serve: the enforcing listeners'; connect: the tunnels'
    other: ssl.SSLContext  # serve: the monitoring listeners'; connect: the probe's
    expiry: dict[str, float]
    stamp: tuple
    digest: dict[str, str]  # "cert"/"key"/"ca"/"crl" -> sha256 of the file's bytes
    crl: Crl | None  # the revocation list checked at every handshake (tls.crl)


class TlsMaterial:
    """The current certificate, key and CA as SSL contexts; replaced whole on reload."""

    def __init__(self, cfg: Config) -> None:
        self.role = cfg.role
        self.tls = cfg.tls
        self.use(self.prepare(cfg.tls))

    def prepare(self, tls_cfg: TlsConfig) -> _TlsLoad:
        """Read and check the material of ``tls_cfg`` (raises on any problem); nothing changes yet."""
        stamp = _stamp_of(tls_cfg)  # before reading: a file replaced meanwhile is seen as changed again
        digest: dict[str, str] = {}
        for name in ("cert", "key", "ca", "crl"):
            if getattr(tls_cfg, name) is None:
                continue
            with open(getattr(tls_cfg, name), "rb") as f:
                digest[name] = hashlib.sha256(f.read()).hexdigest()
        crl = load_crl(tls_cfg.crl, tls_cfg.ca) if tls_cfg.crl else None
        main, other = self._build(tls_cfg)
        if crl is not None:
            for ctx in (main, other):
                apply_crl(ctx, crl)
        expiry = self._read_expiry(tls_cfg)
        if crl is not None and crl.next_update is not None:
            expiry["crl"] = crl.next_update  # past it, OpenSSL refuses every peer (tls_crl_expired)
        return _TlsLoad(tls_cfg, main, other, expiry, stamp, digest, crl)

    def use(self, loaded: _TlsLoad) -> None:
        """Put prepared material in use (new sessions get it)."""
        self.tls, self.context, self.loaded_expiry = loaded.tls, loaded.context, loaded.expiry
        self._other = loaded.other
        self.stamp, self.digest = loaded.stamp, loaded.digest
        self.crl = loaded.crl

    def revoked(self, serial: int) -> bool:
        """The certificate of this serial is on the CRL in use."""
        return self.crl is not None and serial in self.crl.revoked

    def context_for(self, enforcing: bool) -> ssl.SSLContext:
        """serve: the context of a listener that enforces everything (or not): its ALPN says which."""
        return self.context if enforcing or not SIDES[self.role].client_tls else self._other

    @property
    def probe_context(self) -> ssl.SSLContext:
        """connect: the context of a probe (ALPN_PROBES), which the node never queues."""
        return self._other if SIDES[self.role].upstream_is_guard else self.context

    def _build(self, t: TlsConfig) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        pw = t.key_passphrase_file
        if SIDES[self.role].client_tls:  # serve: the server side of the clients' TLS
            return (server_context(t.cert, t.key, t.ca, min_version=t.min_version, key_passphrase_file=pw),
                    server_context(t.cert, t.key, t.ca, min_version=t.min_version, enforcing=False,
                                   key_passphrase_file=pw))
        # One client context serves every tunnel: the expected node name is given per connection.
        return (client_context(t.cert, t.key, t.ca, server_name="rpcguard-node", min_version=t.min_version,
                               key_passphrase_file=pw),
                probe_context(t.cert, t.key, t.ca, min_version=t.min_version, key_passphrase_file=pw))

    @staticmethod
    def _read_expiry(t: TlsConfig) -> dict[str, float]:
        """notAfter of the certificate and of the CA bundle (its first CA to expire)."""
        return material_expiry(t.cert, t.ca)

    def _stamp(self) -> tuple:
        return _stamp_of(self.tls)


def _stamp_of(tls: TlsConfig) -> tuple:
    out: list[tuple[int, int, int] | None] = []
    for path in (tls.cert, tls.key, tls.ca, tls.crl, tls.key_passphrase_file):
        if path is None:
            out.append(None)
            continue
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)
