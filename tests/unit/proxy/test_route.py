"""proxy/route.py: admission of a new session, the wait for the upstream slot, what a violation and a
finished session add to the listener (real certificates for serve's identities)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from rpcguard.errors import Refusal
from rpcguard.pki.identity import Acl, AllowList
from rpcguard.observe.metrics import Metrics
from rpcguard.protocol.lifecycle import Lifecycle
from rpcguard.protocol.side import SERVE
from rpcguard.protocol.session import Violation
from rpcguard.protocol.settings import Limits, Profile, SessionPolicy
from rpcguard.proxy.route import Route, UpstreamSlot
from tests.support.guard import Pki
from tests.support.waiting import loop_until
from tests.support.imports import imported


def route(role: str = "serve", **kw) -> Route:
    return Route(role=role, name="gpu0", upstream_host="127.0.0.1", upstream_port=50052,
                 traffic=Metrics().listener(role, "gpu0", upstream="x"), **kw)


class Peer:
    """The part of an SSLObject admission reads: the peer's certificate."""

    def __init__(self, pem: Path | None) -> None:
        cert = x509.load_pem_x509_certificate(pem.read_bytes()) if pem is not None else None
        self.der = cert.public_bytes(Encoding.DER) if cert is not None else None
        # what getpeercert() answers: OpenSSL's reading of the same certificate
        self.info = ssl._ssl._test_decode_cert(str(pem)) if pem is not None else None  # type: ignore[attr-defined]

    def getpeercert(self, binary_form: bool = False) -> bytes | dict | None:
        return self.der if binary_form else self.info

    def selected_alpn_protocol(self) -> str | None:
        return None


class FakeLink:
    """What admission reads of the other links: their lifecycle's profile, admission, identity,
    source address, state and early refusal."""

    def __init__(self, profile: Profile, admitted: bool, identity: str = "", source: str = "10.0.0.1",
                 state: str = "active", refusal: Refusal | None = None) -> None:
        self.lc = SimpleNamespace(profile=profile, admitted=admitted, identity=identity, source=source,
                                  state=state, refusal=refusal)


def link(profile: Profile, admitted: bool = True, **kw) -> FakeLink:
    return FakeLink(profile, admitted, **kw)


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
        await loop_until(lambda: r.traffic.queue_depth == 1, "the third session queued")
        r.slot.release(1)  # type: ignore[union-attr]
        assert await waiting is None and r.traffic.queue_depth == 0

    asyncio.run(main())


def provider(isolation: str) -> SimpleNamespace:
    return SimpleNamespace(settings=SimpleNamespace(isolation=isolation))


def test_one_server_serves_one_session_and_the_waiting_one_is_told_who_holds_it(caplog):
    # issue 31: a waiting client gets 'node busy', who holds it and since when (log and refusal).
    r = route(slot=UpstreamSlot())

    async def main() -> None:
        assert await r.take_slot(Limits(), 1, "CN=alice") is None
        with caplog.at_level("INFO", logger="rpcguard.relay"):
            refused = await r.take_slot(Limits(queue_timeout_s=0.05), 2, "CN=bob")
        assert isinstance(refused, Refusal) and refused.reason == "upstream_busy"
        assert "node busy: still held by session 1 (CN=alice) for 0 s after 0.05 s in the queue" == refused.detail
        assert "session 2 identity=CN=bob waits for the upstream of listener gpu0: node busy, held by session 1 " \
               "(CN=alice)" in caplog.text
        r.slot.release(2)  # type: ignore[union-attr]  # not a holder: nothing happens
        assert r.slot.busy and r.slot.holders.keys() == {1}  # type: ignore[union-attr]

    asyncio.run(main())


