"""route.py: admission of a new session, the wait for the upstream slot, what a violation and a
finished session add to the listener (real certificates for serve's identities)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from rpcguard.errors import Refusal
from rpcguard.identity import Acl, AllowList
from rpcguard.metrics import Metrics
from rpcguard.protocol.lifecycle import Lifecycle
from rpcguard.protocol.session import Violation
from rpcguard.protocol.settings import Limits, Profile, SessionPolicy
from rpcguard.route import Route, UpstreamSlot
from tests.support.guard import Pki


def route(role: str = "serve", **kw) -> Route:
    return Route(role=role, name="gpu0", upstream_host="127.0.0.1", upstream_port=50052,
                 traffic=Metrics().listener(role, "gpu0", upstream="x"), **kw)


class Peer:
    """The part of an SSLObject admission reads: the peer's certificate."""

    def __init__(self, pem: Path | None) -> None:
        cert = x509.load_pem_x509_certificate(pem.read_bytes()) if pem is not None else None
        self.der = cert.public_bytes(Encoding.DER) if cert is not None else None

    def getpeercert(self, binary_form: bool = False) -> bytes | None:
        return self.der

    def selected_alpn_protocol(self) -> str | None:
        return None


class FakeLink:
    """What admission reads of the other links: their lifecycle's profile and admission."""

    def __init__(self, profile: Profile, admitted: bool) -> None:
        self.lc = SimpleNamespace(profile=profile, admitted=admitted)


def link(profile: Profile, admitted: bool = True) -> FakeLink:
    return FakeLink(profile, admitted)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def test_serve_admits_an_allowed_client_under_the_profile_its_entry_names(pki):
    gpu = Profile("gpu", SessionPolicy(), Limits())
    r = route(allow=AllowList((Acl(cns=("client1",), profile="gpu"),)), profiles=MappingProxyType({"gpu": gpu}))
    got = r.admit(link(gpu), Peer(Path(pki.path(pki.client))))  # type: ignore[arg-type]
    assert got.refusal is None and got.profile is gpu and "client1" in got.identity
    assert r.traffic.profile_sessions == {"gpu": 1}


@pytest.mark.parametrize("who, allow, reason", [
    ("client1", ("someone-else",), "identity_not_allowed"),
    ("node1", ("node1",), "certificate_usage_invalid"),  # a server certificate is no client's, allow-list or not
    (None, ("client1",), "tls_no_client_cert"),
])
def test_serve_refuses_an_identity_and_says_it_is_about_who_the_client_is(pki, who, allow, reason):
    r = route(allow=AllowList((Acl(cns=allow),)))
    got = r.admit(link(r.default), Peer(Path(pki.path(who)) if who else None))  # type: ignore[arg-type]
    assert got.refusal is not None and got.refusal.reason == reason and got.identity_refused
    assert got.profile is r.default


def test_session_limits_count_admitted_links_only_and_a_shutdown_refuses():
    one = Profile("default", SessionPolicy(), Limits(max_sessions=1))
    r = route("connect", default=one)
    me = link(one)
    r.links.update({me, link(one, admitted=False)})  # another socket still in its TLS handshake
    assert r.admit(me, None).refusal is None
    r.links.add(link(one))  # one admitted session already runs
    got = r.admit(me, None)
    assert got.refusal is not None and got.refusal.reason == "too_many_sessions" and not got.identity_refused
    r.links.clear()
    r.draining = True
    assert r.admit(me, None).refusal.reason == "shutdown"  # type: ignore[union-attr]


def test_take_slot_refuses_when_busy_in_refuse_mode_and_keeps_the_queue_depth_true():
    r = route(slot=UpstreamSlot())

    async def main() -> None:
        assert await r.take_slot(Limits(upstream_busy="refuse"), 1) is None
        refused = await r.take_slot(Limits(upstream_busy="refuse"), 2)
        assert isinstance(refused, Refusal) and refused.reason == "upstream_busy"
        assert r.traffic.queue_depth == 0
        waiting = asyncio.ensure_future(r.take_slot(Limits(upstream_busy="queue", queue_timeout_s=5), 3))
        await asyncio.sleep(0.05)
        assert r.traffic.queue_depth == 1
        r.slot.release()  # type: ignore[union-attr]
        assert await waiting is None and r.traffic.queue_depth == 0

    asyncio.run(main())


def test_a_violation_and_a_finished_session_are_folded_into_the_listener():
    r = route()
    r.violation(7, "CN=client1", ("range_out_of_buffer", "monitor", Violation("range_out_of_buffer", "d", "SET_TENSOR"),
                                  "SET_TENSOR"))
    assert r.traffic.firewall_violations[("range_out_of_buffer", "monitor")] == 1
    lc = Lifecycle(link_id=7, role="serve", listener="gpu0", upstream="x", default=r.default, facts=r.facts,
                   clock=lambda: 0.0, uses_slot=False)
    lc.result, lc.reason = "refused", "identity_not_allowed"
    me = link(r.default)
    r.links.add(me)
    r.traffic.session_started(lc.stats)
    r.session_over(me, lc)
    assert me not in r.links and not r.traffic.live
    assert r.traffic.refusals["identity_not_allowed"] == 1 and r.traffic.sessions_total["refused"] == 1
