"""The CUDA gap study's cases (shared/cuda/gap-study.md, Appendix A and 2.A) as requests: what a
certificate holder can send that the CPU-derived rules accept and a CUDA ggml-rpc-server aborts
on or lets out of bounds. Each case is laid out in one buffer the caller allocated (``Layout``),
so the same case runs in a unit test (a fixed base) and against a real server (scripts/gpu_check.py,
after ALLOC_BUFFER and BUFFER_GET_BASE). ``want`` is the reason the CUDA layer (oprules/cuda.py,
protocol/backend.py) refuses it with; on a CPU node every case is forwarded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable

from rpcguard.protocol import encode
from rpcguard.protocol.encode import TensorSpec, graph_payload
from rpcguard.protocol.ggml import TYPES, op_table

__all__ = ["Layout", "Case", "CASES", "BUFFER_BYTES"]

OPS = op_table((7, 0, 0)).ids  # type: ignore[union-attr]
F32, F16, Q4_0, Q8_0, Q4_K, I32, TQ1_0 = 0, 1, 2, 8, 12, 26, 34
#: the buffer every case is laid out in (RMS_NORM of 64 x 70000 floats is the largest, 17.9 MB)
BUFFER_BYTES = 64 << 20


def f(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


@dataclass
class Layout:
    """Places tensors in one buffer: each at the next 256-byte boundary, or at its end."""

    handle: int
    base: int
    size: int = BUFFER_BYTES
    at: int = 0
    next_id: int = 0x10

    def T(self, type_: int, ne, *, data: int | None = None, offset: int = 0, **kw) -> TensorSpec:
        info = TYPES[type_]
        spec = TensorSpec(id=self.next_id, type=type_, ne=tuple(ne), type_size=info.type_size,
                          blck_size=info.blck_size, buffer=self.handle, **kw)
        self.next_id += 1
        nb = spec.strides()
        nbytes = info.type_size + (ne[0] // info.blck_size - 1) * nb[0] + sum((n - 1) * s for n, s in zip(ne[1:], nb[1:]))
        if data is None:
            data = self.base + self.at + offset
            self.at = (self.at + offset + nbytes + 255) // 256 * 256
        spec.data = data
        return spec

    def end(self, nbytes: int, back: int = 0) -> int:
        """The address where ``nbytes`` end exactly ``back`` bytes before the buffer's end."""
        return self.base + self.size - nbytes - back


@dataclass
class Case:
    name: str
    want: str  # the reason on a CUDA node
    cite: str
    build: Callable[[Layout], bytes]  # -> one request frame (GRAPH_COMPUTE, INIT_TENSOR, GET_ALLOC_SIZE)
    doc: str = field(default="")


def _graph(tensors: list[TensorSpec], node: TensorSpec) -> bytes:
    return encode.request("GRAPH_COMPUTE", graph_payload([node.id], [*tensors, node]))


def _node(L: Layout, type_: int, ne, op: str, srcs: list[TensorSpec], **kw) -> TensorSpec:
    return L.T(type_, ne, op=OPS[op], src=tuple(s.id for s in srcs), **kw)


def diag_mask_zero(L: Layout) -> bytes:
    a = L.T(F32, (8, 8, 1, 1))
    return _graph([a], _node(L, F32, (8, 8, 1, 1), "DIAG_MASK_ZERO", [a], op_params=(2,)))


def unary_permuted(L: Layout) -> bytes:
    a = L.T(F32, (4, 3, 2, 1), nb=(4, 32, 16, 96))
    L.at += 256
    return _graph([a], _node(L, F32, (4, 3, 2, 1), "UNARY", [a], op_params=(10,)))  # RELU


def cpy_f32_q4_k(L: Layout) -> bytes:
    a, b = L.T(F32, (256, 2, 1, 1)), L.T(Q4_K, (256, 2, 1, 1))
    return _graph([a, b], _node(L, Q4_K, (256, 2, 1, 1), "CPY", [a, b], view_src=b.id, data=b.data))


def rope_odd(L: Layout) -> bytes:
    a, pos = L.T(F32, (63, 2, 3, 1)), L.T(I32, (3, 1, 1, 1))
    params = (0, 62, 0, 0, 512, f(10000.0), f(1.0), 0, f(1.0), f(32.0), f(1.0), 0, 0, 0, 0, 0)
    return _graph([a, pos], _node(L, F32, (63, 2, 3, 1), "ROPE", [a, pos], op_params=params))


