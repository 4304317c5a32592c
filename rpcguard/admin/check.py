"""``rpcguard check`` and connect's ``/readyz``: is a node there, and what would a session meet?

How this works: ``probe_node`` opens ONE mutual-TLS connection, exactly as ``connect`` does for
llama.cpp, and plays a minimal llama.cpp on it: one HELLO, then DEVICE_COUNT when the version
has it (the ``Session`` injects it). Its requests and the node's replies go through a
``Session``, so the version policy and the node's refusal answers (0.0.N) are read exactly as
for a real client. Failures are classified like the data path (``link.Link``): the connect
itself -> ``node_unreachable``; the handshake, or the node's verdict on our certificate that
TLS 1.3 delivers on the first read -> ``tls_failed`` with its cause (``tls_cert_expired``,
``tls_unknown_ca``, ``tls_bad_certificate`` ...) or ``node_name_mismatch``; a bare close before
the HELLO reply -> ``tls_failed`` (a node's rpcguard answers every HELLO, refusals included);
the node's 0.0.N answers -> their reasons (``identity_not_allowed``, ``upstream_unavailable``,
``upstream_busy``, ``version_not_accepted``).

The HELLO form follows the tunnel's accepted versions: the >= 4.0.0 form (what llama.cpp sends
today) unless every accepted version is older. A second connection with the other form would
double every refusal in the node's log, so there is none.

Both probes use the probe context (pki/tls.py ``ALPN_PROBES``): the node's ``serve`` then knows the
connection is a probe, records it as ``result=probe`` (not a session, not a refusal), and
answers a probe's HELLO at once with "busy" (0.0.6) when another session holds its upstream,
instead of queueing it for ``queue_timeout_s``: a live node, whose server llama.cpp holds for
hours, reads "OK: TLS and identity accepted, server busy". On an idle node the probe's HELLO
takes the upstream for one round trip, as a llama.cpp would. The handshake also says whether
the node enforces every request check (``node_mode``). A node that negotiates no probe form (an
older serve) is probed as before, and its "busy" can take its queue timeout.

``tls_probe`` is the cheap variant for connect's ``/readyz``: TCP connect and TLS handshake,
then a short wait for the node's verdict on the certificate, and close. It sends no HELLO, so
the node's ``serve`` never takes its single upstream slot for it (it takes it at HELLO).

A port that accepts TCP and then closes or resets it during the TLS handshake, or answers it
with something that is not TLS, is ``tls_failed`` with cause ``tls_not_tls``: a plain
ggml-rpc-server or an HTTP port, not an unreachable node.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from dataclasses import dataclass
from typing import Iterable

from rpcguard.errors import Refusal
from rpcguard.protocol import encode
from rpcguard.protocol.session import Session, SessionPolicy
from rpcguard.protocol.versions import format_version
from rpcguard.pki.identity import check_usage
from rpcguard.pki.tls import classify_handshake_error, is_probe, node_mode, peer_identity

__all__ = ["ProbeResult", "probe_node", "tls_probe", "VERDICT_WAIT_S"]

# After a TLS 1.3 handshake the server's verdict on our certificate arrives within one round
# trip (an alert) or not at all (accepted): tls_probe waits this long for it.
VERDICT_WAIT_S = 0.5
_READ_BYTES = 65536
_NEW_HELLO = (4, 0, 0)
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


class _Failed(Exception):
    def __init__(self, reason: str, detail: str, cause: str | None = None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.cause = reason, detail, cause


def _tls_failure(exc: BaseException, when: str) -> _Failed:
    """A handshake error, or the first read's error after it, as the data path names it."""
    cause = classify_handshake_error(exc)
    if cause == "node_name_mismatch":
        return _Failed(cause, f"the node's certificate does not name it: {exc}")
    if cause == "tls_not_tls":
        return _Failed("tls_failed", f"{when}: the port does not speak TLS (a plain ggml-rpc-server or an "
                                     f"HTTP port?): {exc}", cause)
    return _Failed("tls_failed", f"{when}: {exc}", cause)


async def _open(host: str, port: int, ctx: ssl.SSLContext, server_name: str, timeout: float):
    try:
        return await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname=server_name,
                                    ssl_handshake_timeout=timeout), timeout)
    except ssl.SSLError as exc:  # CertificateError is an SSLError too
        raise _tls_failure(exc, "TLS handshake with the node failed") from None
    except (OSError, asyncio.TimeoutError) as exc:
        inner = exc.__cause__ or exc.__context__
        if isinstance(inner, ssl.SSLError):
            raise _tls_failure(inner, "TLS handshake with the node failed") from None
        if isinstance(exc, ConnectionError) and not isinstance(exc, ConnectionRefusedError):
            # TCP was accepted, then closed under our ClientHello: something answers there, not TLS
            raise _Failed("tls_failed", "the port accepted TCP and closed it during the TLS handshake "
                                        f"({type(exc).__name__}): it does not speak TLS (a plain ggml-rpc-server "
                                        "or an HTTP port?); give the node's rpcguard serve address",
                          "tls_not_tls") from None
        what = "timeout" if isinstance(exc, asyncio.TimeoutError) else str(exc) or type(exc).__name__
        if isinstance(exc, socket.gaierror):  # the first mistake of a quick start: a name without DNS
            what += (f" ({host!r} does not resolve here: give --server IP:PORT --server-name {server_name} "
                     "(server / server_name in a config), the name in the node's certificate)")
        raise _Failed("node_unreachable", f"cannot reach the node: {what}") from None


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (OSError, ssl.SSLError, asyncio.TimeoutError):
        writer.transport.abort()


