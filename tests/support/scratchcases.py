"""Graphs whose CUDA pool scratch (protocol/cudascratch.py) scripts/gpu_check.py measures on a
real CUDA server (``--steps scratch``): each laid out in one buffer (gpucases.Layout), with the
estimate of its node and what serve does with it under ``BUDGET`` on a CUDA node (refused
``cuda_scratch_over_budget`` or forwarded). Small enough to run on a CPU server in the dry run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rpcguard.protocol import cudascratch
from rpcguard.protocol.encode import TensorSpec, pack_tensor
from rpcguard.protocol.ggml import op_table
from rpcguard.protocol.tensor import decode_tensor
from tests.support.gpucases import F16, F32, Q4_0, Layout, _graph, _node, f

__all__ = ["ScratchCase", "CASES", "BUDGET", "BUFFER_BYTES", "estimate"]

#: serve's policy.max_cuda_scratch_bytes in the step's pass through the pair
BUDGET = 4 << 20
BUFFER_BYTES = 64 << 20
_NAMES = op_table((7, 0, 0)).names  # type: ignore[union-attr]


@dataclass
class ScratchCase:
    name: str
    build: Callable[[Layout], tuple[list[TensorSpec], TensorSpec]]

    def frame(self, L: Layout) -> tuple[bytes, int, TensorSpec]:
        """(GRAPH_COMPUTE frame, estimated scratch, the node) laid out in ``L``."""
        tensors, node = self.build(L)
        return _graph(tensors, node), estimate(tensors, node), node

    def want(self) -> str:
        """On a CUDA node under BUDGET: the refusal, or "forwarded"."""
        tensors, node = self.build(Layout(1, 1 << 40, size=BUFFER_BYTES))
        return "cuda_scratch_over_budget" if estimate(tensors, node) > BUDGET else "forwarded"


def estimate(tensors: list[TensorSpec], node: TensorSpec) -> int:
    by_id = {t.id: decode_tensor(memoryview(pack_tensor(t))) for t in tensors}
    srcs = [by_id.get(i) for i in node.src] + [None] * (10 - len(node.src))
    return cudascratch.node_scratch(_NAMES[node.op], decode_tensor(memoryview(pack_tensor(node))), srcs)


def _mmq(L: Layout):  # prefill of a quantized weight: src1 as q8_1 + the stream-k fixup (MMQ)
    a, b = L.T(Q4_0, (2048, 2048, 1, 1)), L.T(F32, (2048, 256, 1, 1))
    return [a, b], _node(L, F32, (2048, 256, 1, 1), "MUL_MAT", [a, b])


def _mmvq(L: Layout):  # decode: one column, src1 as q8_1 (MMVQ)
    a, b = L.T(Q4_0, (2048, 2048, 1, 1)), L.T(F32, (2048, 1, 1, 1))
    return [a, b], _node(L, F32, (2048, 1, 1, 1), "MUL_MAT", [a, b])


def _cublas_f16(L: Layout):  # an F16 weight: cuBLAS, src1 to F16 and an F16 dst temporary
    a, b = L.T(F16, (2048, 2048, 1, 1)), L.T(F32, (2048, 256, 1, 1))
    return [a, b], _node(L, F32, (2048, 256, 1, 1), "MUL_MAT", [a, b])


def _fa(n_q: int, n_kv: int):
    def build(L: Layout):
        q = L.T(F32, (128, n_q, 32, 1))
        k, v = L.T(F16, (128, n_kv, 8, 1)), L.T(F16, (128, n_kv, 8, 1))
        mask = L.T(F16, (n_kv, n_q, 1, 1))
        node = _node(L, F32, (128, 32, n_q, 1), "FLASH_ATTN_EXT", [q, k, v, mask], op_params=(f(0.088), 0, 0, 0))
        return [q, k, v, mask], node
    return build


CASES: tuple[ScratchCase, ...] = (
    ScratchCase("mmq_prefill", _mmq),
    ScratchCase("mmvq_decode", _mmvq),
    ScratchCase("cublas_f16", _cublas_f16),
    ScratchCase("fa_prefill", _fa(256, 512)),
    ScratchCase("fa_decode", _fa(1, 4096)),
)
