"""Tenant isolation rules against the REAL ggml-rpc-server (7.0.0), with a client that holds a
valid certificate (issue 9, item 4).

* ``clear_new_buffers`` (on by default): a session that allocates a buffer gets zeroed memory,
  never what the previous session wrote into memory it freed. The control arm (serve with
  ``clear_new_buffers: false``) shows that the real CPU server does hand the old bytes out, so
  the test can fail.
* SET_TENSOR ``cache_flag=1`` is accepted only the way llama.cpp sends it (after a
  SET_TENSOR_HASH miss, above 10 MiB): a bare cache_flag=1 frame is refused before the server's
  ``-c`` cache directory gets a file. The real client's own use of the flag through the pair is
  test_firewall_real.py::test_server_hash_cache_through_the_pair.
* the allocation quota: by default the device memory the server reports (an ALLOC_BUFFER past it
  never reaches the server), or ``policy.max_session_alloc_bytes`` (a real model load that needs
  more is refused with ``alloc_quota_exceeded``).
"""

from __future__ import annotations

import struct
from pathlib import Path

from rpcguard.protocol import encode
from tests.support import realpeer
from tests.support.guard import Pki, start_guard
from tests.support.rawclient import RawClient, mtls_socket

# Small enough that glibc neither mmaps it nor gives the freed heap back to the kernel (both hand
# out zero pages): a freed buffer's memory, or the server's receive vector of the SET_TENSOR that
# filled it, is what the next allocation of that size gets.
SMALL = 16 << 10
PATTERN = bytes(range(1, 256)) * (SMALL // 255) + bytes(SMALL % 255)


def f32(handle: int, base: int, n_bytes: int) -> bytes:
    return encode.pack_tensor(encode.TensorSpec(buffer=handle, data=base, ne=(n_bytes // 4, 1, 1, 1)))


def policy_file(workdir: Path, name: str, policy: str) -> str:
    path = workdir / name
    path.write_text("policy:\n" + policy)
    return str(path)


def leftover(pki: Pki, serve) -> bytes:
    """Session 1 writes PATTERN into a new buffer and frees it; session 2 allocates the same size
    and reads its buffer: what it gets back."""
    one = RawClient.session(mtls_socket(pki, serve.port))
    t = one.alloc(SMALL)
    h, base = t.buffer, t.data
    one.sock.sendall(encode.request("SET_TENSOR", f32(h, base, SMALL) + b"\0" + struct.pack("<Q", 0) + PATTERN))
    back = one.call("GET_TENSOR", f32(h, base, SMALL) + struct.pack("<QQ", 0, SMALL))
    assert back == PATTERN
    one.sock.sendall(encode.request("FREE_BUFFER", struct.pack("<Q", h)))
    one.close()
    two = RawClient.session(mtls_socket(pki, serve.port))  # waits for the upstream slot: session 1 is over
    t = two.alloc(SMALL)
    h, base = t.buffer, t.data
    data = two.call("GET_TENSOR", f32(h, base, SMALL) + struct.pack("<QQ", 0, SMALL))
    two.close()
    return data


def test_new_buffers_never_hold_a_previous_sessions_bytes(pki, rpc_server, workdir):
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args()])
    try:
        assert leftover(pki, serve) == bytes(SMALL)  # default: BUFFER_CLEAR injected after ALLOC
        assert serve.wait_value("rpcguard_frames_total", 2, command="BUFFER_CLEAR", direction="request") >= 2
    finally:
        serve.stop()
    control = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{rpc_server}", *pki.serve_args(),
                                              "--config", policy_file(workdir, "noclear.yaml",
                                                                      "  clear_new_buffers: false\n")])
    try:
        data = leftover(pki, control)
        # The real server hands out freed memory as it was: the pattern, maybe shifted (it can be
        # the receive vector's copy) and with allocator metadata in places.
        assert sum(1 for b in data if b) > SMALL // 2, data[:64]
    finally:
        control.stop()


def test_bare_cache_flag_is_refused_before_the_server_writes_a_file(pki, pair, workdir):
    cache = workdir / "llama-cache"
    proc, port = realpeer.start_rpc_server(workdir, cache_dir=cache)
    try:
        connect, serve = pair(upstream_port=port)
        size = (10 << 20) + 4096
        # Through the pair and straight to serve: serve refuses it both times (connect leaves the
        # request firewall to an rpcguard node: validate_requests auto).
        for n, target in enumerate(("connect", "serve"), 1):
            c = RawClient.session(connect.port if target == "connect" else mtls_socket(pki, serve.port))
            t = c.alloc(16 << 20)
            h, base = t.buffer, t.data
            frame = encode.request("SET_TENSOR", f32(h, base, size) + b"\1" + struct.pack("<Q", 0) + bytes(size))
            assert c.closed_after(frame)
            c.close()
            assert serve.wait_value("rpcguard_refusals_total", n, reason="set_tensor_cache_flag_invalid") == n
        assert not [p for p in cache.rglob("*") if p.is_file()]
        assert proc.alive()
    finally:
        proc.stop()


def test_alloc_past_the_device_memory_never_reaches_the_server(pki, pair):
    connect, serve = pair()
    c = RawClient.session(connect.port)
    free, total = struct.unpack("<QQ", c.call("GET_DEVICE_MEMORY", struct.pack("<I", 0)))
    assert total > 0
    c.alloc(1 << 20)
    assert c.closed_after(encode.request("ALLOC_BUFFER", struct.pack("<IQ", 0, total)))
    c.close()
    # The node's serve refuses it (connect leaves the request firewall to it), before the server.
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="alloc_quota_exceeded") == 1
    assert serve.wait_value("rpcguard_frames_total", 2, command="ALLOC_BUFFER", direction="request") == 2
    assert connect.value("rpcguard_refusals_total", reason="alloc_quota_exceeded") == 0
    # A client that skips connect.
    c = RawClient.session(mtls_socket(pki, serve.port))
    assert c.closed_after(encode.request("ALLOC_BUFFER", struct.pack("<IQ", 0, total + 1)))
    c.close()
    assert serve.wait_value("rpcguard_refusals_total", 2, reason="alloc_quota_exceeded") == 2


def test_session_quota_refuses_a_model_load_that_needs_more(pki, pair, models, workdir, rpc_server):
    cfg = policy_file(workdir, "quota.yaml", "  max_session_alloc_bytes: 16MiB\n")
    connect, serve = pair(serve_args=["--config", cfg])
    run = realpeer.run_client(connect.endpoint, models["bench"], n=4)  # ~105 MB of weights
    assert not run.ok
    assert serve.wait_value("rpcguard_refusals_total", 1, reason="alloc_quota_exceeded") >= 1, serve.output()[-2000:]
    ok = realpeer.run_client(f"127.0.0.1:{rpc_server}", models["tiny"], n=4)
    assert ok.ok, ok.output[-2000:]  # the real server is unharmed
