"""A constructor-built RoPE node the firewall forwards today aborts the REAL ggml-rpc-server.

test_kernel_contracts.py argues from the sources; this runs one case for real. The harness's
graph (fake buffer) is rebased into a buffer allocated on a fresh real 7.0.0 server, then:

1. the valid RoPE graph (n_dims 8 <= ne0 16) is computed and the server still answers;
2. the same graph with n_dims 32 > ne0 16, which ggml_rope_ext builds without complaint, kills
   the server with one GRAPH_COMPUTE (ggml-cpu/ops.cpp:6355 GGML_ASSERT(n_dims <= ne0)).

The test asserts both server outcomes; whether rpcguard forwards the second graph is
test_kernel_contracts.py's question (it does on the code this was written against).
"""

from __future__ import annotations

import socket
import struct
import time

from rpcguard.protocol import encode
from tests.support import realpeer
from tests.support.ggmlref import Built, build_many
from tests.support.rawclient import read_response

V7 = (7, 0, 0)
ROPE_TAIL = [10000.0, 1.0, 0.0, 1.0, 32.0, 1.0]


def rope(n_dims: int) -> dict:
    return {"leaves": [{"type": "f32", "ne": [16, 2, 3, 1]}, {"type": "i32", "ne": [3, 1, 1, 1]}],
            "ops": [{"fn": "rope_ext", "args": [0, 1, None, n_dims, 0, 4096, *ROPE_TAIL]}]}  # fmt: skip


def call(s: socket.socket, cmd: str, payload: bytes) -> bytes:
    s.sendall(encode.request(cmd, payload))
    return read_response(s)


def test_rope_n_dims_past_the_row_aborts_the_real_server(workdir):
    good, bad = build_many([rope(8), rope(32)])
    assert isinstance(good, Built) and isinstance(bad, Built), "the real constructor must build both"
    server, port = realpeer.start_rpc_server(workdir)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(encode.hello_request(V7))
            assert read_response(s)[:3] == bytes(V7)
            size = max(good.packed_size, bad.packed_size) + 4096
            handle, got = struct.unpack("<QQ", call(s, "ALLOC_BUFFER", struct.pack("<IQ", 0, size)))
            assert handle and got >= size
            (base,) = struct.unpack("<Q", call(s, "BUFFER_GET_BASE", struct.pack("<Q", handle)))
            s.sendall(encode.request("GRAPH_COMPUTE", good.rebase(handle, base)))
            assert len(call(s, "GET_ALIGNMENT", struct.pack("<I", 0))) == 8  # computed, still serving
            assert server.alive()
            s.sendall(encode.request("GRAPH_COMPUTE", bad.rebase(handle, base)))
            deadline = time.monotonic() + 10
            while server.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        assert not server.alive(), "the real server survived a RoPE with n_dims > ne0"
        assert server.popen.returncode in (-6, 134), server.popen.returncode  # SIGABRT
        assert "n_dims <= ne0" in server.output(), server.output()[-1500:]
    finally:
        server.stop()
