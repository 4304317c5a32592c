"""The TLS-only probe of a node: connect's ``/readyz``, and the parts ``rpcguard check`` shares.

How this works: ``tls_probe`` opens one mutual-TLS connection to a node's ``rpcguard serve``:
TCP connect and TLS handshake with the probe context (pki/tls.py ``ALPN_PROBES``), then a short
wait (``VERDICT_WAIT_S``) for the node's verdict on our certificate, which TLS 1.3 delivers on
the first read after the handshake, and close. It sends no HELLO, so the node's ``serve`` never
takes its single upstream slot for it (it takes it at HELLO). Failures are classified like the
data path (``proxy/link.py``): the connect itself -> ``node_unreachable``; the handshake, or the
node's verdict -> ``tls_failed`` with its cause (``tls_cert_expired``, ``tls_unknown_ca``,
``tls_bad_certificate`` ...) or ``node_name_mismatch``. A port that accepts TCP and then closes or
resets it during the handshake, or answers with something that is not TLS, is ``tls_failed``
with cause ``tls_not_tls``: a plain ggml-rpc-server or an HTTP port, not an unreachable node.

It lives in pki/ (below admin/ and proxy/) because both use it: connect's ``/readyz``
(proxy/readiness.py) and ``rpcguard check`` (admin/check.py), which plays a HELLO on the same
connection helpers (``open_tls``, ``read_tls``, ``close_tls``, ``Failed``) and reports a
``ProbeResult`` too.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass
from typing import Iterable

from rpcguard.errors import Refusal
from rpcguard.pki.identity import check_usage
from rpcguard.pki.tls import classify_handshake_error, node_mode, peer_identity

__all__ = ["ProbeResult", "Failed", "tls_probe", "open_tls", "read_tls", "close_tls", "closed_on_us",
           "VERDICT_WAIT_S"]

# After a TLS 1.3 handshake the server's verdict on our certificate arrives within one round
# trip (an alert) or not at all (accepted): tls_probe waits this long for it.
VERDICT_WAIT_S = 0.5
_READ_BYTES = 65536
# A node that refuses our certificate may just close (its alert is not always flushed): what we
# know of our own certificate (preflight.certificate_warnings kinds) names the likely cause.
_CAUSE_OF_OWN_WARNING = (("expired", "tls_cert_expired"), ("untrusted", "tls_unknown_ca"),
                         ("not_yet_valid", "tls_bad_certificate"))


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of one probe: ``ok`` with version and device count, or the reason and its cause."""

    name: str
    address: str
    ok: bool
    version: str | None = None
    devices: int | None = None
    reason: str | None = None
    detail: str = ""
    cause: str | None = None  # tls_failed: the handshake reason (tls_cert_expired, tls_unknown_ca...)
    busy: bool = False  # ok: TLS and identity accepted, the node's server serves another session
    node_mode: str | None = None  # what the node said in the handshake: "enforce", "monitor", None

    def line(self) -> str:
        where = f"{self.name} {self.address}"
        if self.ok:
            mode = _MODE_TEXT[self.node_mode]
            if self.busy:
                return f"OK      {where}: TLS and identity accepted, server busy (another session holds it); {mode}"
            if self.version is None:
                return f"OK      {where}: TLS accepted; {mode}"
            return f"OK      {where}: protocol {self.version}, {self.devices} device(s); {mode}"
        if self.cause == "tls_not_tls":
            return f"REFUSED {where}: not TLS ({self.reason}: {self.cause}) - {self.detail}"
        cause = f" ({self.cause})" if self.cause else ""
        return f"REFUSED {where}: {self.reason}{cause} - {self.detail}"

    def as_dict(self) -> dict[str, object]:
        """The result for scripts (``rpcguard check --json``): every field, and the line."""
        return {"name": self.name, "address": self.address, "ok": self.ok, "busy": self.busy,
                "version": self.version, "devices": self.devices, "reason": self.reason, "cause": self.cause,
                "detail": self.detail, "node_mode": self.node_mode, "line": self.line()}


_MODE_TEXT = {"enforce": "node enforces every request check",
              "monitor": "node NOT enforcing (monitor mode or checks off): connect runs its own request checks",
              None: "node did not say it enforces (not rpcguard serve, or an older one): connect runs its own "
                    "request checks"}


