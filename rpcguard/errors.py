"""Typed errors shared by every layer, each saying who is at fault.

Every refusal carries a stable, snake_case ``reason``: it is the ``reason`` label of the
refusal metrics and the ``reason`` field of the log line, so it never changes once released.
``detail`` is free text for people. ``party`` says who is at fault, like h11's
``LocalProtocolError``/``RemoteProtocolError``:

  * ``client``   the peer that connected to this listener (llama.cpp, or connect's side)
  * ``upstream`` what this listener forwards to (serve: ggml-rpc-server; connect: the node)
  * ``local``    rpcguard itself: its limits, its configuration, its own failure

How this works: ``party`` is resolved once, at construction, from (first that applies) the
``party=`` argument, the class's fixed party (``UpstreamRefusal``, ``LocalRefusal``: for code
that knows the side and has no better class), the reason's row of ``PARTY_OF_REASON``, the
class default (``FirewallRefusal``, ``ProtocolRefusal``, ``PolicyRefusal``: the client's frame,
identity or command), else ``local``. A ``ProtocolRefusal`` for a response rule (``response_*``)
or a ``PolicyRefusal`` for the upstream's version is the upstream's by its table row. A reason whose party depends on the
listener's role (a TLS handshake or certificate usage failure: the accepted client on one side,
the node on connect's outgoing side) is in the table with its accept-side party; the outgoing
side passes ``party=UPSTREAM``. tests/unit/test_errors.py checks that every reason of the
catalogue (rpcguard/reasons.py) resolves to a party.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

__all__ = [
    "RpcGuardError",
    "Refusal",
    "ProtocolRefusal",
    "FirewallRefusal",
    "PolicyRefusal",
    "UpstreamRefusal",
    "LocalRefusal",
    "ConfigError",
    "CLIENT",
    "UPSTREAM",
    "LOCAL",
    "PARTIES",
    "PARTY_OF_REASON",
    "party_of",
]

CLIENT = "client"
UPSTREAM = "upstream"
LOCAL = "local"
PARTIES = (CLIENT, UPSTREAM, LOCAL)

_C, _U, _L = CLIENT, UPSTREAM, LOCAL
# Reasons whose party is not their class default (or that are raised as a bare Refusal, or only
# recorded as a session's end). Firewall rule names are all the client's (FirewallRefusal).
PARTY_OF_REASON: Mapping[str, str] = {
    # session rules (protocol/session.py): the client's requests, the upstream's responses
    "first_frame_not_hello": _C, "hello_repeated": _C, "hello_bad_size": _C, "data_before_hello_reply": _C,
    "command_unknown": _C, "command_not_allowed": _C, "frame_size_invalid": _C, "request_too_large": _C,
    "response_unexpected": _U, "response_size_invalid": _U, "response_value_invalid": _U, "notice_invalid": _U, "node_ended": _U,
    # the version the upstream announced (or the client's HELLO era against it) is not accepted
    "version_not_accepted": _U,
    # timers (proxy/link.py): a client that does not speak, or stops mid-frame / stops reading
    "hello_timeout": _C, "idle_timeout": _C, "frame_timeout": _C, "idle_while_waiting": _C,
    "hold_while_waiting": _C,
    # one certificate or one host past its share of a listener (proxy/route.py, issue 21)
    "too_many_sessions_per_identity": _C, "too_many_sessions_per_source": _C,
    "too_many_pending_per_identity": _C, "too_many_pending_per_source": _C, "too_many_handshakes_per_source": _C,
    # the upstream side (proxy/link.py, proxy/route.py)
    "node_refused": _U, "node_unreachable": _U, "upstream_unavailable": _U, "upstream_busy": _U,
    "tls_failed": _U, "node_name_mismatch": _U, "upstream_closed": _U,
    "upstream_crashed": _U, "upstream_hung": _U,
    "upstream_cache_quota": _C,  # the session's server filled its identity's cache (upstream/pool.py)
    # TLS handshake / certificate of the accepted peer (pki/tls.py, pki/identity.py; outgoing side: upstream)
    "tls_handshake_timeout": _C, "tls_no_client_cert": _C, "tls_cert_expired": _C, "tls_unknown_ca": _C,
    "tls_protocol_version": _C, "tls_not_tls": _C, "tls_bad_certificate": _C, "tls_handshake_failed": _C,
    "identity_not_allowed": _C, "certificate_usage_invalid": _C,
    # revocation (pki/crl.py): a certificate on the CRL at the handshake or at a reload; the CRL itself out of date
    "tls_cert_revoked": _C, "certificate_revoked": _C, "tls_crl_expired": _L,
    "identity_quarantined": _C,  # its sessions crashed the server (upstream/pool.py)
    "client_closed_mid_frame": _C,
    # rpcguard's own limits and failures
    "refused": _L, "too_many_sessions": _L, "shutdown": _L, "session_lifetime": _L, "internal_error": _L,
}  # fmt: skip


def party_of(reason: str, default: str = LOCAL) -> str:
    """Who is at fault for ``reason`` (``PARTY_OF_REASON``), ``default`` if the table has no row."""
    return PARTY_OF_REASON.get(reason, default)


class RpcGuardError(Exception):
    """Base class of every error rpcguard raises on purpose; ``party`` is ``local`` unless said."""

    party: str = LOCAL


class Refusal(RpcGuardError):
    """A session (or a connection) is refused; ``reason`` is the stable label, ``party`` who caused it."""

    fixed_party: ClassVar[str | None] = None  # wins over the table
    default_party: ClassVar[str | None] = None  # when the table has no row for the reason

    def __init__(self, reason: str, detail: str = "", party: str | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.party = party or self.fixed_party or PARTY_OF_REASON.get(reason) or self.default_party or LOCAL


class ProtocolRefusal(Refusal):
    """A peer broke a framing or session rule of the ggml-rpc protocol (the client's requests
    unless the reason is a response rule)."""

    default_party = CLIENT


class FirewallRefusal(Refusal):
    """A client's frame failed a firewall check; ``reason`` names the rule."""

    default_party = CLIENT


class PolicyRefusal(Refusal):
    """Identity, version or command policy said no (the client, unless the table says otherwise)."""

    default_party = CLIENT


class UpstreamRefusal(Refusal):
    """The upstream failed or refused: unreachable, busy, closed, or broke the protocol."""

    fixed_party = UPSTREAM


class LocalRefusal(Refusal):
    """rpcguard refuses on its own account: its limits, shutdown, an internal error."""

    fixed_party = LOCAL


class ConfigError(RpcGuardError):
    """Invalid configuration; ``str()`` is one line naming the key path."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message
