"""Cost profiles per backend: the compute budget in seconds on the node's own backend (issue 29).

How this works: cost.py prices a node in CPU flop-equivalents, and ``node_gflops`` turns them into
seconds, a model measured against ggml-cpu. A GPU has other proportions: matrix products run
100-1000x faster, memory-bound work ~20x, and it pays per kernel launch and, in a few kernels,
per row on the host (gap study section 4). A ``CostProfile`` says, for one backend class, the
matrix throughput per type class of the weights (F16/BF16 tensor cores, F32 SIMT, quantized
MMQ/MMVQ), the memory bandwidth, the other kernels' element throughput, the launch cost, the
per-row host costs, and its own budget ``budget_s`` for one graph. ``node_seconds`` estimates one
node; ``node_cost`` is the hook graph.py calls: on a layer with a profile it returns that estimate
as flop at ``node_gflops`` (so the session's bookkeeping, recompute charges and the fair slot's
estimates stay in the seconds they were), else cost.flops unchanged (the CPU). ``check_budget``
refuses a graph whose profile estimate exceeds the profile's budget (``graph_too_costly``).

The CUDA rates are the slow end of what an H100/H200 class GPU does (public figures: ~990
TFLOP/s dense F16 peak, 3.35-4.8 TB/s HBM; measured here by the device tool's notes: 788 TFLOP/s
bf16, 3.0-4.3 TB/s device copies) divided by 3-5, so a real graph is over-estimated; they are
not measured against ggml-cuda yet (scripts/gpu-check.sh's bench step is where that starts).
The wall-clock watchdog (``limits.max_graph_s``) stays the backstop for what the model misses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Mapping

from rpcguard.errors import FirewallRefusal
from rpcguard.protocol.cost import flops, moved_bytes
from rpcguard.protocol.ggml import TYPES
from rpcguard.protocol.tensor import RpcTensor
from rpcguard.protocol.workbuf import Srcs

__all__ = ["CostProfile", "PROFILES", "CUDA", "node_seconds", "node_cost", "check_budget", "weight_class"]

_F32, _F16, _BF16 = 0, 1, 30
_MATRIX: Final = frozenset({"MUL_MAT", "MUL_MAT_ID", "OUT_PROD"})


@dataclass(frozen=True)
class CostProfile:
    """One backend class's rates (see the module docstring); seconds, bytes, flop."""

    name: str
    matrix_flop_s: Mapping[str, float]  # weight type class ("f16", "f32", "quant") -> flop/s of a product
    attention_flop_s: float  # FLASH_ATTN_EXT's products
    bytes_s: float  # memory bandwidth every node's reads and writes pay
    element_flop_s: float  # cost.flops of the other kernels (element-wise, norms, ...)
    launch_s: float  # per node: one or more kernel launches and the host's dispatch
    row_s: Mapping[str, float]  # op -> seconds per row of host work (a launch chain per row)
    budget_s: float  # one graph's estimate above this is refused graph_too_costly


def weight_class(type_: int) -> str:
    """The matrix kernel family a product's src[0] type selects: tensor-core F16/BF16, F32, quantized."""
    if type_ in (_F16, _BF16):
        return "f16"
    if type_ == _F32:
        return "f32"
    return "quant"


#: NVIDIA H100/H200 class (sm_90): see the module docstring for where each rate comes from
CUDA: Final = CostProfile(
    name="cuda",
    matrix_flop_s={"f16": 150e12, "quant": 100e12, "f32": 20e12},
    attention_flop_s=100e12,
    bytes_s=1.0e12,
    element_flop_s=5e12,
    launch_s=10e-6,
    # top-k.cu:236-238: CUB top-k launches one chain per row; the MUL_MAT_ID fallback copies the
    # ids to the host and loops experts x tokens x k there (ggml-cuda.cu:2019-2051)
    row_s={"TOP_K": 10e-6, "ARGSORT": 1e-6, "MUL_MAT_ID": 1e-6},
    budget_s=60.0,
)
PROFILES: Final[Mapping[str, CostProfile]] = {"cuda": CUDA}


def _rows(t: RpcTensor | None) -> int:
    return 0 if t is None else t.ne1 * t.ne2 * t.ne3


def node_seconds(p: CostProfile, op: str, node: RpcTensor, srcs: Srcs) -> float:
    """Estimated seconds of one node on ``p``'s backend."""
    if op in ("NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"):
        return 0.0
    s = p.launch_s + moved_bytes(op, node, srcs) / p.bytes_s
    a = srcs[0] if srcs else None
    if op in _MATRIX and a is not None:
        depth = a.ne0 if op != "OUT_PROD" else a.ne1
        s += 2 * depth * node.ne0 * node.ne1 * node.ne2 * node.ne3 / p.matrix_flop_s[weight_class(a.type)]
    elif op == "FLASH_ATTN_EXT" and a is not None and srcs[1] is not None and srcs[2] is not None:
        k, v = srcs[1], srcs[2]
        s += 2 * a.ne1 * a.ne2 * a.ne3 * k.ne1 * (k.ne0 + v.ne0) / p.attention_flop_s
    else:
        s += flops(op, node, srcs) / p.element_flop_s
    per_row = p.row_s.get(op)
    if per_row:
        rows = _rows(srcs[2]) * (srcs[2].ne0 if srcs[2] is not None else 0) if op == "MUL_MAT_ID" else _rows(a)
        s += rows * per_row
    return s


def node_cost(layer: str, op: str, node: RpcTensor, srcs: Srcs, node_flops: float) -> int:
    """graph.py's per-node estimate: cost.flops on a layer without a profile (the CPU), else the
    profile's seconds as flop at ``node_flops`` (the rate the rest of the budget divides by)."""
    p = PROFILES.get(layer)
    if p is None:
        return flops(op, node, srcs)
    return int(node_seconds(p, op, node, srcs) * node_flops)


def check_budget(layer: str, seconds: float, enabled: bool = True) -> None:
    """Refuse a graph whose estimate on ``layer``'s profile exceeds the profile's budget."""
    p = PROFILES.get(layer)
    if p is not None and enabled and seconds > p.budget_s:
        raise FirewallRefusal("graph_too_costly", f"estimated {seconds:.1f} s on the {p.name} profile > its budget "
                                                  f"{p.budget_s:g} s (protocol/costprofile.py)")


assert all(t in TYPES for t in (_F32, _F16, _BF16))
