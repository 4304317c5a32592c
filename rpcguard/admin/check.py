"""``rpcguard check``: is a node there, and what would a session meet?

How this works: ``probe_node`` opens ONE mutual-TLS connection, exactly as ``connect`` does for
llama.cpp, and plays a minimal llama.cpp on it: one HELLO, then DEVICE_COUNT when the version
has it (the ``Session`` injects it). Its requests and the node's replies go through a
``Session``, so the version policy and the node's refusal answers (0.0.N) are read exactly as
for a real client. The connection and its failures are pki/probe.py's (shared with the TLS-only
probe of connect's ``/readyz``): the connect itself -> ``node_unreachable``; the handshake, or the
node's verdict on our certificate that TLS 1.3 delivers on the first read -> ``tls_failed`` with
its cause or ``node_name_mismatch``; a bare close before the HELLO reply -> ``tls_failed`` (a
node's rpcguard answers every HELLO, refusals included); the node's 0.0.N answers -> their
reasons (``identity_not_allowed``, ``upstream_unavailable``, ``upstream_busy``,
``version_not_accepted``).

The HELLO form follows the tunnel's accepted versions: the >= 4.0.0 form (what llama.cpp sends
today) unless every accepted version is older. A second connection with the other form would
double every refusal in the node's log, so there is none.

The probe uses the probe context (pki/tls.py ``ALPN_PROBES``): the node's ``serve`` then knows the
connection is a probe, records it as ``result=probe`` (not a session, not a refusal), and
answers a probe's HELLO at once with "busy" (0.0.6) when another session holds its upstream,
instead of queueing it for ``queue_timeout_s``: a live node, whose server llama.cpp holds for
hours, reads "OK: TLS and identity accepted, server busy". On an idle node the probe's HELLO
takes the upstream for one round trip, as a llama.cpp would. The handshake also says whether
the node enforces every request check (``node_mode``). A node that negotiates no probe form (an
older serve) is probed as before, and its "busy" can take its queue timeout.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Iterable

from rpcguard.errors import Refusal
from rpcguard.protocol import encode
from rpcguard.protocol.session import Session, SessionPolicy
from rpcguard.protocol.versions import HELLO_CAPS_SINCE, LAST_BEFORE_CAPS, format_version
from rpcguard.pki.identity import check_usage
from rpcguard.pki.probe import Failed, ProbeResult, close_tls, closed_on_us, open_tls, read_tls
from rpcguard.pki.tls import is_probe, node_mode, peer_identity

__all__ = ["ProbeResult", "probe_node"]


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
            data = await read_tls(reader, timeout)
        except asyncio.TimeoutError:
            raise Failed("upstream_unavailable", f"the node did not answer HELLO within {timeout:g} s "
                                                  "(its upstream hangs, or another session holds it)") from None
        if not data:
            raise closed_on_us("before answering HELLO", own_warnings)
        session.server_data(memoryview(data))
        session.to_client.clear()


def _hello_frame(policy: SessionPolicy) -> bytes:
    """The HELLO llama.cpp of an accepted version sends: the >= 4.0.0 form unless all are older."""
    versions = policy.accepted_versions
    if versions and all(v < HELLO_CAPS_SINCE for v in versions):
        return encode.hello_request(LAST_BEFORE_CAPS)
    return encode.hello_request(HELLO_CAPS_SINCE)


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
        reader, writer = await open_tls(host, port, ctx, server_name, timeout)
        try:
            ssl_object = writer.get_extra_info("ssl_object")
            mode, probed = node_mode(ssl_object), is_probe(ssl_object)
            check_usage(peer_identity(ssl_object), "server")  # serverAuth EKU
            await _hello(reader, writer, session, _hello_frame(policy), hello_timeout or timeout,
                         frozenset(own_warnings))
        finally:
            await close_tls(writer)
    except Failed as f:
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