async def _read(reader: asyncio.StreamReader, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(_READ_BYTES), timeout)
    except ssl.SSLError as exc:
        raise _tls_failure(exc, "the node refused the TLS session") from None
    except asyncio.TimeoutError:
        raise  # an OSError too since Python 3.11: the callers tell silence from a close
    except (ConnectionError, OSError) as exc:
        inner = exc.__cause__ or exc.__context__
        if isinstance(inner, ssl.SSLError):
            raise _tls_failure(inner, "the node refused the TLS session") from None
        return b""  # reset: the same as a close for what it tells


def _closed_on_us(when: str, own_warnings: frozenset[str]) -> _Failed:
    """The node closed the TLS session without a word: it refused our certificate."""
    for kind, cause in _CAUSE_OF_OWN_WARNING:
        if kind in own_warnings:
            return _Failed("tls_failed", f"the node closed the TLS session {when}; this side's certificate is "
                                         f"{kind.replace('_', ' ')} (rpcguard check-config says more)", cause)
    return _Failed("tls_failed", f"the node closed the TLS session {when}: its rpcguard refused this certificate "
                                 "(see the node's log: CA, expiry or usage)", "tls_handshake_failed")


async def _hello(reader, writer, session: Session, hello: bytes, timeout: float,
                 own_warnings: frozenset[str]) -> None:
    session.client_data(memoryview(hello))
    while True:
        if session.to_server:
            writer.write(b"".join(bytes(c) for c in session.to_server))
            session.to_server.clear()
        if session.idle:
            return
        try:
            data = await _read(reader, timeout)
        except asyncio.TimeoutError:
            raise _Failed("upstream_unavailable", f"the node did not answer HELLO within {timeout:g} s "
                                                  "(its upstream hangs, or another session holds it)") from None
        if not data:
            raise _closed_on_us("before answering HELLO", own_warnings)
        session.server_data(memoryview(data))
        session.to_client.clear()


def _hello_frame(policy: SessionPolicy) -> bytes:
    """The HELLO llama.cpp of an accepted version sends: the >= 4.0.0 form unless all are older."""
    versions = policy.accepted_versions
    if versions and all(v < _NEW_HELLO for v in versions):
        return encode.hello_request((3, 6, 1))
    return encode.hello_request((7, 0, 0))


async def probe_node(
    name: str,
    host: str,
    port: int,
    ctx: ssl.SSLContext,
    server_name: str,
    *,
    policy: SessionPolicy | None = None,
    timeout: float = 10.0,
    own_warnings: Iterable[str] = (),
    hello_timeout: float | None = None,
) -> ProbeResult:
    """Probe one node over ONE connection; never raises for network or protocol trouble.

    ``timeout`` bounds the connect and the handshake; ``hello_timeout`` (default ``timeout``) the
    wait for the HELLO reply, which a node in queue mode sends only once its upstream is free.
    ``own_warnings``: kinds of ``preflight.certificate_warnings`` for this side's certificate.
    """
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    policy = policy or SessionPolicy()
    session = Session(policy)
    mode: str | None = None
    probed = False  # the node knows this is a probe: it answers "busy" at once, never queues it
    try:
        reader, writer = await _open(host, port, ctx, server_name, timeout)
        try:
            ssl_object = writer.get_extra_info("ssl_object")
            mode, probed = node_mode(ssl_object), is_probe(ssl_object)
            check_usage(peer_identity(ssl_object), "server")  # serverAuth EKU
            await _hello(reader, writer, session, _hello_frame(policy), hello_timeout or timeout,
                         frozenset(own_warnings))
        finally:
            await _close(writer)
    except _Failed as f:
        return ProbeResult(name, address, False, reason=f.reason, detail=f.detail, cause=f.cause, node_mode=mode)
    except Refusal as exc:  # our own session policy (version not accepted, bad reply)
        return ProbeResult(name, address, False, reason=exc.reason, detail=exc.detail, node_mode=mode)
    if session.node_refusal == "upstream_busy" and probed:
        return ProbeResult(name, address, True, busy=True, node_mode=mode)
    if session.node_refusal is not None:
        return ProbeResult(name, address, False, reason=session.node_refusal,
                           detail="refused by the node's rpcguard (its log says why)", node_mode=mode)
    count = session.state.upstream.device_count
    return ProbeResult(name, address, True, version=format_version(session.version) if session.version else None,
                       devices=count or 1, node_mode=mode)


async def tls_probe(name: str, host: str, port: int, ctx: ssl.SSLContext, server_name: str, *,
                    timeout: float = 10.0, verdict_wait_s: float = VERDICT_WAIT_S,
                    own_warnings: Iterable[str] = ()) -> ProbeResult:
    """TCP + TLS handshake + the node's verdict on our certificate; no HELLO, no upstream slot."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    mode: str | None = None
    try:
        reader, writer = await _open(host, port, ctx, server_name, timeout)
        try:
            mode = node_mode(writer.get_extra_info("ssl_object"))
            check_usage(peer_identity(writer.get_extra_info("ssl_object")), "server")  # serverAuth EKU
            data = await _read(reader, verdict_wait_s)
            if not data:
                raise _closed_on_us("right after the handshake", frozenset(own_warnings))
        except asyncio.TimeoutError:
            pass  # nothing to read: the node accepted us and waits for a HELLO
        finally:
            await _close(writer)
    except _Failed as f:
        return ProbeResult(name, address, False, reason=f.reason, detail=f.detail, cause=f.cause)
    except Refusal as exc:  # the node's certificate lacks serverAuth
        return ProbeResult(name, address, False, reason=exc.reason, detail=exc.detail)
    return ProbeResult(name, address, True, node_mode=mode)
