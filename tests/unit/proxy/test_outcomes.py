"""rpcguard.proxy.outcomes: a finished session's record into the metrics and the node news of /readyz."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from rpcguard.observe.metrics import Metrics
from rpcguard.proxy.outcomes import Outcomes, upstream_outcome
from rpcguard.proxy.readiness import NodeChecks


def test_what_a_session_tells_about_its_upstream():
    assert upstream_outcome({"reason": "upstream_unavailable"}) is False
    assert upstream_outcome({"reason": "tls_failed", "version": "7.0.0"}) is False
    assert upstream_outcome({"reason": "node_refused"}) is True  # the node's rpcguard answered
    assert upstream_outcome({"reason": "", "version": "7.0.0"}) is True
    assert upstream_outcome({"reason": "identity_not_allowed"}) is None  # before the upstream: says nothing


def test_refusals_listed_and_the_gauge_set():
    metrics = Metrics(CollectorRegistry())
    out = Outcomes(metrics, None)
    out.session_ended({"role": "serve", "listener": "a", "result": "refused", "reason": "upstream_unavailable",
                       "peer": "127.0.0.1", "identity": "cn=c", "detail": "down"})
    labels = {"role": "serve", "listener": "a"}
    assert metrics.registry.get_sample_value("rpcguard_upstream_up", labels) == 0
    (last,) = metrics.recent_refusals  # what /refusals lists (the counter is the route's, at the session's end)
    assert {k: last[k] for k in ("listener", "identity", "reason", "detail")} == {
        "listener": "a", "identity": "cn=c", "reason": "upstream_unavailable", "detail": "down"}
    out.session_ended({"role": "serve", "listener": "a", "result": "ok", "reason": "", "version": "7.0.0"})
    assert metrics.registry.get_sample_value("rpcguard_upstream_up", labels) == 1


def test_connect_outcomes_reach_the_node_checks():
    nodes = NodeChecks(lambda: None, lambda: 1.0, list)  # type: ignore[arg-type,return-value]
    Outcomes(Metrics(CollectorRegistry()), nodes).session_ended(
        {"role": "connect", "listener": "t", "result": "refused", "reason": "node_unreachable", "detail": "timeout"})
    assert nodes._seen["t"][1:] == (False, "node_unreachable: timeout")
