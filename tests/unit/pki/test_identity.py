"""rpcguard.pki.identity: PeerIdentity parsing and the ACL matching table."""

from __future__ import annotations

import hashlib

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from rpcguard.pki import certs
from rpcguard.errors import PolicyRefusal
from rpcguard.pki.identity import CLIENT_AUTH, SERVER_AUTH, Acl, PeerIdentity, check_usage, source_of


def der_of(path) -> bytes:
    return x509.load_pem_x509_certificate(path.read_bytes()).public_bytes(serialization.Encoding.DER)


def ident(cn=None, dns=(), uris=(), ips=()) -> PeerIdentity:
    return PeerIdentity(cn, tuple(dns), tuple(uris), tuple(ips), serial=0x1234, not_after=0.0, fingerprint_sha256="")


def test_from_der_reads_cn_and_sans(tmp_path):
    certs.init_ca(tmp_path)
    files = certs.issue(tmp_path, "client1", server=False, dns=["GPU1.lab"], ips=["10.1.2.3", "fe80::1"],
                        uris=["spiffe://lab/llama/gpu1"])
    der = der_of(files.cert)
    peer = PeerIdentity.from_der(der)
    leaf = certs.load_cert(files.cert)
    assert peer.common_name == "client1"
    assert peer.dns == ("gpu1.lab",)
    assert peer.ips == ("10.1.2.3", "fe80::1")
    assert peer.uris == ("spiffe://lab/llama/gpu1",)
    assert peer.serial == leaf.serial_number
    assert peer.not_after == leaf.not_valid_after_utc.timestamp()
    assert peer.fingerprint_sha256 == hashlib.sha256(der).hexdigest()
    assert peer.label() == "CN=client1 DNS=gpu1.lab URI=spiffe://lab/llama/gpu1 IP=10.1.2.3,fe80::1"


def test_from_der_without_sans(tmp_path):
    certs.init_ca(tmp_path)
    peer = PeerIdentity.from_der(der_of(certs.issue(tmp_path, "c", server=False).cert))
    assert (peer.common_name, peer.dns, peer.uris, peer.ips) == ("c", (), (), ())


def test_from_der_rejects_garbage():
    with pytest.raises(ValueError):
        PeerIdentity.from_der(b"\x30\x03\x02\x01\x00")


def test_label_is_short_and_escaped():
    peer = ident(cn="evil\nline", uris=[f"spiffe://lab/{i}" for i in range(5)])
    assert peer.label() == "CN=evil\\nline URI=spiffe://lab/0,spiffe://lab/1,spiffe://lab/2,+2"
    assert ident().label() == "serial=1234"


def test_peer_identity_is_frozen_and_hashable():
    peer = ident(cn="a")
    with pytest.raises(AttributeError):
        peer.common_name = "b"  # type: ignore[misc]
    assert hash(peer) == hash(ident(cn="a"))


ACL = Acl(
    cns=("client1",),
    dns=("gpu1.lab.example", "*.pool.example"),
    uris=("spiffe://lab/llama", "spiffe://lab/workers/*"),
    ips=("10.0.0.0/8", "192.168.1.5", "fd00::/8"),
)


