"""The device memory share of a session (protocol/memshare.py, issue 31 item 1): the client is
told min(free, share - held) / min(total, share) in GET_DEVICE_MEMORY answers (whole, byte by
byte, followed by another frame), an ALLOC_BUFFER past the share is refused
``device_memory_share_exceeded`` before the server sees it, freeing makes room again, each session
counts its own buffers, and without a share nothing changes."""

from __future__ import annotations

import struct

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol import encode
from rpcguard.protocol.firewall import FirewallPolicy
from rpcguard.protocol.session import Session, SessionPolicy
from rpcguard.protocol.state import UpstreamFacts
from tests.support import vectors as V

V7 = (7, 0, 0)
MIB = 1 << 20
FREE, TOTAL = 70_000 * MIB, 80_000 * MIB  # what the server says: an 80 GB GPU
TRAILING = V.DEVICE_COUNT_REQ


def session(share: int = 0, devices: int = 1) -> Session:
    s = Session(SessionPolicy(clear_new_buffers=False, firewall=FirewallPolicy(device_memory_share_bytes=share)),
                UpstreamFacts(version=V7, device_count=devices, memory={d: (FREE, TOTAL) for d in range(devices)}))
    s.client_data(memoryview(encode.hello_request(V7)))
    s.server_data(memoryview(encode.hello_response(V7)))
    assert s.greeted
    s.to_server.clear(), s.to_client.clear(), s.out.events.clear()
    return s


take = V.take


def memory(s: Session, device: int = 0, free: int = FREE, total: int = TOTAL, how: str = "whole") -> tuple[int, int]:
    """The client asks GET_DEVICE_MEMORY, the server answers (free, total): what the client gets."""
    s.client_data(memoryview(encode.request("GET_DEVICE_MEMORY", struct.pack("<I", device))))
    take(s.to_server)
    answer = encode.response(struct.pack("<QQ", free, total))
    if how == "bytewise":
        for i in range(len(answer)):
            s.server_data(memoryview(answer[i:i + 1]))
    else:
        s.server_data(memoryview(answer))
    got = take(s.to_client)
    assert len(got) == 24 and struct.unpack_from("<Q", got)[0] == 16
    return struct.unpack_from("<QQ", got, 8)


def alloc(s: Session, size: int, handle: int, device: int = 0) -> None:
    s.client_data(memoryview(encode.request("ALLOC_BUFFER", struct.pack("<IQ", device, size))))
    assert take(s.to_server) == encode.request("ALLOC_BUFFER", struct.pack("<IQ", device, size))
    s.server_data(memoryview(encode.response(struct.pack("<QQ", handle, size))))
    take(s.to_client)


def refused_alloc(s: Session, size: int, device: int = 0) -> str:
    with pytest.raises(FirewallRefusal) as exc:
        s.client_data(memoryview(encode.request("ALLOC_BUFFER", struct.pack("<IQ", device, size))))
    assert take(s.to_server) == b""
    return exc.value.reason


@pytest.mark.parametrize("how", ["whole", "bytewise"])
def test_the_client_is_told_its_share(how):
    s = session(share=20_000 * MIB)
    assert memory(s, how=how) == (20_000 * MIB, 20_000 * MIB)
    assert s.state.upstream.memory[0] == (FREE, TOTAL)  # the session's facts keep the server's numbers
    assert memory(s, free=5_000 * MIB, how=how) == (5_000 * MIB, 20_000 * MIB)  # less free than the share
    alloc(s, 12_000 * MIB, 0x100)
    assert memory(s, how=how) == (8_000 * MIB, 20_000 * MIB)  # what it holds is out of its share


def test_the_answer_followed_by_another_in_the_same_read():
    s = session(share=MIB)
    s.client_data(memoryview(encode.request("GET_DEVICE_MEMORY", struct.pack("<I", 0))
                             + encode.request("GET_ALIGNMENT", struct.pack("<I", 0))))
    take(s.to_server)
    s.server_data(memoryview(encode.response(struct.pack("<QQ", FREE, TOTAL)) + encode.response(struct.pack("<Q", 32))))
    assert take(s.to_client) == encode.response(struct.pack("<QQ", MIB, MIB)) + encode.response(struct.pack("<Q", 32))


def test_no_share_no_change():
    s = session()
    assert memory(s) == (FREE, TOTAL)
    alloc(s, 60_000 * MIB, 0x100)


def test_an_allocation_past_the_share_is_refused_and_a_free_makes_room():
    s = session(share=20_000 * MIB)
    alloc(s, 15_000 * MIB, 0x100)
    assert refused_alloc(s, 6_000 * MIB) == "device_memory_share_exceeded"
    s2 = session(share=20_000 * MIB)
    alloc(s2, 15_000 * MIB, 0x100)
    s2.client_data(memoryview(encode.request("FREE_BUFFER", struct.pack("<Q", 0x100))))
    take(s2.to_server)
    alloc(s2, 20_000 * MIB, 0x200)  # the whole share again


def test_each_session_and_each_device_its_own_share():
    a, b = session(share=20_000 * MIB, devices=2), session(share=20_000 * MIB, devices=2)
    alloc(a, 20_000 * MIB, 0x100)
    alloc(a, 20_000 * MIB, 0x200, device=1)  # another device: its own share
    alloc(b, 20_000 * MIB, 0x100)  # another session: unaffected by a's
    assert refused_alloc(a, 1, device=0) == "device_memory_share_exceeded"


def test_the_policy_key(tmp_path):
    from rpcguard.config.model import parse_config

    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    data = {"tls": {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"}, "allow": {"cn": ["llama1"]},
            "listeners": [{"name": "gpu0", "listen": "127.0.0.1:50100", "upstream": "127.0.0.1:50052",
                           "policy": {"device_memory_share_bytes": "20GiB"}}]}
    cfg = parse_config(data, base_dir=str(tmp_path))
    assert cfg.listeners[0].policy.firewall.device_memory_share_bytes == 20 << 30
    assert FirewallPolicy().device_memory_share_bytes == 0
