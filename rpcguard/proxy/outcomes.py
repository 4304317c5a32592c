"""What the runtime reports: a finished session's outcome, and the certificates in use, into the metrics.

How this works: every route calls ``Outcomes.session_ended`` with a session's audit record (the
lifecycle's ``end`` action, protocol/endings.py). The record says whether the upstream answered
(``rpcguard_upstream_up``), which refusal to count (``rpcguard_refusals_total`` and /refusals) and,
on connect, what the node did (the news ``NodeChecks`` gives /readyz before it probes again).
``certificates`` puts the expiry of the material in use and the start-up warnings about it (the
checks of ``rpcguard check-config``: expired, soon, untrusted) into gauges and the log, at start
and after every reload.
"""

from __future__ import annotations

import logging

from rpcguard.observe.metrics import Metrics
from rpcguard.pki.preflight import WARNING_KINDS, CertWarning, certificate_warnings
from rpcguard.proxy.material import TlsMaterial
from rpcguard.proxy.readiness import NodeChecks

__all__ = ["Outcomes", "certificates", "upstream_outcome"]

log = logging.getLogger("rpcguard.server")

# Session-end reasons that say the upstream (serve: ggml-rpc-server; connect: the node) is down.
_UPSTREAM_DOWN = frozenset({"upstream_unavailable", "node_unreachable", "tls_failed", "node_name_mismatch"})
_REFUSAL_FIELDS = ("role", "listener", "peer", "identity", "reason", "command", "detail")


class Outcomes:
    """Finished sessions into the metrics (and, on connect, into what /readyz knows of the nodes)."""

    def __init__(self, metrics: Metrics, nodes: NodeChecks | None) -> None:
        self.metrics, self.nodes = metrics, nodes

    def session_ended(self, record: dict) -> None:
        if self.nodes is not None and record.get("listener"):
            self.nodes.note(record)
        up = upstream_outcome(record)
        if up is not None:
            self.metrics.listener(record["role"], record["listener"]).upstream_up = up
        if record.get("result") == "refused":
            self.metrics.note_refusal(**{k: record.get(k) for k in _REFUSAL_FIELDS})


def upstream_outcome(record: dict) -> bool | None:
    """What a finished session tells about its upstream: True up, False down, None nothing."""
    if record.get("reason") in _UPSTREAM_DOWN:
        return False
    if record.get("reason") == "node_refused":  # the node's rpcguard answered
        return True
    if record.get("version"):  # the upstream answered HELLO
        return True
    return None


def certificates(tls: TlsMaterial, metrics: Metrics, role: str) -> list[CertWarning]:
    """The expiry gauges and warnings of the material in use; returns the warnings."""
    for certificate, when in tls.loaded_expiry.items():
        metrics.set_certificate_expiry(role, certificate, when, getattr(tls.tls, certificate))
    warnings = certificate_warnings(tls.tls.cert, tls.tls.ca)
    kinds = {w.kind for w in warnings}
    for kind in WARNING_KINDS:
        metrics.cert_warnings[(role, kind)] = float(kind in kinds)
    for w in warnings:
        log.warning("certificate %s: %s", w.kind, w.message)
    return warnings