@pytest.mark.parametrize("isolation, at_once", [("session", 3), ("identity", 3), ("shared", 1)])
def test_a_server_process_per_session_serves_sessions_side_by_side(isolation, at_once):
    # issue 31: under serve -- SERVER each session has its own process: nobody waits for one
    # (up to max_upstream_sessions), so nothing ends a session for being idle while others wait.
    r = route(slot=UpstreamSlot(), provider=provider(isolation),
              default=Profile(limits=Limits(max_upstream_sessions=3, queue_timeout_s=5)))

    async def main() -> None:
        limits = r.default.limits
        taken = [asyncio.ensure_future(r.take_slot(limits, n, f"CN=t{n}")) for n in range(1, 6)]
        await loop_until(lambda: sum(t.done() for t in taken) == at_once and r.slot.waiting == 5 - at_once,  # type: ignore[union-attr]
                         "the places taken and the rest waiting")
        assert [t.done() for t in taken] == [True] * at_once + [False] * (5 - at_once)
        assert r.slot.waiting == 5 - at_once  # type: ignore[union-attr]
        # one waiting session (two for a single place) charges that many of the longest holders
        charged = [n for n in range(1, 6) if r.slot.waiting_for(n)]  # type: ignore[union-attr]
        assert charged == ([1, 2] if at_once == 3 else [1])
        r.slot.release(1)  # type: ignore[union-attr]  # first come, first served
        await loop_until(lambda: taken[at_once].done(), "the next waiter served")
        assert taken[at_once].done() and r.slot.waiting == 4 - at_once  # type: ignore[union-attr]
        for n, t in enumerate(taken, 1):
            assert await t is None  # each in turn, as places come free
            r.slot.release(n)  # type: ignore[union-attr]
        assert not r.slot.busy and not r.slot.waiting  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_waiter_that_timed_out_does_not_hold_up_the_next_session():
    r = route(slot=UpstreamSlot())

    async def main() -> None:
        assert await r.take_slot(Limits(), 1) is None
        late = await r.take_slot(Limits(queue_timeout_s=0.01), 2)
        assert isinstance(late, Refusal) and late.reason == "upstream_busy"
        r.slot.release(1)  # type: ignore[union-attr]
        assert await asyncio.wait_for(r.take_slot(Limits(queue_timeout_s=5), 3), 1) is None  # at once: the place is free
        assert r.slot.holders.keys() == {3}  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_waiter_that_goes_away_gives_its_place_back():
    r = route(slot=UpstreamSlot())

    async def main() -> None:
        assert await r.take_slot(Limits(), 1) is None
        gone = asyncio.ensure_future(r.take_slot(Limits(queue_timeout_s=5), 2))
        after = asyncio.ensure_future(r.take_slot(Limits(queue_timeout_s=5), 3))
        await loop_until(lambda: r.slot.waiting == 2, "both in line")  # type: ignore[union-attr]
        gone.cancel()  # 2 leaves the line (its link closed) ...
        await loop_until(lambda: gone.done() and r.slot.waiting == 1, "2 out of the line")  # type: ignore[union-attr]
        r.slot.release(1)  # type: ignore[union-attr]  # ... so the place goes to 3
        assert await after is None and r.slot.holders.keys() == {3}  # type: ignore[union-attr]
        assert gone.cancelled() and not r.slot.waiting  # type: ignore[union-attr]
        r.slot.release(3)  # type: ignore[union-attr]
        assert r.slot.taken == 0  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_violation_and_a_finished_session_are_folded_into_the_listener():
    r = route()
    r.violation(7, "CN=client1", ("range_out_of_buffer", "monitor", Violation("range_out_of_buffer", "d", "SET_TENSOR"),
                                  "SET_TENSOR"))
    assert r.traffic.firewall_violations[("range_out_of_buffer", "monitor")] == 1
    lc = Lifecycle(link_id=7, side=SERVE, listener="gpu0", upstream="x", default=r.default, facts=r.facts,
                   clock=lambda: 0.0)
    lc.result, lc.reason = "refused", "identity_not_allowed"
    me = link(r.default)
    r.links.add(me)
    r.traffic.session_started(lc.stats)
    r.session_over(me, lc)
    assert me not in r.links and not r.traffic.live
    assert r.traffic.refusals["identity_not_allowed"] == 1 and r.traffic.sessions_total["refused"] == 1


CLIENT1 = "CN=client1"


