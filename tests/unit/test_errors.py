"""rpcguard/errors.py: every refusal says who is at fault (client, upstream, local)."""

from __future__ import annotations

import pytest

from rpcguard import reasons
from rpcguard.errors import (
    CLIENT,
    LOCAL,
    PARTIES,
    PARTY_OF_REASON,
    UPSTREAM,
    ConfigError,
    FirewallRefusal,
    LocalRefusal,
    PolicyRefusal,
    ProtocolRefusal,
    Refusal,
    RpcGuardError,
    UpstreamRefusal,
    party_of,
)
from tests.unit.test_reasons import reasons_in_code

CLASSES = {c.__name__: c for c in (Refusal, ProtocolRefusal, FirewallRefusal, PolicyRefusal, UpstreamRefusal,
                                   LocalRefusal)}


def test_table_rows_are_parties_and_catalogued_reasons():
    assert set(PARTY_OF_REASON.values()) <= set(PARTIES)
    catalogue = set(reasons.REFUSAL_REASONS) | set(reasons.SESSION_ERROR_REASONS)
    assert set(PARTY_OF_REASON) <= catalogue, set(PARTY_OF_REASON) - catalogue


def test_every_catalogued_reason_has_a_party():
    """A reason outside the firewall rules (all the client's) needs its row: nothing falls back
    to ``local`` by accident, and a new reason added to the catalogue must say whose it is."""
    for reason in (*reasons.REFUSAL_REASONS, *reasons.SESSION_ERROR_REASONS):
        if reason in reasons.FIREWALL_REASONS:
            assert FirewallRefusal(reason).party == CLIENT
        else:
            assert reason in PARTY_OF_REASON, f"{reason}: no row in errors.PARTY_OF_REASON"


def test_every_refusal_raised_in_code_resolves_to_its_party():
    for reason, where in reasons_in_code().items():
        for kind in {w.split(":", 1)[1] for w in where}:
            cls = CLASSES.get(kind)
            if cls is None:
                continue  # a helper or a recorded end: the reason alone (party_of) decides
            party = cls(reason).party
            assert party in PARTIES
            if cls in (Refusal, ProtocolRefusal, PolicyRefusal):
                assert party == PARTY_OF_REASON[reason], (reason, kind)


@pytest.mark.parametrize("err, party", [
    (FirewallRefusal("tensor_out_of_buffer"), CLIENT),
    (FirewallRefusal("frame_size_invalid"), CLIENT),
    (ProtocolRefusal("first_frame_not_hello"), CLIENT),
    (ProtocolRefusal("response_size_invalid"), UPSTREAM),  # a response rule: the upstream's
    (PolicyRefusal("identity_not_allowed"), CLIENT),
    (PolicyRefusal("version_not_accepted"), UPSTREAM),  # the version the upstream announced
    (Refusal("upstream_unavailable"), UPSTREAM),
    (Refusal("too_many_sessions"), LOCAL),
    (Refusal("some_new_reason"), LOCAL),  # no row, no class default
    (ProtocolRefusal("some_new_reason"), CLIENT),  # the class default
    (UpstreamRefusal("tls_unknown_ca"), UPSTREAM),  # fixed: connect's handshake with its node
    (LocalRefusal("frame_size_invalid"), LOCAL),
    (Refusal("certificate_usage_invalid", party=UPSTREAM), UPSTREAM),  # explicit wins
    (ConfigError("limits.max_sessions", "must be > 0"), LOCAL),
    (RpcGuardError("certificate file unreadable"), LOCAL),
])
def test_party_precedence(err, party):
    assert err.party == party


def test_refusal_keeps_reason_and_detail():
    r = UpstreamRefusal("upstream_busy", "still busy after 5 s")
    assert (r.reason, r.detail, str(r)) == ("upstream_busy", "still busy after 5 s", "upstream_busy: still busy after 5 s")
    assert isinstance(r, Refusal) and isinstance(r, RpcGuardError)


def test_party_of():
    assert party_of("hello_timeout") == CLIENT and party_of("upstream_closed") == UPSTREAM
    assert party_of("internal_error") == LOCAL and party_of("nope") == LOCAL and party_of("nope", CLIENT) == CLIENT
