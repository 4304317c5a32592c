"""Nothing shared between tenants, GHSA-2phh-px2f-2qmx per buffer, and command 19 (7.0.1), against
real servers where one can show it (issue 27 items 1-2, issue 28 item 3).

* A server's -c cache holds what any client uploaded with cache_flag=1; SET_TENSOR_HASH copies a
  cached file into the asker's tensor. Through serve with a server it does not contain, tenant B
  asking for the hash of tenant A's tensor gets "not cached" from the proxy and reads zeros; the
  control arm (the same query direct) gets A's bytes from the REAL 7.0.0 server. A tenant's own
  upload through serve keeps its cache_flag off, so nothing lands in the shared cache.
* A server that lies about itself in one session (GET_MAX_SIZE, GET_DEVICE_MEMORY) does not make
  serve refuse the next, honest session; an answer the protocol rules out (an alignment of 48)
  ends the session that got it, not the next (LyingRelay: the first connection's answers
  rewritten, in front of the REAL server; later connections reach it untouched).
* GRAPH_RECOMPUTE after FREE_BUFFER, on the REAL 6.0.0 server (llama.cpp b10970, before the fix in
  b11003): direct, the server reruns its stored graph over the freed buffer; through serve the
  rerun is refused on the device whose graph uses the freed buffer, and a free of another buffer
  leaves GRAPH_RECOMPUTE working with the right results.
* GET_DEVICE_SUPPORTS_OP: no release has it (7.0.1 is an open pull request): a fake 7.0.1 server
  (tests/support/lying.py) for the exchange through serve.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import pytest

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TensorSpec
from rpcguard.protocol.graph import op_rules
from tests.support import realpeer
from tests.support.guard import start_guard
from tests.support.lying import FakeServer701, LyingRelay
from tests.support.rawclient import RawClient, mtls_socket, read_response
from tests.support.waiting import wait_until

SMALL = 4096
SECRET = bytes((i * 37 + 11) & 0xFF for i in range(SMALL))
BIG = (10 << 20) + 4096  # above HASH_THRESHOLD: the size the client asks the hash cache for


def fnv1a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def f32(t: TensorSpec, n_bytes: int) -> bytes:
    return encode.pack_tensor(TensorSpec(buffer=t.buffer, data=t.data, ne=(n_bytes // 4, 1, 1, 1)))


def cached(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file())


# -- SET_TENSOR_HASH on a shared cache -------------------------------------------------------------


def test_a_tenant_never_reads_another_tenants_tensor_from_the_server_cache(pki, workdir, peer_python):
    cache = workdir / "llama-cache"
    proc, port = realpeer.start_rpc_server(workdir, cache_dir=cache)
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{port}", *pki.serve_args()])
    try:
        # tenant A's tensor in the server's cache, put there the way llama.cpp does (a miss, then
        # cache_flag=1), by a client of that server that rpcguard does not stand in front of
        a = RawClient.session(port)
        t = a.alloc(SMALL)
        assert a.call("SET_TENSOR_HASH", f32(t, SMALL) + struct.pack("<QQ", 0, fnv1a(SECRET))) == b"\x00"
        a.sock.sendall(encode.request("SET_TENSOR", f32(t, SMALL) + b"\x01" + struct.pack("<Q", 0) + SECRET))
        assert a.call("GET_TENSOR", f32(t, SMALL) + struct.pack("<QQ", 0, SMALL)) == SECRET
        a.close()
        assert [p.name for p in cached(cache)] == [f"{fnv1a(SECRET):016x}"]

        query = struct.pack("<QQ", 0, fnv1a(SECRET))
        # tenant B through serve: the proxy answers "not cached", B's buffer stays as allocated (zeroed)
        b = RawClient.session(mtls_socket(pki, serve.port))
        t = b.alloc(SMALL)
        assert b.call("SET_TENSOR_HASH", f32(t, SMALL) + query) == b"\x00"
        assert b.call("GET_TENSOR", f32(t, SMALL) + struct.pack("<QQ", 0, SMALL)) == bytes(SMALL)
        b.close()
        assert serve.wait_value("rpcguard_hash_answered_by_proxy_total", 1) == 1
        assert serve.logged("hash_answered_by_proxy=1")  # the session-end line, once

        # control: the same query straight to the real server copies A's bytes into B's tensor
        direct = RawClient.session(port)
        t = direct.alloc(SMALL)
        assert direct.call("SET_TENSOR_HASH", f32(t, SMALL) + query) == b"\x01"
        assert direct.call("GET_TENSOR", f32(t, SMALL) + struct.pack("<QQ", 0, SMALL)) == SECRET
        direct.close()

        # a tenant's own upload through serve, as llama.cpp sends it (hash, then cache_flag=1):
        # forwarded with the flag cleared, the data reaches its buffer, nothing reaches the cache
        data = bytes(range(256)) * (BIG // 256)
        c = RawClient.session(mtls_socket(pki, serve.port))
        t = c.alloc(BIG)
        assert c.call("SET_TENSOR_HASH", f32(t, BIG) + struct.pack("<QQ", 0, 0x1234)) == b"\x00"
        c.sock.sendall(encode.request("SET_TENSOR", f32(t, BIG) + b"\x01" + struct.pack("<Q", 0) + data))
        assert c.call("GET_TENSOR", f32(t, BIG) + struct.pack("<QQ", BIG - SMALL, SMALL)) == data[-SMALL:]
        c.close()
        assert len(cached(cache)) == 1, cached(cache)
        assert proc.alive()
    finally:
        serve.stop()
        proc.stop()


# -- facts per session -----------------------------------------------------------------------------


def session_count(serve, result: str) -> float:
    return serve.value("rpcguard_sessions_total", result=result)


def test_a_lying_server_does_not_poison_the_next_session(pki, workdir, rpc_server):
    with LyingRelay(rpc_server, 4096) as relay:
        serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{relay.port}", *pki.serve_args()])
        try:
            liar = RawClient.session(mtls_socket(pki, serve.port))  # its memory answer says 4096 bytes
            assert liar.call("GET_MAX_SIZE", struct.pack("<I", 0)) == struct.pack("<Q", 4096)
            liar.close()
            wait_until(lambda: serve.value("rpcguard_sessions_active") == 0, what="the liar's session ended")
            relay.lying = False
            honest = RawClient.session(mtls_socket(pki, serve.port))  # the real server's own answers
            t = honest.alloc(1 << 20)  # past both lies: refused alloc_size_invalid / alloc_quota_exceeded before
            honest.sock.sendall(encode.request("SET_TENSOR", f32(t, SMALL) + b"\x00" + struct.pack("<Q", 0) + SECRET))
            assert honest.call("GET_TENSOR", f32(t, SMALL) + struct.pack("<QQ", 0, SMALL)) == SECRET
            honest.close()
            assert serve.value("rpcguard_refusals_total", reason="alloc_size_invalid") == 0
        finally:
            serve.stop()


def test_an_impossible_answer_ends_only_the_session_that_got_it(pki, workdir, rpc_server):
    with LyingRelay(rpc_server, 48) as relay:  # an alignment of 48: not a power of two
        serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{relay.port}", *pki.serve_args()])
        try:
            liar = RawClient.session(mtls_socket(pki, serve.port))
            assert liar.closed_after(encode.request("GET_ALIGNMENT", struct.pack("<I", 0)))
            assert serve.wait_value("rpcguard_refusals_total", 1, reason="response_value_invalid") == 1
            wait_until(lambda: serve.value("rpcguard_sessions_active") == 0, what="the liar's session ended")
            relay.lying = False
            honest = RawClient.session(mtls_socket(pki, serve.port))
            assert struct.unpack("<Q", honest.call("GET_ALIGNMENT", struct.pack("<I", 0)))[0] in (32, 64)
            honest.close()
        finally:
            serve.stop()


# -- GHSA-2phh-px2f-2qmx on the real 6.0.0 server ----------------------------------------------------


class Client600(RawClient):
    """6.0.0 frames: SET_TENSOR without cache_flag; FREE_BUFFER and GRAPH_* answer nothing."""

    def start(self) -> Client600:
        assert self.hello() == (6, 0, 0)
        return self

    def put(self, t: TensorSpec, floats: list[float]) -> None:
        self.sock.sendall(encode.request("SET_TENSOR", encode.pack_tensor(t) + struct.pack("<Q", 0)
                                         + struct.pack(f"<{len(floats)}f", *floats)))

    def get(self, t: TensorSpec) -> list[float]:
        return list(struct.unpack("<4f", self.call("GET_TENSOR", encode.pack_tensor(t) + struct.pack("<QQ", 0, 16))))


def graph(buf: TensorSpec) -> tuple[bytes, TensorSpec, TensorSpec]:
    """n0 = w + w, n1 = n0 + w: three 4-float tensors in ``buf``; (frame, w, n1)."""
    add = op_rules((6, 0, 0)).names.index("ADD")  # type: ignore[union-attr]

    def t(id: int, slot: int, **kw) -> TensorSpec:
        return TensorSpec(id=id, buffer=buf.buffer, data=buf.data + slot * 16, name=b"t%d" % slot, **kw)

    # flags 16: GGML_TENSOR_FLAG_COMPUTE, what ggml_build_forward_expand sets on a node the CPU runs
    w, n0, n1 = t(0x10, 0, use_count=3), t(0x20, 1, op=add, src=(0x10, 0x10), use_count=1, flags=16), \
        t(0x30, 2, op=add, src=(0x20, 0x10), flags=16)
    return encode.request("GRAPH_COMPUTE", encode.graph_payload([0x20, 0x30], [w, n0, n1])), w, n1


RECOMPUTE = encode.request("GRAPH_RECOMPUTE", struct.pack("<I", 0))


def free(t: TensorSpec) -> bytes:
    return encode.request("FREE_BUFFER", struct.pack("<Q", t.buffer))


def test_recompute_after_free_on_the_real_6_0_0_server(pki, workdir):
    build = realpeer.release_build("6.0.0")
    port = realpeer.reserve_port()
    proc = realpeer.start([build.rpc_server, "-H", "127.0.0.1", "-p", str(port)], workdir / "rpc-600.log",
                          "ggml-rpc-server 6.0.0")
    realpeer.wait_port(port, proc=proc.popen)
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{port}", *pki.serve_args()])
    try:
        # direct: the server keeps the stored graph across the free and reruns it (the bug)
        d = Client600(port).start()
        a, c = d.alloc(64), d.alloc(64)
        frame, w, n1 = graph(a)
        d.put(w, [1, 2, 3, 4])
        d.sock.sendall(frame)
        assert d.get(n1) == [3, 6, 9, 12]
        d.sock.sendall(free(a) + RECOMPUTE)
        assert struct.unpack("<I", d.call("DEVICE_COUNT"))[0] == 1  # still answering: the rerun was not refused
        d.close()

        s = Client600(mtls_socket(pki, serve.port)).start()
        a, c = s.alloc(64), s.alloc(64)
        frame, w, n1 = graph(a)
        s.put(w, [1, 2, 3, 4])
        s.sock.sendall(frame)
        assert s.get(n1) == [3, 6, 9, 12]
        s.sock.sendall(free(c))  # the stored graph does not use c: its rerun is safe, and runs
        s.put(w, [2, 2, 2, 2])
        s.sock.sendall(RECOMPUTE)
        assert s.get(n1) == [6, 6, 6, 6]
        s.sock.sendall(free(a))  # it uses a: a rerun would compute over freed memory
        assert s.closed_after(RECOMPUTE)
        assert serve.wait_value("rpcguard_refusals_total", 1, reason="recompute_after_free") == 1

        again = Client600(mtls_socket(pki, serve.port)).start()  # the server is fine, a new graph runs
        a = again.alloc(64)
        frame, w, n1 = graph(a)
        again.put(w, [1, 1, 1, 1])
        again.sock.sendall(frame + free(again.alloc(64)) + RECOMPUTE)
        assert again.get(n1) == [3, 3, 3, 3]
        again.close()
        assert proc.alive()
    finally:
        serve.stop()
        proc.stop()


# -- GET_DEVICE_SUPPORTS_OP (7.0.1) through serve, against a fake 7.0.1 server -----------------------


def supports_query(op: int, srcs: int, device: int = 0) -> bytes:
    t = [encode.pack_tensor(TensorSpec(id=0x1000 + i, ne=(4, 4, 1, 1))) for i in range(srcs)]
    return encode.request("GET_DEVICE_SUPPORTS_OP", struct.pack("<I", device) + encode.pack_tensor(
        TensorSpec(id=0x100, ne=(4, 4, 1, 1), op=op)) + b"".join(t) + bytes(296 * (10 - srcs)))


def hello701(sock: socket.socket) -> None:
    sock.sendall(encode.hello_request((7, 0, 0)))
    assert read_response(sock)[:3] == bytes([7, 0, 1])


@pytest.mark.parametrize("answer", [1, 0])
def test_supports_op_through_serve_to_a_701_server(pki, workdir, answer):
    mul_mat = op_rules((7, 0, 1)).names.index("MUL_MAT")  # type: ignore[union-attr]
    flash_attn_back = op_rules((7, 0, 1)).names.index("FLASH_ATTN_BACK")  # type: ignore[union-attr]
    with FakeServer701(answer) as fake:
        serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{fake.port}", *pki.serve_args()])
        try:
            c = RawClient(mtls_socket(pki, serve.port))
            hello701(c.sock)
            c.sock.sendall(supports_query(mul_mat, 2))
            assert read_response(c.sock) == bytes([answer])
            c.sock.sendall(supports_query(flash_attn_back, 2))  # no rule: the proxy says "not supported"
            assert read_response(c.sock) == b"\x00"
            assert fake.received.count(19) == 1
            for bad, reason in [(supports_query(mul_mat, 1), "graph_src_missing"),
                                (supports_query(101, 2), "graph_op_invalid"),
                                (supports_query(mul_mat, 2, device=1), "device_out_of_range")]:
                c = RawClient(mtls_socket(pki, serve.port))
                hello701(c.sock)
                assert c.closed_after(bad)
                assert serve.wait_value("rpcguard_refusals_total", 1, reason=reason) >= 1
            assert fake.received.count(19) == 1  # none of them reached the server
        finally:
            serve.stop()


def test_a_lying_supports_op_answer_ends_the_session(pki, workdir):
    mul_mat = op_rules((7, 0, 1)).names.index("MUL_MAT")  # type: ignore[union-attr]
    with FakeServer701(2) as fake:
        serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{fake.port}", *pki.serve_args()])
        try:
            c = RawClient(mtls_socket(pki, serve.port))
            hello701(c.sock)
            assert c.closed_after(supports_query(mul_mat, 2))
            assert serve.wait_value("rpcguard_refusals_total", 1, reason="response_value_invalid") == 1
            fake.supports = 1
            c = RawClient(mtls_socket(pki, serve.port))  # the next session is not held to it
            hello701(c.sock)
            c.sock.sendall(supports_query(mul_mat, 2))
            assert read_response(c.sock) == b"\x01"
        finally:
            serve.stop()