class Failed(Exception):
    def __init__(self, reason: str, detail: str, cause: str | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.cause = reason, detail, cause


def tls_failure(exc: BaseException, when: str) -> Failed:
    """A handshake error, or the first read's error after it, as the data path names it."""
    cause = classify_handshake_error(exc)
    if cause == "node_name_mismatch":
        return Failed(cause, f"the node's certificate does not name it: {exc}")
    if cause == "tls_not_tls":
        return Failed("tls_failed", f"{when}: the port does not speak TLS (a plain ggml-rpc-server or an "
                                     f"HTTP port?): {exc}", cause)
    return Failed("tls_failed", f"{when}: {exc}", cause)


async def open_tls(host: str, port: int, ctx: ssl.SSLContext, server_name: str, timeout: float):
    try:
        return await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname=server_name,
                                    ssl_handshake_timeout=timeout), timeout)
    except ssl.SSLError as exc:  # CertificateError is an SSLError too
        raise tls_failure(exc, "TLS handshake with the node failed") from None
    except (OSError, asyncio.TimeoutError) as exc:
        inner = exc.__cause__ or exc.__context__
        if isinstance(inner, ssl.SSLError):
            raise tls_failure(inner, "TLS handshake with the node failed") from None
        if isinstance(exc, ConnectionError) and not isinstance(exc, ConnectionRefusedError):
            # TCP was accepted, then closed under our ClientHello: something answers there, not TLS
            raise Failed("tls_failed", "the port accepted TCP and closed it during the TLS handshake "
                                        f"({type(exc).__name__}): it does not speak TLS (a plain ggml-rpc-server "
                                        "or an HTTP port?); give the node's rpcguard serve address",
                          "tls_not_tls") from None
        what = "timeout" if isinstance(exc, asyncio.TimeoutError) else str(exc) or type(exc).__name__
        if isinstance(exc, socket.gaierror):  # the first mistake of a quick start: a name without DNS
            what += (f" ({host!r} does not resolve here: give --server IP:PORT --server-name {server_name} "
                     "(server / server_name in a config), the name in the node's certificate)")
        raise Failed("node_unreachable", f"cannot reach the node: {what}") from None


async def close_tls(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (OSError, ssl.SSLError, asyncio.TimeoutError):
        writer.transport.abort()


async def read_tls(reader: asyncio.StreamReader, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(_READ_BYTES), timeout)
    except ssl.SSLError as exc:
        raise tls_failure(exc, "the node refused the TLS session") from None
    except asyncio.TimeoutError:
        raise  # an OSError too since Python 3.11: the callers tell silence from a close
    except (ConnectionError, OSError) as exc:
        inner = exc.__cause__ or exc.__context__
        if isinstance(inner, ssl.SSLError):
            raise tls_failure(inner, "the node refused the TLS session") from None
        return b""  # reset: the same as a close for what it tells


def closed_on_us(when: str, own_warnings: frozenset[str]) -> Failed:
    """The node closed the TLS session without a word: it refused our certificate."""
    for kind, cause in _CAUSE_OF_OWN_WARNING:
        if kind in own_warnings:
            return Failed("tls_failed", f"the node closed the TLS session {when}; this side's certificate is "
                                         f"{kind.replace('_', ' ')} (rpcguard check-config says more)", cause)
    return Failed("tls_failed", f"the node closed the TLS session {when}: its rpcguard refused this certificate "
                                 "(see the node's log: CA, expiry or usage)", "tls_handshake_failed")


async def tls_probe(name: str, host: str, port: int, ctx: ssl.SSLContext, server_name: str, *,
                    timeout: float = 10.0, verdict_wait_s: float = VERDICT_WAIT_S,
                    own_warnings: Iterable[str] = ()) -> ProbeResult:
    """TCP + TLS handshake + the node's verdict on our certificate; no HELLO, no upstream slot."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    mode: str | None = None
    try:
        reader, writer = await open_tls(host, port, ctx, server_name, timeout)
        try:
            mode = node_mode(writer.get_extra_info("ssl_object"))
            check_usage(peer_identity(writer.get_extra_info("ssl_object")), "server")  # serverAuth EKU
            data = await read_tls(reader, verdict_wait_s)
            if not data:
                raise closed_on_us("right after the handshake", frozenset(own_warnings))
        except asyncio.TimeoutError:
            pass  # nothing to read: the node accepted us and waits for a HELLO
        finally:
            await close_tls(writer)
    except Failed as f:
        return ProbeResult(name, address, False, reason=f.reason, detail=f.detail, cause=f.cause)
    except Refusal as exc:  # the node's certificate lacks serverAuth
        return ProbeResult(name, address, False, reason=exc.reason, detail=exc.detail)
    return ProbeResult(name, address, True, node_mode=mode)