@pytest.mark.parametrize("others, reason", [
    # (identity, source, state) of the admitted links already there; limits below
    ([(CLIENT1, "10.0.0.9", "active")] * 3, "too_many_sessions_per_identity"),
    ([("CN=other", "10.0.0.1", "active")] * 4, "too_many_sessions_per_source"),
    ([(CLIENT1, "10.0.0.9", "await_hello")] * 2, "too_many_pending_per_identity"),
    ([("CN=other", "10.0.0.1", "await_hello")] * 2, "too_many_pending_per_source"),
])
def test_one_identity_or_one_host_cannot_take_the_listener(pki, others, reason):
    # issue 21: 70 silent mTLS connections of one certificate took every max_sessions slot.
    caps = Limits(max_sessions_per_identity=3, max_sessions_per_source=4, max_pending_per_identity=2,
                  max_pending_per_source=2)
    r = route(default=Profile("default", SessionPolicy(), caps), allow=AllowList((Acl(cns=("client1",)),)))
    me = link(r.default, source="10.0.0.1", state="handshake")
    r.links.update({me, *(link(r.default, identity=i, source=s, state=st) for i, s, st in others)})
    got = r.admit(me, Peer(Path(pki.path(pki.client))))  # type: ignore[arg-type]
    assert got.refusal is not None and got.refusal.reason == reason and got.identity_refused
    # one fewer, and the same client is admitted; a link refused already holds nothing
    r.links.remove(next(x for x in r.links if x is not me))
    r.links.add(link(r.default, identity=CLIENT1, source="10.0.0.1", refusal=Refusal("too_many_sessions", "x")))
    assert r.admit(me, Peer(Path(pki.path(pki.client)))).refusal is None  # type: ignore[arg-type]


def test_links_refused_already_do_not_count_against_max_sessions():
    one = Profile("default", SessionPolicy(), Limits(max_sessions=1))
    r = route("connect", default=one)
    me = link(one)
    r.links.update({me, link(one, refusal=Refusal("too_many_sessions", "x"))})
    assert r.admit(me, None).refusal is None


def test_the_peer_caps_are_off_with_zero_and_do_not_apply_to_connect(pki):
    off = Limits(max_sessions_per_identity=0, max_sessions_per_source=0, max_pending_per_identity=0,
                 max_pending_per_source=0)
    r = route(default=Profile("default", SessionPolicy(), off), allow=AllowList((Acl(cns=("client1",)),)))
    me = link(r.default, source="10.0.0.1", state="handshake")
    r.links.update({me, *(link(r.default, identity=CLIENT1, source="10.0.0.1", state="await_hello")
                          for _ in range(60))})
    assert r.admit(me, Peer(Path(pki.path(pki.client)))).refusal is None  # type: ignore[arg-type]
    c = route("connect")
    mine = link(c.default, source="127.0.0.1")
    c.links.update({mine, *(link(c.default, source="127.0.0.1", state="await_hello") for _ in range(20))})
    assert c.admit(mine, None).refusal is None


def test_the_identity_caps_are_the_profile_s(pki):
    tenant = Profile("tenant", SessionPolicy(), Limits(max_pending_per_identity=1))
    r = route(allow=AllowList((Acl(cns=("client1",), profile="tenant"),)), profiles=MappingProxyType({"tenant": tenant}))
    me = link(r.default, state="handshake")
    r.links.update({me, link(tenant, identity=CLIENT1, source="10.0.0.7", state="await_hello")})
    got = r.admit(me, Peer(Path(pki.path(pki.client))))  # type: ignore[arg-type]
    assert got.refusal is not None and got.refusal.reason == "too_many_pending_per_identity"
    assert got.refusal.detail == "more than 1 connections of this identity waiting for their HELLO"


def test_a_route_reads_other_links_through_protocols():
    """Route needs no concrete Link or Lifecycle: ``RoutedLink``, ``LinkView`` and ``EndedSession``."""
    names = imported("rpcguard/proxy/route.py")
    assert "rpcguard.protocol.lifecycle" not in names and "rpcguard.proxy.link" not in names
