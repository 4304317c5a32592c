"""Nodes the 7.0.0 kernels run but an older one aborts on, against the REAL old servers.

SCALE of a BF16 tensor: 7.0.0 has ggml_compute_forward_scale_bf16 (0.3.36 ops.cpp:4981); b10970's
ggml_compute_forward_scale has F32 only, then GGML_ABORT (ops.cpp:4762). Sent straight to the
server it stops the process (every tenant of a shared server loses it); through serve the node is
refused ``type_not_supported_by_version`` (rpcguard/protocol/oprules/kerneltypes.py), the server
stays up and computes an F32 SCALE in the next session. The same, for one row of kerneltypes.GAPS
each, on the 4.0.1 (b9968), 5.1.0 (b10635) and 6.0.0 servers: the node built as the unit tests
build it (tests/unit/protocol/test_kerneltypes.py) aborts the server direct, is refused through serve, and
the node the old kernel handles runs after it. The servers come from tests/realpeer/releases.sh
(realpeer.release_build names the install step when one is missing).
"""

from __future__ import annotations

import dataclasses
import struct

import pytest

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TensorSpec
from rpcguard.protocol.graph import op_rules
from tests.support import realpeer
from tests.support.guard import start_guard
from tests.support.rawclient import RawClient, mtls_socket
from tests.support.waiting import wait_until
from tests.unit.protocol import test_kerneltypes as kt

V600 = (6, 0, 0)
F32, BF16 = 0, 30


def f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


class Client600(RawClient):
    """4.0.1-6.0.0 frames: SET_TENSOR without cache_flag; GRAPH_COMPUTE answers nothing."""

    version = V600

    def start(self) -> Client600:
        assert self.hello() == self.version
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
        assert "ops.cpp:4762: fatal error" in proc.output(), proc.output()[-2000:]
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


# (version, what, the node the old kernel aborts on, the one it runs, the server's last words: the
# line kerneltypes.GAPS cites): builders of the unit tests
CASES = [
    ("6.0.0", "MUL_MAT F32 x F16", kt.mul_mat(kt.F32, kt.F16), kt.mul_mat(kt.F32, kt.F32),
     "ggml-cpu.c:1332: GGML_ASSERT(src1->type == GGML_TYPE_F32) failed"),
    ("5.1.0", "GELU BF16", kt.unary(8, kt.BF16), kt.unary(8, kt.F32), "ops.cpp:2223: fatal error"),
    ("4.0.1", "SET_ROWS F16 -> F32", kt.set_rows(kt.F16, kt.F32), kt.set_rows(kt.F16, kt.F16),
     "ops.cpp:5119: dst->type = 0 (f32) not supported with src0->type = 1 (f16)"),
    ("4.0.1", "IM2COL F32 kernel -> F16", kt.im2col(kt.F32, kt.F32, kt.F16), kt.im2col(kt.F16, kt.F32, kt.F16),
     "ops.cpp:6365: GGML_ASSERT(src0->type == GGML_TYPE_F16) failed"),
    ("4.0.1", "IM2COL_BACK F16 kernel", kt.im2col_back(kt.F16), kt.im2col_back(kt.F32),
     "ops.cpp:6469: GGML_ASSERT(src1->type == GGML_TYPE_F32) failed"),
    ("4.0.1", "CONCAT gapped q4_0", kt.concat(True), kt.concat(False),
     "ops.cpp:2084: GGML_ASSERT(ggml_is_contiguous(src0)) failed"),
]


def _graph(version, build, base: TensorSpec) -> bytes:
    """The unit test's graph, moved into the buffer ``base`` (same offsets), the node computed."""
    tensors, node = build(version)
    uses = {i: list(node.src).count(i) for i in node.src if i}

    def moved(t: TensorSpec, **kw) -> TensorSpec:
        return dataclasses.replace(t, buffer=base.buffer, data=t.data - kt.BASE + base.data, name=b"t%x" % t.id,
                                   use_count=uses.get(t.id, 0) if version >= (5, 1, 0) else 0, **kw)

    moved_node = moved(node, flags=16, view_src=node.view_src)
    return encode.request("GRAPH_COMPUTE", encode.graph_payload([node.id], [moved(t) for t in tensors] + [moved_node]))


def _client(version, target) -> Client600:
    c = Client600(target)
    c.version = version
    return c.start()


@pytest.mark.parametrize("version,what,bad,good,abort", CASES, ids=[f"{c[0]} {c[1]}" for c in CASES])
def test_a_kernel_gap_aborts_the_real_server_and_is_refused_through_serve(version, what, bad, good, abort, pki,
                                                                          workdir):
    v = tuple(int(x) for x in version.split("."))
    build = realpeer.release_build(version)
    port = realpeer.reserve_port()
    proc = realpeer.start([build.rpc_server, "-H", "127.0.0.1", "-p", str(port)], workdir / f"rpc-{version}-a.log",
                          f"ggml-rpc-server {version}")
    realpeer.wait_port(port, proc=proc.popen)
    try:
        d = _client(v, port)
        d.sock.sendall(_graph(v, bad, d.alloc(4 << 20)))
        wait_until(lambda: not proc.alive(), 30, f"the {version} server to abort on {what}")
        assert abort in proc.output(), proc.output()[-2000:]
        d.close()
    finally:
        proc.stop()

    port = realpeer.reserve_port()
    proc = realpeer.start([build.rpc_server, "-H", "127.0.0.1", "-p", str(port)], workdir / f"rpc-{version}-b.log",
                          f"ggml-rpc-server {version}")
    realpeer.wait_port(port, proc=proc.popen)
    serve = start_guard("serve", workdir, ["--upstream", f"127.0.0.1:{port}", *pki.serve_args()])
    try:
        s = _client(v, mtls_socket(pki, serve.port))
        assert s.closed_after(_graph(v, bad, s.alloc(4 << 20)))
        assert serve.wait_value("rpcguard_refusals_total", 1, reason="type_not_supported_by_version") == 1
        again = _client(v, mtls_socket(pki, serve.port))
        buf = again.alloc(4 << 20)
        again.sock.sendall(_graph(v, good, buf))
        assert struct.unpack("<I", again.call("DEVICE_COUNT"))[0] == 1  # answered after the graph ran
        again.close()
        assert proc.alive(), proc.output()[-2000:]
        assert serve.wait_value("rpcguard_refusals_total", 1, reason="type_not_supported_by_version") == 1
    finally:
        serve.stop()
        proc.stop()