@pytest.mark.parametrize(
    ("peer", "allowed"),
    [
        # CN: exact, case-sensitive
        (ident(cn="client1"), True),
        (ident(cn="Client1"), False),
        (ident(cn="client10"), False),
        (ident(cn=None), False),
        # DNS: exact, case-insensitive; wildcard covers exactly one leftmost label
        (ident(dns=["gpu1.lab.example"]), True),
        (ident(dns=["GPU1.Lab.Example"]), True),
        (ident(dns=["gpu2.lab.example"]), False),
        (ident(dns=["x.gpu1.lab.example"]), False),
        (ident(dns=["a.pool.example"]), True),
        (ident(dns=["pool.example"]), False),
        (ident(dns=["a.b.pool.example"]), False),
        (ident(dns=["apool.example"]), False),
        (ident(dns=["other.example", "b.pool.example"]), True),
        # CN never matches a DNS entry and vice versa
        (ident(cn="gpu1.lab.example"), False),
        (ident(dns=["client1"]), False),
        # URI: exact, or a prefix ending in /*
        (ident(uris=["spiffe://lab/llama"]), True),
        (ident(uris=["spiffe://lab/llama/x"]), False),
        (ident(uris=["spiffe://lab/llamas"]), False),
        (ident(uris=["spiffe://lab/workers/a"]), True),
        (ident(uris=["spiffe://lab/workers/a/b"]), True),
        (ident(uris=["spiffe://lab/workers"]), False),
        (ident(uris=["spiffe://lab/workers/"]), False),
        (ident(uris=["spiffe://lab/workersX/a"]), False),
        (ident(uris=["spiffe://lab/workers/../admin"]), False),
        (ident(uris=["spiffe://lab/workers//a"]), False),
        (ident(uris=["spiffe://other/workers/a"]), False),
        # IP: address or CIDR, normalised
        (ident(ips=["10.20.30.40"]), True),
        (ident(ips=["11.0.0.1"]), False),
        (ident(ips=["192.168.1.5"]), True),
        (ident(ips=["192.168.1.6"]), False),
        (ident(ips=["::ffff:10.0.0.1"]), True),
        (ident(ips=["fd12:3456::1"]), True),
        (ident(ips=["fe80::1"]), False),
        (ident(ips=["not-an-ip"]), False),
        # nothing at all
        (ident(), False),
    ],
)
def test_acl_matching(peer, allowed):
    assert ACL.allows(peer) is allowed
    if allowed:
        ACL.authorize(peer)
    else:
        with pytest.raises(PolicyRefusal) as info:
            ACL.authorize(peer)
        assert info.value.reason == "identity_not_allowed"
        assert peer.label() in info.value.detail


def test_ipv4_mapped_acl_entry():
    acl = Acl(ips=("::ffff:10.0.0.0/104",))
    assert acl.allows(ident(ips=["10.1.1.1"]))
    assert not acl.allows(ident(ips=["11.1.1.1"]))


def test_empty_acl_admits_nobody_unless_allow_any():
    assert Acl().is_empty
    with pytest.raises(PolicyRefusal):
        Acl().authorize(ident(cn="whoever"))
    Acl(allow_any=True).authorize(ident(cn="whoever"))


def test_allow_any_with_entries_is_contradictory():
    with pytest.raises(ValueError, match="allow_any"):
        Acl(cns=("a",), allow_any=True)


def test_acl_accepts_lists_and_stays_hashable():
    acl = Acl(cns=["a"], dns=["Gpu1.LAB."], ips=["10.0.0.1"])  # type: ignore[arg-type]
    assert acl.cns == ("a",) and acl.dns == ("gpu1.lab",)
    assert hash(acl) == hash(Acl(cns=("a",), dns=("gpu1.lab",), ips=("10.0.0.1",)))
    assert acl.allows(ident(dns=["gpu1.lab"]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cns": "client1"},
        {"ips": ("10.0.0.1/8",)},
        {"ips": ("10.0.0.300",)},
        {"ips": ("gpu1",)},
        {"dns": ("a.*.b",)},
        {"dns": ("*a.b",)},
        {"dns": ("*",)},
        {"dns": ("a..b",)},
        {"dns": ("",)},
        {"uris": ("spiffe://lab/*/x",)},
        {"uris": ("spiffe://lab/x*",)},
        {"uris": ("",)},
    ],
)
def test_acl_rejects_invalid_entries(kwargs):
    with pytest.raises(ValueError):
        Acl(**kwargs)


# -- smuggled names ---------------------------------------------------------------------------