def _fa(L: Layout, d: int, kv: int, dst_at_end: bool = False) -> bytes:
    n_q, n_kv = 4, 256
    q, k, v = L.T(F32, (d, n_q, 8, 1)), L.T(kv, (d, n_kv, 8, 1)), L.T(kv, (d, n_kv, 8, 1))
    mask = L.T(F16, (n_kv, n_q, 1, 1))
    kw = {"data": L.end(d * 8 * n_q * 4, 64)} if dst_at_end else {}
    node = _node(L, F32, (d, 8, n_q, 1), "FLASH_ATTN_EXT", [q, k, v, mask], op_params=(f(0.125), 0, 0, 0), **kw)
    return _graph([q, k, v, mask], node)


def rms_norm_grid(L: Layout) -> bytes:
    a = L.T(F32, (64, 1, 70000, 1))
    return _graph([a], _node(L, F32, (64, 1, 70000, 1), "RMS_NORM", [a], op_params=(f(1e-6),)))


def pad_grid(L: Layout) -> bytes:
    a = L.T(F32, (1, 70000, 1, 1))
    return _graph([a], _node(L, F32, (2, 70000, 1, 1), "PAD", [a], op_params=(0, 1, 0, 0, 0, 0, 0, 0, 0)))


def _add(L: Layout, offset: int = 0, b_nb1: int = 16) -> bytes:
    a = L.T(F32, (4, 2, 1, 1), offset=offset)
    b = L.T(F32, (4, 2, 1, 1), nb=(4, b_nb1, 2 * b_nb1, 2 * b_nb1))
    L.at += 256
    return _graph([a, b], _node(L, F32, (4, 2, 1, 1), "ADD", [a, b]))


def mul_mat_tq1(L: Layout) -> bytes:
    a, b = L.T(TQ1_0, (256, 8, 1, 1)), L.T(F32, (256, 3, 1, 1))
    return _graph([a, b], _node(L, F32, (8, 3, 1, 1), "MUL_MAT", [a, b]))


def mul_mat_padding(L: Layout) -> bytes:
    a = L.T(Q8_0, (64, 8, 1, 1), data=L.end(8 * 68))  # its padded last row (476 bytes) is past the end
    b = L.T(F32, (64, 3, 1, 1))
    return _graph([a, b], _node(L, F32, (8, 3, 1, 1), "MUL_MAT", [a, b]))


def init_tensor_padding(L: Layout) -> bytes:
    t = L.T(Q8_0, (64, 2, 1, 1), data=L.end(2 * 68))
    return encode.request("INIT_TENSOR", encode.pack_tensor(t))


def alloc_size_nb0(L: Layout) -> bytes:
    t = TensorSpec(id=1, type=Q8_0, ne=(64, 2, 1, 1), nb=(68, 136, 272, 272), type_size=34, blck_size=32)
    return encode.request("GET_ALLOC_SIZE", struct.pack("<I", 0) + encode.pack_tensor(t) + bytes(10 * 296))


def alloc_size_fa_no_srcs(L: Layout) -> bytes:
    t = TensorSpec(id=1, type=F32, ne=(128, 8, 4, 1), type_size=4, blck_size=1, op=OPS["FLASH_ATTN_EXT"])
    return encode.request("GET_ALLOC_SIZE", struct.pack("<I", 0) + encode.pack_tensor(t) + bytes(10 * 296))


# -- fused kernels (oprules/cudafusion.py): several nodes, each passing alone, that CUDA would run as
# one kernel. The nodes carry GGML_TENSOR_FLAG_COMPUTE (16: the CUDA backend skips a node without
# it, ggml-cuda.cu:4421) and the intermediates use_count 1 (the server takes it as sent,
# ggml-rpc.cpp:1776-1778), so an unprotected server fuses them.
COMPUTE = 16


def _graph_n(tensors: list[TensorSpec], nodes: list[TensorSpec]) -> bytes:
    return encode.request("GRAPH_COMPUTE", graph_payload([n.id for n in nodes], [*tensors, *nodes]))


def fused_bias_f16(L: Layout) -> bytes:
    # ADD(bias F16, mm): per node an F16 + F32 -> F16 add; fused into MMVQ, mmvq.cu:1487 asserts F32
    w, x, bias = L.T(Q8_0, (256, 8, 1, 1)), L.T(F32, (256, 1, 1, 1)), L.T(F16, (8, 1, 1, 1))
    mm = _node(L, F32, (8, 1, 1, 1), "MUL_MAT", [w, x], flags=COMPUTE, use_count=1)
    add = _node(L, F16, (8, 1, 1, 1), "ADD", [bias, mm], flags=COMPUTE)
    return _graph_n([w, x, bias], [mm, add])


