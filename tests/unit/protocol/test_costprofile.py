"""Cost profiles per backend (protocol/costprofile.py): on the CUDA profile a 70B prefill at
ubatch 2048 is far inside the budget by the estimator, long contexts too, while a crafted graph
of per-row host work is refused; the CPU layer keeps cost.flops."""

from __future__ import annotations

import pytest

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol import costprofile
from rpcguard.protocol.cost import flops
from rpcguard.protocol.encode import TensorSpec, graph_payload, pack_tensor
from rpcguard.protocol.ggml import TYPES, op_table
from rpcguard.protocol.graph import GraphValidator
from rpcguard.protocol.settings import FirewallPolicy
from rpcguard.protocol.state import SessionState, UpstreamFacts
from rpcguard.protocol.tensor import decode_tensor
from rpcguard.protocol.versions import spec_for

F32, F16, Q4_0, I32 = 0, 1, 2, 26
OPS = op_table((7, 0, 0)).ids  # type: ignore[union-attr]


def t(type_: int, ne) -> object:
    info = TYPES[type_]
    return decode_tensor(pack_tensor(TensorSpec(id=1, type=type_, ne=tuple(ne), type_size=info.type_size,
                                                blck_size=info.blck_size)))


def llama_prefill_seconds(weights: int, n_tokens: int, n_kv: int, *, n_layer=80, n_embd=8192, n_ff=28672,
                          n_head=64, n_head_kv=8, head_dim=128, kv_type=F16) -> float:
    """One ubatch through every layer of a Llama-style model: its matrix products (the shapes
    llama.cpp's build_attn / build_ffn make) and flash attention, on the CUDA profile."""
    p = costprofile.CUDA
    x = t(F32, (n_embd, n_tokens, 1, 1))
    total = 0.0
    per_layer = [(n_embd, n_embd), (n_embd, n_head_kv * head_dim), (n_embd, n_head_kv * head_dim),
                 (n_embd, n_embd), (n_embd, n_ff), (n_embd, n_ff), (n_ff, n_embd)]
    for k, n in per_layer:
        w = t(weights, (k, n, 1, 1))
        src1 = x if k == n_embd else t(F32, (n_ff, n_tokens, 1, 1))
        total += costprofile.node_seconds(p, "MUL_MAT", t(F32, (n, n_tokens, 1, 1)), [w, src1, None])
    q = t(F32, (head_dim, n_tokens, n_head, 1))
    kk, vv = t(kv_type, (head_dim, n_kv, n_head_kv, 1)), t(kv_type, (head_dim, n_kv, n_head_kv, 1))
    mask = t(F16, (n_kv, n_tokens, 1, 1))
    total += costprofile.node_seconds(p, "FLASH_ATTN_EXT", t(F32, (head_dim, n_head, n_tokens, 1)), [q, kk, vv, mask])
    total += 10 * costprofile.node_seconds(p, "ADD", x, [x, x])  # norms, residuals, rope, ...: element-wise
    return total * n_layer


@pytest.mark.parametrize("weights", [Q4_0, F16])
def test_70b_prefill_at_ubatch_2048_fits_the_cuda_budget(weights):
    s = llama_prefill_seconds(weights, 2048, 2048)
    assert s < costprofile.CUDA.budget_s / 4, s  # 2-4 s estimated (real H200: ~0.3-0.5 s)
    # a long context (32k cached) at the same ubatch: still inside
    assert llama_prefill_seconds(weights, 2048, 32768) < costprofile.CUDA.budget_s


def test_the_cpu_layer_keeps_cost_flops():
    a, b = t(Q4_0, (4096, 4096, 1, 1)), t(F32, (4096, 512, 1, 1))
    d = t(F32, (4096, 512, 1, 1))
    assert costprofile.node_cost("cpu", "MUL_MAT", d, [a, b, None], 40e9) == flops("MUL_MAT", d, [a, b, None])
    gpu = costprofile.node_cost("cuda", "MUL_MAT", d, [a, b, None], 40e9)
    assert gpu < flops("MUL_MAT", d, [a, b, None]) / 50  # a GPU does this product far faster


def test_per_row_host_work_is_priced():
    # top-k.cu:236-238: one launch chain per row: 10^7 rows of 2 floats (80 MB) are minutes
    src = t(F32, (2, 10_000_000, 1, 1))
    node = t(I32, (1, 10_000_000, 1, 1))
    s = costprofile.node_seconds(costprofile.CUDA, "TOP_K", node, [src])
    assert s > costprofile.CUDA.budget_s
    with pytest.raises(FirewallRefusal) as exc:
        costprofile.check_budget("cuda", s)
    assert exc.value.reason == "graph_too_costly"
    costprofile.check_budget("cuda", s, enabled=False)  # max_graph_compute_s 0: the budget is off
    costprofile.check_budget("cpu", 1e9)  # no profile: cost.flops and max_graph_compute_s decide


def test_a_crafted_top_k_graph_is_refused_on_cuda_only():
    rows = 8_000_000  # 80 s of per-row launches on the CUDA profile
    base, handle, size = 0x7F0000000000, 0x5555, 1 << 27
    a = TensorSpec(id=0x10, type=F32, ne=(2, rows, 1, 1), type_size=4, blck_size=1, buffer=handle, data=base)
    d = TensorSpec(id=0x20, type=I32, ne=(1, rows, 1, 1), type_size=4, blck_size=1, buffer=handle,
                   data=base + 8 * rows, op=OPS["TOP_K"], src=(0x10,))
    payload = memoryview(graph_payload([0x20], [a, d]))

    def state() -> SessionState:
        st = SessionState(UpstreamFacts(device_count=1), spec=spec_for((7, 0, 0)))
        st.add_buffer(handle, 0, size)
        st.buffers[handle].base = base
        return st

    GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8, backend="cpu")).check(payload, state())
    with pytest.raises(FirewallRefusal) as exc:
        GraphValidator(FirewallPolicy(max_graph_nodes=8, max_graph_tensors=8, backend="cuda")).check(payload, state())
    assert exc.value.reason == "graph_too_costly" and "cuda profile" in exc.value.detail
