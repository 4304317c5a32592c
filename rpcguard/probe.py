"""``rpcguard check``: TLS + HELLO (+ DEVICE_COUNT) to a node, through the same session rules.

How this works: the probe opens the same mutual-TLS connection ``connect`` would, then plays
a minimal llama.cpp: HELLO (the >= 4.0.0 form first; a pre-4.0.0 server hangs up on it, so
the 0-byte form is tried next), then DEVICE_COUNT when the version has it. Its own requests
and the node's replies go through a ``Session`` so the version policy and the refusal
answers (0.0.N) are interpreted exactly as they would be for a real client.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from rpcguard.errors import Refusal
from rpcguard.protocol import encode
from rpcguard.protocol.session import Session, SessionPolicy
from rpcguard.protocol.versions import format_version
from rpcguard.identity import check_usage
from rpcguard.tls import classify_handshake_error, peer_identity

__all__ = ["ProbeResult", "probe_node"]


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of one probe: ``ok`` with version and device count, or the refusal reason."""

    name: str
    address: str
    ok: bool
    version: str | None = None
    devices: int | None = None
    reason: str | None = None
    detail: str = ""

    def line(self) -> str:
        if self.ok:
            return f"OK      {self.name} {self.address}: protocol {self.version}, {self.devices} device(s)"
        return f"REFUSED {self.name} {self.address}: {self.reason} - {self.detail}"


async def _exchange(reader, writer, session: Session, frame: bytes, timeout: float) -> None:
    session.client_data(memoryview(frame))
    writer.write(b"".join(bytes(c) for c in session.to_server))
    session.to_server.clear()
    while not session.idle:
        data = await asyncio.wait_for(reader.read(65536), timeout)
        if not data:
            raise ConnectionError("node closed the connection")
        session.server_data(memoryview(data))
        session.to_client.clear()
        if session.to_server:  # the session's own DEVICE_COUNT query after HELLO
            writer.write(b"".join(bytes(c) for c in session.to_server))
            session.to_server.clear()


async def _try(host, port, ctx, server_name, hello: bytes, policy, timeout) -> Session:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=ctx, server_hostname=server_name), timeout
    )
    try:
        check_usage(peer_identity(writer.get_extra_info("ssl_object")), "server")  # serverAuth EKU
        session = Session(policy)
        await _exchange(reader, writer, session, hello, timeout)
        return session
    finally:
        writer.close()


async def probe_node(
    name: str,
    host: str,
    port: int,
    ctx: ssl.SSLContext,
    server_name: str,
    *,
    policy: SessionPolicy | None = None,
    timeout: float = 10.0,
) -> ProbeResult:
    """Probe one node; never raises for network or protocol trouble, the result says why."""
    address = f"{host}:{port}"
    policy = policy or SessionPolicy()
    session = None
    try:
        for hello in (encode.hello_request((7, 0, 0)), encode.hello_request((3, 6, 1))):
            try:
                session = await _try(host, port, ctx, server_name, hello, policy, timeout)
                break
            except ConnectionError:
                continue  # a server of the other HELLO era hangs up: try the other form
        if session is None:
            return ProbeResult(name, address, False, reason="upstream_unavailable",
                               detail="the node closed the connection at HELLO")
    except ssl.SSLError as exc:
        return ProbeResult(name, address, False, reason=classify_handshake_error(exc), detail=str(exc))
    except ssl.CertificateError as exc:
        return ProbeResult(name, address, False, reason="node_name_mismatch", detail=str(exc))
    except Refusal as exc:
        return ProbeResult(name, address, False, reason=exc.reason, detail=exc.detail)
    except (OSError, asyncio.TimeoutError) as exc:
        return ProbeResult(name, address, False, reason="node_unreachable", detail=str(exc) or "timeout")
    if session.node_refusal is not None:
        return ProbeResult(name, address, False, reason=session.node_refusal, detail="refused by the node's rpcguard")
    count = session.state.upstream.device_count
    return ProbeResult(name, address, True, version=format_version(session.version), devices=count if count else 1)

