"""A node the 7.0.0 kernels run but an older one aborts on, against the REAL 6.0.0 server (b10970).

SCALE of a BF16 tensor: 7.0.0 has ggml_compute_forward_scale_bf16 (0.3.36 ops.cpp:4981); b10970's
ggml_compute_forward_scale has F32 only, then GGML_ABORT (ops.cpp:4762). Sent straight to the
server it stops the process (every tenant of a shared server loses it); through serve the node is
refused ``type_not_supported_by_version`` (rpcguard/protocol/oprules/kerneltypes.py), the server
stays up and computes an F32 SCALE in the next session. The 6.0.0 server comes from
tests/realpeer/releases.sh (realpeer.release_build names the install step when it is missing).
"""

from __future__ import annotations

import struct

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TensorSpec
from rpcguard.protocol.graph import op_rules
from tests.support import realpeer
from tests.support.guard import start_guard
from tests.support.rawclient import RawClient, mtls_socket
from tests.support.waiting import wait_until

V600 = (6, 0, 0)
F32, BF16 = 0, 30


def f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


class Client600(RawClient):
    """6.0.0 frames: SET_TENSOR without cache_flag; GRAPH_COMPUTE answers nothing."""

    def start(self) -> Client600:
        assert self.hello() == V600
        return self

    def put(self, t: TensorSpec, data: bytes) -> None:
        self.sock.sendall(encode.request("SET_TENSOR", encode.pack_tensor(t) + struct.pack("<Q", 0) + data))

    def get(self, t: TensorSpec, n: int) -> bytes:
        return self.call("GET_TENSOR", encode.pack_tensor(t) + struct.pack("<QQ", 0, n))


def scale_graph(buf: TensorSpec, type_: int) -> tuple[bytes, TensorSpec, TensorSpec]:
    """d = scale(a, 2.0): two 4-element tensors of ``type_`` in ``buf``; (frame, a, d)."""
    scale = op_rules(V600).names.index("SCALE")  # type: ignore[union-attr]
    size = 4 if type_ == F32 else 2
    nb = (size, 4 * size, 4 * size, 4 * size)

    def t(id: int, slot: int, **kw) -> TensorSpec:
        return TensorSpec(id=id, type=type_, type_size=size, ne=(4, 1, 1, 1), nb=nb, buffer=buf.buffer,
                          data=buf.data + slot * 16, name=b"t%d" % slot, **kw)

    # flags 16: GGML_TENSOR_FLAG_COMPUTE (ggml_build_forward_expand); a is used once
    a = t(0x10, 0, use_count=1)
    d = t(0x20, 1, op=scale, src=(0x10,), op_params=(f32_bits(2.0), 0), flags=16)
    return encode.request("GRAPH_COMPUTE", encode.graph_payload([0x20], [a, d])), a, d


BF16_ONES = struct.pack("<4H", *([0x3F80] * 4))  # 1.0 in bfloat16


def test_bf16_scale_aborts_the_real_6_0_0_server_and_is_refused_through_serve(pki, workdir):
    build = realpeer.release_build("6.0.0")
    port = realpeer.reserve_port()
    proc = realpeer.start([build.rpc_server, "-H", "127.0.0.1", "-p", str(port)], workdir / "rpc-600-a.log",
                          "ggml-rpc-server 6.0.0")
    realpeer.wait_port(port, proc=proc.popen)
    try:
        # direct: the server's SCALE kernel aborts on the BF16 node
        d = Client600(port).start()
        frame, a, _ = scale_graph(d.alloc(64), BF16)
        d.put(a, BF16_ONES)
        d.sock.sendall(frame)
        wait_until(lambda: not proc.alive(), 30, "the 6.0.0 server to abort on a BF16 SCALE")
        assert "fatal error" in proc.output(), proc.output()[-2000:]
        d.close()
    finally:
        proc.stop()

    port = realpeer.reserve_port()
    proc = realpeer.start([build.rpc_server, "-H", "127.0.0.1", "-p", str(port)], workdir / "rpc-600-b.log",
                          "ggml-rpc-server 6.0.0")
    realpeer.wait_port(port, proc=proc.popen)
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{port}", *pki.serve_args()])
    try:
        s = Client600(mtls_socket(pki, serve.port)).start()
        frame, a, _ = scale_graph(s.alloc(64), BF16)
        s.put(a, BF16_ONES)
        assert s.closed_after(frame)
        assert serve.wait_value("rpcguard_refusals_total", 1, reason="type_not_supported_by_version") == 1

        again = Client600(mtls_socket(pki, serve.port)).start()  # the server is up: an F32 SCALE runs
        frame, a, d = scale_graph(again.alloc(64), F32)
        again.put(a, struct.pack("<4f", 1, 2, 3, 4))
        again.sock.sendall(frame)
        assert struct.unpack("<4f", again.get(d, 16)) == (2, 4, 6, 8)
        again.close()
        assert proc.alive()
    finally:
        serve.stop()
        proc.stop()
