"""CUDA pool scratch (protocol/cudascratch.py): per-node estimates from the allocations of
ggml-cuda b11434 (each test recomputes the cited formula), graphs a real llama.cpp client builds
accepted on a CUDA node under the default budget, an oversized one refused
``cuda_scratch_over_budget`` on CUDA only (the CPU layer never counts it)."""

from __future__ import annotations

import struct

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol import cudascratch as cs
from rpcguard.protocol.encode import TensorSpec, graph_payload
from rpcguard.protocol.ggml import TYPES, op_table
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.tensor import decode_tensor
from rpcguard.protocol.versions import spec_for

V7 = (7, 0, 0)
OPS = op_table(V7).ids  # type: ignore[union-attr]
F32, F16, Q4_0, Q8_0, I32 = 0, 1, 2, 8, 26
HANDLE, BASE, SIZE = 0x5555, 0x7F0000000000, 1 << 44
GIB = 1 << 30


def f(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def T(id: int, type: int, ne, **kw) -> TensorSpec:
    info = TYPES[type]
    kw.setdefault("data", BASE + (id & 0xFF) * (1 << 36))  # far apart: every tensor fits its own slot
    return TensorSpec(id=id, type=type, ne=ne, type_size=info.type_size, blck_size=info.blck_size, buffer=HANDLE, **kw)


def state() -> SessionState:
    st = SessionState(UpstreamFacts(device_count=1), spec=spec_for(V7))
    st.add_buffer(HANDLE, 0, SIZE)
    st.buffers[HANDLE].base = BASE
    return st


def run(tensors, node, backend: str, budget: int = cs.MAX_CUDA_SCRATCH_BYTES) -> None:
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend=backend,
                                      max_cuda_scratch_bytes=budget, max_graph_compute_s=0, max_work_bytes=1 << 62))
    v.check(memoryview(graph_payload([node.id], tensors + [node])), state())


def scratch(tensors, node) -> int:
    ts = {t.id: decode_tensor(memoryview(_pack(t))) for t in tensors}
    n = decode_tensor(memoryview(_pack(node)))
    name = op_table(V7).names[node.op]  # type: ignore[union-attr]
    return cs.node_scratch(name, n, [ts.get(i) for i in node.src] + [None] * (10 - len(node.src)))


def _pack(t: TensorSpec) -> bytes:
    from rpcguard.protocol.encode import pack_tensor
    return pack_tensor(t)


# -- graphs a real client builds (llama.cpp b11434 shapes of a 70B: n_embd 8192, n_ff 28672,
#    64 heads of 128, 8 KV heads, vocabulary 128256) ----------------------------------------------

def mul_mat(a_type: int, k: int, m: int, n: int, b_type: int = F32):
    a, b = T(0x10, a_type, (k, m, 1, 1)), T(0x11, b_type, (k, n, 1, 1))
    return [a, b], T(0x20, F32, (m, n, 1, 1), op=OPS["MUL_MAT"], src=(0x10, 0x11))


def flash_attn(n_q: int, n_kv: int, kv_type: int = F16, d: int = 128, heads: int = 64, kv_heads: int = 8):
    q = T(0x10, F32, (d, n_q, heads, 1))
    k = T(0x11, kv_type, (d, n_kv, kv_heads, 1))
    v = T(0x12, kv_type, (d, n_kv, kv_heads, 1))
    mask = T(0x13, F16, (n_kv, n_q, 1, 1))
    node = T(0x20, F32, (d, heads, n_q, 1), op=OPS["FLASH_ATTN_EXT"], src=(0x10, 0x11, 0x12, 0x13),
             op_params=(f(0.088), 0, 0, 0))
    return [q, k, v, mask], node