def fused_rms_weight_nb0(L: Layout) -> bytes:
    # a broadcast weight of one column with nb0 8: ggml_is_contiguous_rows skips nb0; norm.cu:571 asserts it
    x, w = L.T(F32, (64, 3, 1, 1)), L.T(F32, (1, 3, 1, 1), nb=(8, 8, 24, 24))
    rms = _node(L, F32, (64, 3, 1, 1), "RMS_NORM", [x], op_params=(f(1e-6),), flags=COMPUTE, use_count=1)
    mul = _node(L, F32, (64, 3, 1, 1), "MUL", [rms, w], flags=COMPUTE)
    return _graph_n([x, w], [rms, mul])


def fused_silu_nb0(L: Layout) -> bytes:
    # SILU(u) * o with o of one column and nb0 8: unary.cu:674 asserts nb0
    u, o = L.T(F32, (1, 4, 1, 1)), L.T(F32, (1, 4, 1, 1), nb=(8, 4, 16, 16))
    act = _node(L, F32, (1, 4, 1, 1), "UNARY", [u], op_params=(10,), flags=COMPUTE, use_count=1)  # SILU
    mul = _node(L, F32, (1, 4, 1, 1), "MUL", [act, o], flags=COMPUTE)
    return _graph_n([u, o], [act, mul])


def rope_store_misaligned(L: Layout) -> bytes:
    # normal-mode ROPE stores each pair as one int2 (rope.cu:88-96): a dst at 4 mod 8 faults
    a, pos = L.T(F32, (8, 2, 3, 1)), L.T(I32, (3, 1, 1, 1))
    params = (0, 8, 0, 0, 512, f(10000.0), f(1.0), 0, f(1.0), f(32.0), f(1.0), 0, 0, 0, 0, 0)
    return _graph([a, pos], _node(L, F32, (8, 2, 3, 1), "ROPE", [a, pos], op_params=params, offset=4, flags=COMPUTE))


U, M, G, X, R = ("backend_unsupported_op", "backend_misaligned", "backend_grid_too_large", "backend_index_overflow",
                 "backend_reach_out_of_buffer")
CASES: tuple[Case, ...] = (
    Case("diag_mask_zero", U, "ggml-cuda.cu:2474-2475,4458", diag_mask_zero),
    Case("unary_permuted", U, "unary.cu:144", unary_permuted),
    Case("cpy_f32_q4_k", U, "cpy.cu:618", cpy_f32_q4_k),
    Case("rope_ne0_63", U, "rope.cu:383", rope_odd),
    Case("fa_d32", U, "fattn.cu:621-622", lambda L: _fa(L, 32, F16)),
    Case("fa_q4_k", U, "fattn.cu:524-539", lambda L: _fa(L, 256, Q4_K)),
    Case("fa_q8_0_dst_at_end", R, "fattn-common.cuh:53-83", lambda L: _fa(L, 128, Q8_0, dst_at_end=True)),
    Case("rms_norm_ne2_70000", G, "norm.cu:313", rms_norm_grid),
    Case("pad_ne1_70000", G, "pad.cu:70", pad_grid),
    Case("add_data_plus_2", M, "binbcast.cu:284-297", lambda L: _add(L, offset=2)),
    Case("add_nb1_18", M, "binbcast.cu:284-297", lambda L: _add(L, b_nb1=18)),
    Case("mul_mat_tq1_0", U, "ggml-cuda.cu:5344-5374", mul_mat_tq1),
    Case("mul_mat_q8_0_padding", R, "common.cuh:186, ggml-cuda.cu:911-917", mul_mat_padding),
    Case("init_tensor_padding", R, "ggml-cuda.cu:758-766", init_tensor_padding),
    Case("alloc_size_nb0", U, "ggml-cuda.cu:914", alloc_size_nb0),
    Case("alloc_size_fa_no_srcs", U, "fattn.cu:553,729-730", alloc_size_fa_no_srcs),
    Case("fused_bias_f16", "backend_fusion_unsupported", "mmvq.cu:1487, mmvf.cu:668", fused_bias_f16),
    Case("fused_rms_weight_nb0", "backend_fusion_unsupported", "norm.cu:571", fused_rms_weight_nb0),
    Case("fused_silu_nb0", "backend_fusion_unsupported", "unary.cu:674", fused_silu_nb0),
    Case("rope_store_misaligned", M, "rope.cu:88-96", rope_store_misaligned),
)