@pytest.mark.parametrize("uri", [
    "spiffe://lab/llama/%2e%2e/admin", "spiffe://lab/llama/%2E%2E/admin", "spiffe://lab/llama/.%2e/admin",
    "spiffe://lab/llama/%2e./admin", "spiffe://lab/llama/%2e", "spiffe://lab/llama/a/%2E%2e",
    "spiffe://lab/llama/a%2fb", "spiffe://lab/llama/..", "spiffe://lab/llama/./a", "spiffe://lab/llama//a",
    "spiffe://lab/llama/a/", "spiffe://lab/llama/a?b", "spiffe://lab/llama/a#b", "spiffe://lab/llama/a\\..",
    "spiffe://lab/llama/\u0430", "spiffe://lab/llama/",
])
def test_uri_wildcard_matches_only_plain_segments(uri):
    acl = Acl(uris=("spiffe://lab/llama/*",))
    assert not acl.allows(ident(uris=[uri]))


@pytest.mark.parametrize("uri", ["spiffe://lab/llama/a", "spiffe://lab/llama/gpu-1/x_2.b", "spiffe://lab/llama/..a"])
def test_uri_wildcard_still_matches_real_ids(uri):
    assert Acl(uris=("spiffe://lab/llama/*",)).allows(ident(uris=[uri]))


@pytest.mark.parametrize("presented", ["*.lab", "*.pool.example", "*", "a*.pool.example"])
def test_wildcard_dns_san_never_satisfies_an_entry(presented):
    acl = Acl(dns=("*.lab", "x.lab", "*.pool.example"))
    assert not acl.allows(ident(dns=[presented]))
    assert acl.allows(ident(dns=["x.lab"])) and acl.allows(ident(dns=["a.pool.example"]))


# -- certificate usage (EKU) --------------------------------------------------------------------


def with_eku(ekus) -> PeerIdentity:
    return PeerIdentity("c", (), (), (), serial=1, not_after=0.0, fingerprint_sha256="", ekus=ekus)


@pytest.mark.parametrize("role,ekus,ok", [
    ("client", (CLIENT_AUTH,), True),
    ("client", (SERVER_AUTH, CLIENT_AUTH), True),
    ("client", (SERVER_AUTH,), False),
    ("client", None, False),  # no EKU extension: OpenSSL lets it through, we do not
    ("client", ("2.5.29.37.0",), False),  # anyExtendedKeyUsage alone
    ("server", (SERVER_AUTH,), True),
    ("server", (CLIENT_AUTH,), False),
    ("server", None, False),
])
def test_check_usage(role, ekus, ok):
    if ok:
        check_usage(with_eku(ekus), role)
    else:
        with pytest.raises(PolicyRefusal) as e:
            check_usage(with_eku(ekus), role)
        assert e.value.reason == "certificate_usage_invalid"


def test_from_der_reads_the_eku(tmp_path):
    certs.init_ca(tmp_path)
    client = PeerIdentity.from_der(der_of(certs.issue(tmp_path, "c", server=False).cert))
    server = PeerIdentity.from_der(der_of(certs.issue(tmp_path, "s", server=True, dns=["s"]).cert))
    check_usage(client, "client")
    check_usage(server, "server")
    with pytest.raises(PolicyRefusal):
        check_usage(server, "client")


@pytest.mark.parametrize("host,source", [
    ("192.0.2.7", "192.0.2.7"),
    ("::ffff:192.0.2.7", "192.0.2.7"),  # a dual-stack listener sees IPv4 clients this way
    ("2001:db8:1:2:aaaa:bbbb:cccc:dddd", "2001:db8:1:2::/64"),
    ("2001:db8:1:2::1", "2001:db8:1:2::/64"),  # the same host's other address: the same source
    ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("::1", "::/64"),
    ("not-an-address", "not-an-address"),
])
def test_the_per_source_caps_count_an_ipv4_address_or_an_ipv6_slash_64(host, source):
    assert source_of(host) == source