def q8_1(rows: int, k: int) -> int:
    # mmq.cu:188-189: ne11*ne10_padded*sizeof(block_q8_1_mmq)/QK8_1_MMQ + J_max*sizeof(block_q8_1_mmq)
    return rows * (-(-k // 512) * 512) * 144 // 128 + 256 * 144


MMQ_FIXUP = 160 * 256 * 128 * 4  # mmq.cuh:1459-1461 at most NSM_MAX blocks x J x I floats


def test_mmq_prefill_of_a_quantized_ffn_weight():
    tensors, node = mul_mat(Q4_0, 8192, 28672, 2048)
    assert scratch(tensors, node) == q8_1(2048, 8192) + MMQ_FIXUP  # ~40 MB
    tensors, node = mul_mat(Q8_0, 28672 + 100, 8192, 512)  # ne10 not a multiple of 512: padded rows
    assert scratch(tensors, node) == q8_1(512, 28672 + 100) + MMQ_FIXUP
    tensors, node = mul_mat(Q4_0, 8192, 128256, 1)  # decode: MMVQ, src1 as q8_1 only (mmvq.cu:1531)
    assert scratch(tensors, node) == q8_1(1, 8192)


def test_cublas_converts_to_f16_and_computes_into_an_f16_temporary():
    # F16 output projection over 2048 tokens: src1 F32 -> F16 (ggml-cuda.cu:1476), dst_temp (:1524)
    tensors, node = mul_mat(F16, 8192, 128256, 2048)
    assert scratch(tensors, node) == 8192 * 2048 * 2 + 128256 * 2048 * 2 + 3 * 8
    # a quantized src0 with a Q8_0 src1 goes to cuBLAS (:1891), which converts both to F16 (:1449, :1476)
    tensors, node = mul_mat(Q4_0, 8192, 28672, 64, b_type=Q8_0)
    assert scratch(tensors, node) == 8192 * 28672 * 2 + 8192 * 64 * 2 + 28672 * 64 * 2 + 3 * 8


def test_flash_attention_prefill_and_decode():
    tensors, node = flash_attn(2048, 4096)  # MMA, stream-k fixup (fattn-common.cuh:1188-1189)
    assert scratch(tensors, node) == 160 * 32 * 64 * (2 + 64) * 8
    tensors, node = flash_attn(1, 32768)  # VEC: parallel blocks of dst (:1216-1218), 64 dst tiles
    blocks = min(32768 // 32, max(32, -(-21 * 160 * 32 // 64)))
    assert scratch(tensors, node) == blocks * (128 * 64 * 4 + 64 * 8)
    tensors, node = flash_attn(512, 4096, d=72, heads=8, kv_heads=8)  # TILE (fattn.cu:638): head size 72
    blocks = min(4096 // 32, max(32, -(-21 * 160 * 32 // (512 // 64 * 8))))
    assert scratch(tensors, node) == blocks * (72 * 8 * 512 * 4 + 8 * 512 * 8)


@pytest.mark.parametrize("build", [
    lambda: mul_mat(Q4_0, 8192, 28672, 2048),      # FFN up/gate, prefill
    lambda: mul_mat(Q4_0, 28672, 8192, 2048),      # FFN down, prefill
    lambda: mul_mat(Q4_0, 8192, 128256, 1),        # output, decode (MMVQ)
    lambda: mul_mat(F16, 8192, 128256, 2048),      # F16 output over a whole batch (perplexity)
    lambda: flash_attn(2048, 32768),               # prefill at 32k context
    lambda: flash_attn(2048, 4096, kv_type=Q8_0),  # quantized KV cache
    lambda: flash_attn(1, 131072),                 # decode at 128k
], ids=["ffn_up", "ffn_down", "output_decode", "output_f16_batch", "fa_prefill_32k", "fa_q8_0", "fa_decode_128k"])
def test_real_graphs_are_accepted_on_cuda_under_the_default_budget(build):
    tensors, node = build()
    assert scratch(tensors, node) < cs.MAX_CUDA_SCRATCH_BYTES
    run(tensors, node, "cuda")


def oversized():
    """A Q4_0 matrix of 8192 x 300000 (1.4 GB) multiplied by a Q8_0 src1 (its vec_dot type, which the
    constructor rows accept): not F32, so cuBLAS (ggml-cuda.cu:1891), which converts all of
    it to F16 in the pool (4.9 GB, ggml-cuda.cu:1449)."""
    return mul_mat(Q4_0, 8192, 300_000, 8, b_type=Q8_0)


def test_an_oversized_node_is_refused_on_cuda_only():
    tensors, node = oversized()
    assert scratch(tensors, node) > cs.MAX_CUDA_SCRATCH_BYTES
    with pytest.raises(FirewallRefusal) as exc:
        run(tensors, node, "cuda")
    assert exc.value.reason == "cuda_scratch_over_budget" and "ggml-cuda.cu:1440" in exc.value.detail
    run(tensors, node, "cuda", budget=0)  # 0: off
    run(tensors, node, "cuda", budget=8 * GIB)
    run(tensors, node, "cpu", budget=1)  # the CPU layer never counts pool scratch
    run(tensors, node, "auto", budget=1)  # nothing detected: the CPU layer


def test_the_budget_is_the_peak_node_not_the_sum():
    # MMQ nodes of 40 MB and 87 MB (127 MB together) under a 100 MB budget: each fits, the pool
    # frees a node's scratch before the next
    a = T(0x10, Q4_0, (8192, 28672, 1, 1))
    b = T(0x11, F32, (8192, 2048, 1, 1))
    c = T(0x12, Q4_0, (28672, 8192, 1, 1))
    n1 = T(0x20, F32, (28672, 2048, 1, 1), op=OPS["MUL_MAT"], src=(0x10, 0x11))
    n2 = T(0x21, F32, (8192, 2048, 1, 1), op=OPS["MUL_MAT"], src=(0x12, 0x20))
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend="cuda",
                                      max_cuda_scratch_bytes=100 << 20, max_graph_compute_s=0))
    v.check(memoryview(graph_payload([0x20, 0x21], [a, b, c, n1, n2])), state())
    assert scratch([a, b], n1) + scratch([c, n1], n2) > 100 << 20 > scratch([c, n1], n2) > 60 << 20
    v = GraphValidator(FirewallPolicy(max_graph_nodes=64, max_graph_tensors=64, backend="cuda",
                                      max_cuda_scratch_bytes=60 << 20, max_graph_compute_s=0))
    with pytest.raises(FirewallRefusal) as exc:
        v.check(memoryview(graph_payload([0x20, 0x21], [a, b, c, n1, n2])), state())
    assert exc.value.reason == "cuda_scratch_over_budget"


def test_ops_without_pool_scratch_cost_nothing():
    a = T(0x10, F32, (4096, 8, 1, 1))
    node = T(0x20, F32, (4096, 8, 1, 1), op=OPS["SCALE"], src=(0x10,), op_params=(f(2.0), 0))
    assert scratch([a], node) == 0


def test_argsort_in_shared_memory_takes_nothing_and_cub_takes_its_buffers():
    small = T(0x10, F32, (1024, 64, 1, 1))
    node = T(0x20, I32, (1024, 64, 1, 1), op=OPS["ARGSORT"], src=(0x10,))
    assert scratch([small], node) == 0  # argsort.cu:287 bitonic
    big = T(0x10, F32, (200_000, 4, 1, 1))
    node = T(0x20, I32, (200_000, 4, 1, 1), op=OPS["ARGSORT"], src=(0x10,))
    n = 200_000 * 4
    assert scratch([big], node) == 12 * n + 4 * 5 + 8 * n + (1 << 20)  # argsort.cu:52-55,70 + CUB estimate


def test_the_policy_key(tmp_path):
    from rpcguard.config.model import parse_config

    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    assert FirewallPolicy().max_cuda_scratch_bytes == 4 * GIB
    data = {"tls": {"cert": "cert.pem", "key": "key.pem", "ca": "ca.pem"}, "allow": {"cn": ["llama1"]},
            "listeners": [{"name": "gpu0", "listen": "127.0.0.1:50100", "upstream": "127.0.0.1:50052",
                           "policy": {"max_cuda_scratch_bytes": "1GiB"}}]}
    cfg = parse_config(data, base_dir=str(tmp_path))
    assert cfg.listeners[0].policy.firewall.max_cuda_scratch_bytes == GIB
